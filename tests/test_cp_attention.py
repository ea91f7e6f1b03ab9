"""Context-parallel attention on CPU gloo against single-rank full attention: every mode (ring,
all-to-all, hybrid), CP 2 and 4, causal and not, GQA 8/2, head dim 24, sequences 48 and 96,
packed documents of lengths [5, 17, 1, 23]; the ring over an explicit, ordered peer list; the
zigzag work balance; and every refused configuration."""

from . import cp_rank_fns

# fp32, relative Frobenius error of each tensor. The blocks merge by log-sum-exp in another
# order than one softmax over the whole row: rounding only, ~1e-7.
REL_TOL = 1e-5


def _check_rows(rows, expect):
    assert len(rows) == expect, (len(rows), expect)
    for row in rows:
        for key in ("out", "dq", "dk", "dv"):
            assert row[key] <= REL_TOL, row


def test_unpacked_parity_every_mode(pool4, seed):
    results = pool4.run(cp_rank_fns.parity_unpacked, seed)
    # per CP size: 3 modes x causal/not x 2 lengths + ring with sdpa / without overlap x causal/not
    for rows in results:
        _check_rows(rows, 2 * (3 * 2 * 2 + 2 * 2))
    assert results[0] == results[1]  # the group's errors were all-reduced: every rank agrees


def test_ring_key_blocks_in_pieces(pool4, seed):
    for rows in pool4.run(cp_rank_fns.ring_pieces_parity, seed):
        _check_rows(rows, 2 * 2 * 2)


def test_packed_documents_not_multiples_of_2cp(pool4, seed):
    for rows in pool4.run(cp_rank_fns.parity_packed, seed):
        _check_rows(rows, 2 * 3 * 2)
        for row in rows:
            # NaN in the padding of q, k, v never reached a real row, and padding rows get zeros
            assert row["pad_clean"], row


def test_ring_over_an_explicit_ordered_peer_list(pool4, seed):
    results = pool4.run(cp_rank_fns.explicit_peer_order, seed)
    idle = results[1]
    assert idle["idle"] and "group rank 1 is not among the ring's peers [2, 0, 3]" in idle["error"]
    for rank in (0, 2, 3):
        assert not results[rank]["idle"]
        _check_rows(results[rank]["rows"], 6)


def test_causal_zigzag_work_is_balanced(pool4):
    for seq in (96, 192):
        work = pool4.run(cp_rank_fns.causal_work, seq)
        for key in ("forward", "backward"):
            counts = [w[key] for w in work]
            mean = sum(counts) / len(counts)
            assert max(counts) <= 1.05 * mean and min(counts) >= 0.95 * mean, (key, counts)
        # fully masked blocks are skipped: a causal ring computes about half the score elements
        rows = seq // 4
        full = 4 * rows * rows * cp_rank_fns.B * cp_rank_fns.HQ  # every block, no skipping
        assert all(w["forward"] < 0.7 * full for w in work), (work, full)


def test_refused_configurations_name_the_flag(pool4):
    errors = pool4.run(cp_rank_fns.config_errors)[0]
    flag, msg = errors["a2a_gqa"]
    assert flag == "--overlap-cp" and "--overlap-cp ring" in msg and "2" in msg, msg
    flag, msg = errors["hybrid_size"]
    assert flag == "--overlap-cp-a2a-size" and "3" in msg and "4" in msg, msg
    flag, msg = errors["hybrid_missing"]
    assert flag == "--overlap-cp-a2a-size" and "needs --overlap-cp-a2a-size" in msg, msg
    flag, msg = errors["hybrid_heads"]
    assert flag == "--overlap-cp-a2a-size" and "--overlap-cp ring" in msg, msg
    flag, msg = errors["seq_length"]
    assert flag == "--seq-length" and "100" in msg and "2 x context-parallel size = 8" in msg, msg
    flag, msg = errors["mode"]
    assert flag == "--overlap-cp" and "ulysses" in msg, msg
    flag, msg = errors["packed_unpadded"]
    assert flag == "--overlap-cp" and "[5, 17]" in msg and "pad_cu_seqlens" in msg, msg
