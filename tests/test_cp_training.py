"""The tiny GPT (GQA 8/2, RoPE, SwiGLU, RMSNorm) trained 5 steps under context parallelism, its
batch cut by Megatron's own get_batch_on_this_cp_rank: losses equal the same global batch
without CP. The CP=1 references are stock Megatron with TP=2 (DP=2) and TP=4 (DP=1), whose
global batches are those of CP=2 (DP=2) and CP=4 (DP=1); test_training shows those equal the
plugin's TP overlap, and test_parity that TP sizes agree to ~1e-7."""

import pytest

from . import cp_rank_fns

LOSS_REL_TOL = 1e-5
STEPS = 5


@pytest.fixture(scope="module")
def references(pool4):
    return {tp: pool4.run(cp_rank_fns.gpt_losses_cp, tp, 1, STEPS, [])[0] for tp in (2, 4)}


@pytest.mark.parametrize(
    "tp,cp,flags,ref_tp",
    [
        (1, 2, ["--overlap-cp", "ring"], 2),
        (1, 2, ["--overlap-cp", "a2a"], 2),
        (1, 4, ["--overlap-cp", "ring"], 4),
        (1, 4, ["--overlap-cp", "hybrid", "--overlap-cp-a2a-size", "2"], 4),
        (2, 2, ["--overlap-cp", "ring", "--overlap-tp", "p2p"], 4),
    ],
    ids=["cp2-ring", "cp2-a2a", "cp4-ring", "cp4-hybrid2", "tp2xcp2-ring+tp-overlap"],
)
def test_cp_losses_equal_no_cp(pool4, references, tp, cp, flags, ref_tp):
    ours = pool4.run(cp_rank_fns.gpt_losses_cp, tp, cp, STEPS, flags)
    ref = references[ref_tp]
    assert ref[-1] < ref[0]  # the model learns: the comparison is not of constants
    for rank in range(4):
        assert len(ours[rank]) == STEPS
        for step, (a, b) in enumerate(zip(ours[rank], ref)):
            assert abs(a - b) <= LOSS_REL_TOL * abs(b), (rank, step, a, b)


def test_cp_without_the_flag_names_it(pool4):
    errors = pool4.run(cp_rank_fns.cp_layer_errors)[0]
    assert errors["stock"][0] == "megatron"  # nothing installed: Megatron's own assertion
    kind, flag, msg = errors["tp_only"]
    assert (kind, flag) == ("plugin", "--overlap-cp") and "--context-parallel-size 2" in msg, msg
    assert "--overlap-cp ring" in msg, msg
    kind, flag, msg = errors["a2a_heads"]
    assert (kind, flag) == ("plugin", "--overlap-cp") and "--overlap-cp ring" in msg, msg
