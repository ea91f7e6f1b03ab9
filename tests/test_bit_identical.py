"""README's "gradients bit for bit" for the MLP block, tested as stated: the block of ``megatron-overlap
bench mlp`` with its defaults (hidden 1024, ffn 4096, seq 2048, fp32, TP=2 + SP, 5 tapered
chunks per rank, ring reduce-scatter) gives stock Megatron's exact bits, on any machine that runs
the suite. Elsewhere (other chunk counts, bidirectional) the TP-overlap linears keep the
differences in the last bits (docs/tp-overlap.md, "Numerics")."""

from . import bit_identity_rank_fns


def test_the_readme_mlp_block_is_bit_identical_to_stock(pool4, seed):
    results = [r for r in pool4.run(bit_identity_rank_fns.readme_mlp_block, seed) if r]
    assert len(results) == 2  # the two ranks of one TP=2 group
    for r in results:
        assert r["pieces"] == [5], r["pieces"]  # README's configuration: 5 chunks per rank
        assert set(r["tensors"]) == {"output", "input.grad", "linear_fc1.weight.grad", "linear_fc1.bias.grad",
                                     "linear_fc2.weight.grad", "linear_fc2.bias.grad"}, r["tensors"]
        for key, (equal, rel) in r["tensors"].items():
            assert equal, (key, rel)


def test_other_chunk_counts_move_only_the_last_bits(pool4, seed):
    """Whole shards (2 chunks at TP=2) keep the bits too (whole GEMMs, a + b == b + a); pieces of
    a few rows and the bidirectional ring may take another BLAS kernel: <= 1e-6 relative."""
    cases = [(64, 1, 2, False), (64, 1, 8, True), (8, 2, 16, False)]
    for rows in pool4.run(bit_identity_rank_fns.last_bits, seed, cases):
        for r in rows:
            assert r["rel"] <= 1e-6, r
            if r["case"][2] == 2:
                assert r["equal"], r
