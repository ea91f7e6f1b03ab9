"""Every plugin feature in the configurations users run, through Megatron-LM's own
``pretrain_gpt.py``: the covering design of ``tests/matrix_design.py`` (its docstring says how the
runs are chosen and what each is compared with; docs/config-matrix.md shows the table).

Marked ``matrix``: ``bash scripts/test.sh -m "not matrix"`` is the quick subset."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import tempfile

import pytest

from .matrix_design import ITERATIONS, SAVE_AT, rows
from .pretrain_gpt_runs import launch, needs_megatron_lm, train

pytestmark = [needs_megatron_lm, pytest.mark.matrix]

_ROOT = tempfile.mkdtemp(prefix="mo_matrix_")


def _checkpointed(mode: str, ranks: int, flags: tuple) -> tuple:
    """``flags`` with a checkpoint directory of their own (``torch_dist``, saved after
    iterations SAVE_AT and ITERATIONS)."""
    key = hashlib.sha1(repr((mode, ranks, flags)).encode()).hexdigest()[:12]
    save = os.path.join(_ROOT, key)
    return flags + ("--save", save, "--save-interval", str(SAVE_AT), "--ckpt-format", "torch_dist"), save


@functools.lru_cache(maxsize=None)
def _resumed(mode: str, ranks: int, flags: tuple, save: str) -> dict:
    """The run again from its checkpoint of iteration SAVE_AT (the tracker pointed back at it;
    the checkpoint of the last iteration stays on disk, unread), iterations SAVE_AT+1.."""
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(SAVE_AT))
    i = flags.index("--save")
    flags = flags[:i] + ("--save", save + "-resumed") + flags[i + 2:] + ("--load", save)
    run = launch(mode, ranks, flags)
    assert run["rc"] == 0, run["stderr"][-4000:]
    assert len(run["losses"]) == ITERATIONS - SAVE_AT, run["losses"]
    return run


def _close(ours: list, ref: list, rel: float, why: str, what: str = "") -> None:
    """Equal (``rel`` 0) or within ``rel``; with ``MO_MATRIX_DIFFS`` set, the worst relative
    difference is appended there (what docs/config-matrix.md reports as measured)."""
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, ref))
    if os.environ.get("MO_MATRIX_DIFFS") and what:
        with open(os.environ["MO_MATRIX_DIFFS"], "a") as f:
            f.write(json.dumps({"run": what, "worst_rel": worst, "allowed": rel}) + "\n")
    for a, b in zip(ours, ref):
        assert (a == b) if rel == 0 else math.isclose(a, b, rel_tol=rel), (rel, why, ours, ref)


@pytest.mark.parametrize("row", rows(), ids=lambda r: r.id)
def test_feature_with_partner_flags_trains_like_its_reference(row):
    f = row.feature
    partners = row.partner_flags()
    ref_flags, ref_save = _checkpointed("stock", f.ref_ranks, f.ref_layout + partners)
    ref = train("stock", f.ref_ranks, ref_flags, ITERATIONS)
    ours_flags, save = _checkpointed("plugin", f.ranks, f.layout + partners + f.plugin)
    ours = train("plugin", f.ranks, ours_flags, ITERATIONS)
    missing = [c for c in f.calls if not ours["calls"].get(c)]
    assert not missing, (missing, ours["calls"])  # the plugin ran the feature
    rel = f.rel[row.dtype]
    _close(ours["losses"], ref["losses"], rel, f.why, row.id)
    if "eval" in row.partners:
        assert sorted(ours["val_losses"]) == [2, 4, 6], ours["val_losses"]
        _close([ours["val_losses"][i] for i in (2, 4, 6)], [ref["val_losses"][i] for i in (2, 4, 6)], rel, f.why,
               row.id + " validation")
    if "ckpt" in row.partners:
        # against stock's own resume: stock megatron-core 0.16.1 without TE/apex does not resume the
        # distributed optimizer exactly here (lab/megatron_lm_cpu.py, _adam_step_in_initial_state)
        resumed = _resumed("plugin", f.ranks, ours_flags, save)
        assert resumed["losses"][0] == ours["losses"][SAVE_AT], (resumed["losses"], ours["losses"])  # the weights
        if not f.resume_vs_stock:
            ref_resumed = _resumed("stock", f.ref_ranks, ref_flags, ref_save)
            _close(resumed["losses"], ref_resumed["losses"], rel, f.why, row.id + " resumed")


def test_the_design_covers_every_pair_of_partner_flags_for_every_feature():
    """The covering property itself, and its size (2 runs per feature)."""
    import itertools

    from .matrix_design import EXCLUSIVE, FEATURES, IMPLIES, PARTNERS, UNSUPPORTED, covering

    for f in FEATURES:
        blocks = covering(f.name)
        assert len(blocks) == 2, (f.name, blocks)
        for block in blocks:
            assert not any(pair <= block for pair in EXCLUSIVE), block
            for flag, needs in IMPLIES.items():
                assert flag not in block or set(needs) <= block, block
        for pq in itertools.combinations([p for p in PARTNERS if (f.name, p) not in UNSUPPORTED], 2):
            if frozenset(pq) not in EXCLUSIVE:
                assert any(set(pq) <= b for b in blocks), (f.name, pq)
