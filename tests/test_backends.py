"""The symm-mem and fused backends: the same autograd composition as p2p, selected by
--overlap-tp, refused clearly where they cannot run; tile-config autotuning agrees across ranks
and is cached."""

import pytest
import torch

import megatron_overlap
from megatron_overlap import OverlapConfigError

from . import gpt_rank_fns, rank_helpers, tp_rank_fns, tune_rank_fns
from .flag_args import megatron_args, parse

# fp32: the fused kernels tile the K dimension differently from torch.matmul, and the fused
# reduce-scatter sums the slots in its own order; both are rounding of fp32 sums (~1e-7).
REL_TOL = 1e-6


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("backend", ["fused", "symm-mem"])
def test_backend_linears_match_stock(pool4, tp, backend, seed):
    rows = pool4.run(tp_rank_fns.backend_layer_parity, tp, backend, seed)
    # the reference symm-mem ops were swapped in for the run only
    assert pool4.run(rank_helpers.symm_mem_ops_in_use) == [("TorchSymmMemOps", "availability")] * 4
    checked = 0
    for rank_rows in rows:
        for row in rank_rows:
            assert row["rel"] <= REL_TOL, row
            checked += 1
    assert checked == 4 * 3 * 4 * (2 if backend == "fused" else 1)


def test_fused_backend_trains_like_stock(pool4):
    stock = pool4.run(gpt_rank_fns.gpt_losses, 2, 4, [], True)
    ours = pool4.run(gpt_rank_fns.gpt_losses, 2, 4, ["--overlap-tp", "fused"], True)
    for a_rank, b_rank in zip(ours, stock):
        for a, b in zip(a_rank, b_rank):
            assert abs(a - b) <= 1e-5 * abs(b)  # as test_training: per-op ~1e-7 through 4 steps


def test_fused_refuses_without_a_gpu_or_interpreter(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA, on any machine
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(OverlapConfigError, match=r"^--overlap-tp: fused: the Triton kernels need a CUDA GPU"):
        megatron_overlap.install(megatron_args("--overlap-tp", "fused"))
    assert not megatron_overlap.is_installed()


def test_symm_mem_refuses_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA, on any machine
    with pytest.raises(OverlapConfigError, match=r"^--overlap-tp: symm-mem: needs CUDA GPUs"):
        megatron_overlap.install(parse("--overlap-tp", "symm-mem"))


def test_backend_flag_conflicts():
    with pytest.raises(OverlapConfigError, match=r"^--overlap-tp-chunks: --overlap-tp symm-mem runs PyTorch's"):
        megatron_overlap.install(parse("--overlap-tp", "symm-mem", "--overlap-tp-chunks", "4"))
    with pytest.raises(OverlapConfigError, match=r"^--overlap-tp-rs: the fused backend reduce-scatters as all-to-all"):
        megatron_overlap.install(parse("--overlap-tp", "fused", "--overlap-tp-rs", "ring"))


def test_fused_refuses_bf16_in_the_interpreter_at_first_run(pool4):
    for message in pool4.run(tp_rank_fns.first_run_error, 2, ["--overlap-tp", "fused"], torch.bfloat16):
        assert message.startswith("OverlapConfigError: --overlap-tp: fused: dtype bfloat16 is not supported here"), message


def test_tile_config_autotuning_agrees_and_caches(pool4, tmp_path):
    results = pool4.run(tune_rank_fns.tuning_agreement, str(tmp_path))
    assert {r["first"] for r in results} == {"32x32x16w4s3"}, results  # min over candidates of the max
    assert all(r["second"] == r["first"] and r["measured_first"] == 3 for r in results), results
