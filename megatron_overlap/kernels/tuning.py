"""Tile-config autotuning for the fused kernels, per (kernel, M, N, K, dtype, world size,
device name, kernel source hash), cached on disk, every rank agreeing on the pick
(``megatron_overlap.tune.cache``). Timed with CUDA events on GPU; on the CPU interpreter timing
means nothing, so the backend uses a fixed config there.

Kernels know no ``torch.distributed``: the world size and the agreement across ranks are
injected by the TP layer (``tp.backends.fused`` passes a ``comm.agree.GroupAgreement``)."""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Sequence

import torch

from ..tune.cache import DiskCache, choose, device_name, private_rng, source_hash, time_call
from . import ag_gemm as _ag_gemm_module
from . import gemm_rs as _gemm_rs_module
from .ag_gemm import CONFIGS, TileConfig

_SOURCES = {
    "ag_gemm": source_hash(inspect.getsource(_ag_gemm_module)),
    "gemm_rs": source_hash(inspect.getsource(_gemm_rs_module)),
}


def config_key(kind: str, m: int, n: int, k: int, dtype: torch.dtype, world: int, device: torch.device) -> str:
    return "|".join(
        [kind, f"{m}x{n}x{k}", str(dtype).replace("torch.", ""), f"world{world}", device_name(device),
         f"src{_SOURCES[kind]}", f"torch{torch.__version__}"]
    )


class ConfigChooser:
    """Picks a :class:`TileConfig` per kernel and shape; one per installation."""

    def __init__(self, candidates: Sequence[TileConfig] = CONFIGS, cache: Optional[DiskCache] = None,
                 timer: Optional[Callable] = None):
        self.candidates = tuple(candidates)
        self.cache = cache or DiskCache("tile_configs")
        self.timer = timer  # timer(kind, config, m, n, k, dtype, device) -> seconds; default: run it
        self.memo: dict = {}

    def _measure(self, kind, m, n, k, dtype, device, config) -> float:
        if self.timer is not None:
            return self.timer(kind, config, m, n, k, dtype, device)
        gen = private_rng(device)
        a = torch.randn(m, k, dtype=dtype, device=device, generator=gen)
        b = torch.randn(k, n, dtype=dtype, device=device, generator=gen)
        if kind == "ag_gemm":
            flags = torch.ones(1, dtype=torch.int32, device=device)
            error = torch.zeros(1, dtype=torch.int32, device=device)  # no waits (wait=False): nothing to check
            run = lambda: _ag_gemm_module.ag_gemm(a, b, flags, [0, m], [0], config=config, wait=False,  # noqa: E731
                                                  error=error)
        else:
            run = lambda: _gemm_rs_module.gemm_rs(a, b, 1, [0], config=config)  # noqa: E731
        return time_call(run, device)

    def choose(self, kind: str, m: int, n: int, k: int, dtype: torch.dtype, world: int = 1, agree=None,
               device: Optional[torch.device] = None) -> TileConfig:
        """The config for one kernel shape. ``world``: ranks of the TP group (part of the key);
        ``agree``: the agreement across them (``max`` / ``any``), None for one rank alone."""
        device = device or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                            else torch.device("cpu"))
        key = config_key(kind, m, n, k, dtype, world, device)
        if key not in self.memo:
            config, _hit = choose(self.cache, key, self.candidates,
                                  lambda c: self._measure(kind, m, n, k, dtype, device, c), agree,
                                  encode=TileConfig.key)
            self.memo[key] = config
        return self.memo[key]
