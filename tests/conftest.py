"""Shared fixtures. One pool of 4 live gloo ranks serves every multi-rank test (spawning ranks
and importing Megatron costs ~20 s here); TP=2 tests run as TP=2 x DP=2 inside it."""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Without a GPU the Triton kernels run in the interpreter; it must be chosen before triton is
# imported (here, and in the rank processes, which inherit the environment).
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
