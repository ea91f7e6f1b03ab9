"""HDP on the batches users train with (issue 24): ``bench hdp --batch-tokens`` cutting a lengths
file, the refusal of a file that is one batch by accident, the guard that keeps a plan never more
than 1% slower than megatron-core's under either cost model, and the planner's speed."""

import io
import json
from contextlib import redirect_stderr, redirect_stdout

import pytest

from megatron_overlap.cli.corpus import corpus_batches, cut_batches


def _cli(*argv):
    from megatron_overlap.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["bench", "hdp", *argv])
    return rc, out.getvalue(), err.getvalue()


def test_cut_batches_in_order_with_the_remainder_dropped():
    batches, left = cut_batches([5, 3, 9, 1, 1, 7, 2, 2], 8)
    assert batches == [[5, 3], [9], [1, 1, 7]] and left == 4
    assert cut_batches([4], 8) == ([], 4)
    with pytest.raises(ValueError, match="batch tokens must be >= 1"):
        cut_batches([4], 0)
    docs = [("a", 700), ("b", 300), ("c", 50)]
    one = corpus_batches(docs, 500, 400)
    many = corpus_batches(docs, 500, 400, min_batches=7)  # read again, reshuffled, like epochs
    assert len(one) == 1 and len(many) >= 7 and many[:len(one)] == one
    assert all(sum(b) >= 500 for b in many)


def test_bench_batch_tokens_cuts_a_lengths_file(tmp_path):
    f = tmp_path / "docs.txt"
    lens = [9000, 3000, 100, 200, 5000, 700] * 4  # 72000 tokens, no blank line
    f.write_text("\n".join(map(str, lens)) + "\n")
    rc, out, err = _cli("--lengths-file", str(f), "--batch-tokens", "16000", "--ranks", "4",
                        "--max-tokens-per-rank", "4096", "--json", "--no-progress")
    assert rc == 0, err
    cfg = json.loads(out.strip().splitlines()[-1])["config"]
    expected, left = cut_batches(lens, 16000)
    assert cfg["steps"] == len(expected) == 4 and cfg["sequences"] == sum(map(len, expected))
    assert cfg["tokens"] == sum(lens) - left and f"cut into 4 batches of >= 16000 tokens, the last {left}" in out
    # blank lines are batches without --batch-tokens, and re-cut with it
    f.write_text("100\n200\n\n300\n")
    rc, out, _ = _cli("--lengths-file", str(f), "--ranks", "2", "--max-tokens-per-rank", "4096", "--json",
                      "--no-progress")
    assert rc == 0 and json.loads(out.strip().splitlines()[-1])["config"]["steps"] == 2
    rc, _, err = _cli("--lengths-file", str(f), "--batch-tokens", "10000", "--ranks", "2", "--no-progress")
    assert rc == 2 and "holds 600 tokens, fewer than one batch of --batch-tokens 10000" in err


def test_a_lengths_file_without_blank_lines_is_refused_with_the_reason(tmp_path):
    f = tmp_path / "docs.txt"
    f.write_text("\n".join(["2100000"] + ["7000"] * 1845) + "\n")
    rc, out, err = _cli("--lengths-file", str(f), "--ranks", "64", "--no-progress")
    assert rc == 2 and not out
    assert (f"{f} has no blank line between batches, so it would be one full batch of 1846 sequences "
            f"(15015000 tokens, the longest 2100000), planned as one step: pass --batch-tokens T") in err
    assert "8 x R x C = 16777216 here" in err and "or put a blank line after each batch" in err
