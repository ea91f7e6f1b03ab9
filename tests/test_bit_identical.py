"""What "bit-identical to stock" holds for (README, "Numerics"), tested: at TP=2 in fp32 on this
CPU (MKL, one thread per rank), the TP-overlap linears give stock Megatron's exact bits while
every piece a GEMM is cut into holds at least 16 token rows (rows of the piece x micro-batch);
below that MKL's small-M GEMM path sums along K in another order and the last bits move."""

import random

import torch

from . import hardening_rank_fns

MIN_ROWS = 16  # README: the smallest GEMM MKL (2024.2, AVX-512, 1 thread) computes as the whole one does


def test_a_gemm_on_16_rows_or_more_gives_the_whole_gemms_rows_and_fewer_may_not():
    """The premise, on this machine's BLAS: rows [a, a + m) of x @ w^T computed alone equal the
    whole product's for every m >= 16 (any start, the K and N of the layers), and differ for a
    few rows (the 1-row chunks of --overlap-tp-chunks 128 at seq 128)."""
    torch.set_num_threads(1)  # what the ranks run (OMP_NUM_THREADS=1); more threads split large GEMMs
    gen = torch.Generator().manual_seed(random.randrange(1 << 20))
    differs_below = False
    for k, n in ((96, 200), (100, 96), (512, 1024), (1024, 4096)):
        x, w = torch.randn(256, k, generator=gen), torch.randn(n, k, generator=gen)
        whole = x @ w.t()
        for m in (16, 17, 24, 31, 64, 100):
            for start in (0, 7, 256 - m):
                assert torch.equal(x[start:start + m] @ w.t(), whole[start:start + m]), (k, n, m, start)
        differs_below |= not torch.equal(x[:1] @ w.t(), whole[:1])
    assert differs_below  # else the README's reason for the rule is stale: re-measure


def test_tp2_overlap_is_bit_identical_exactly_when_every_piece_has_16_token_rows(pool4):
    cases = [(64, 1, 2, False), (64, 1, 8, False), (64, 1, 8, True), (32, 2, 8, False),  # >= 16 token rows
             (64, 1, 16, False), (64, 1, 128, False), (8, 2, 16, False)]  # 8, 1 and 2 token rows
    for rows in pool4.run(hardening_rank_fns.bit_identity, random.randrange(1 << 20), cases):
        for r in rows:
            assert r["rel"] <= 1e-6, r  # last bits only, either way
            if r["min_token_rows"] >= 16:
                assert r["equal"], r
        small = [r for r in rows if r["min_token_rows"] < 16]
        assert small and not all(r["equal"] for r in small), rows  # the rule's other side is real
