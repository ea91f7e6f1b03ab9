"""Shared fixtures. One pool of 4 live gloo ranks serves every multi-rank test (spawning ranks
and importing Megatron costs ~20 s here); TP=2 tests run as TP=2 x DP=2 inside it."""

import os
import random

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite runs every path on CPU tensors (gloo ranks), on a machine with GPUs too: the Triton
# kernels run in the interpreter. It must be chosen before triton is imported (here, and in the
# rank processes, which inherit the environment).
os.environ.setdefault("TRITON_INTERPRET", "1")


SEED_ENV = "MEGATRON_OVERLAP_TEST_SEED"
_DRAWN: dict = {}  # (fixture name, node id of the scope that drew it) -> seed


def _draw(name: str, request) -> int:
    fixed = os.environ.get(SEED_ENV)
    value = int(fixed) if fixed else random.SystemRandom().randrange(1 << 20)
    _DRAWN[(name, request.node.nodeid)] = value
    return value


@pytest.fixture
def seed(request) -> int:
    """A fresh random seed for the test's inputs, shown with the failure of the test that drew it
    (a "random seed" section with the command that replays it) and kept in the report's
    properties (junit XML): ``MEGATRON_OVERLAP_TEST_SEED=<seed>`` replays it. Tests draw random
    inputs from this (or ``module_seed``), never from an unseeded generator
    (tests/test_suite_rules.py)."""
    return _draw("seed", request)


@pytest.fixture(scope="module")
def module_seed(request) -> int:
    """``seed`` for a module-scoped fixture: shown with the failure of every test that uses it."""
    return _draw("module_seed", request)


def seeds_of(item) -> list:
    """The seeds the test ``item`` ran with: (fixture name, seed) for each seed fixture it uses."""
    return [(name, _DRAWN[(name, node.nodeid)]) for name in ("seed", "module_seed") if name in item.fixturenames
            for node in item.listchain() if (name, node.nodeid) in _DRAWN]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.user_properties.extend(seeds_of(item))
    if report.failed:
        for name, value in seeds_of(item):
            report.sections.append(("random seed", f"{name} {value}; replay: {SEED_ENV}={value} "
                                                   f"bash scripts/test.sh '{item.nodeid}'"))
    return report


@pytest.fixture(scope="session")
def pool4():
    from megatron_overlap.lab.rank_pool import RankPool

    pool = RankPool(4, timeout=600, pg_timeout_s=120)
    yield pool
    pool.close()


@pytest.fixture(autouse=True)
def _clean_install():
    """Every test starts and ends with stock Megatron in this process."""
    import megatron_overlap

    megatron_overlap.uninstall()
    yield
    megatron_overlap.uninstall()
