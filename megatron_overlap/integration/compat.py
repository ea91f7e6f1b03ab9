"""Everything that differs between the supported megatron-core versions, in one place.

Supported: megatron-core >= 0.16, < 0.20.

- 0.19 adds a trailing ``gtp_remat_size`` to ``linear_with_grad_accumulation_and_async_allreduce``
  (and to the autograd function's forward); 0.16 still takes a deprecated
  ``async_grad_allreduce`` keyword. Calls are bound against the running function's own
  signature, so either shape is read by name.
- 0.17+ need Python >= 3.12; only 0.16.x installs beside Python 3.11.
"""

from __future__ import annotations

import inspect
from importlib import metadata
from typing import Any, Callable, Optional

from ..errors import MegatronVersionError

SUPPORTED_MIN = (0, 16)
SUPPORTED_MAX_EXCLUSIVE = (0, 20)
SUPPORTED_RANGE = ">=0.16,<0.20"


def parse_version(text: str) -> tuple[int, int, int]:
    parts = []
    for token in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in token if ch.isdigit()) or "0"
        parts.append(int(digits))
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)  # type: ignore[return-value]


def megatron_core_version() -> Optional[str]:
    """The installed megatron-core version string, or None when it is not installed."""
    try:
        from megatron.core import package_info

        return package_info.__version__
    except ImportError:
        pass
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def check_megatron_version(version: Optional[str] = None) -> tuple[int, int, int]:
    """Raise :class:`MegatronVersionError` unless ``version`` (default: installed) is supported."""
    version = megatron_core_version() if version is None else version
    if version is None:
        raise MegatronVersionError(
            f"megatron-overlap needs megatron-core {SUPPORTED_RANGE}, which is not installed "
            f"(pip install 'megatron-core{SUPPORTED_RANGE}')"
        )
    parsed = parse_version(version)
    if not (SUPPORTED_MIN <= parsed[:2] < SUPPORTED_MAX_EXCLUSIVE):
        raise MegatronVersionError(
            f"megatron-overlap supports megatron-core {SUPPORTED_RANGE}; found {version}. "
            "Install a supported release or an older/newer megatron-overlap."
        )
    return parsed


class LinearCall:
    """A call of ``linear_with_grad_accumulation_and_async_allreduce`` read by argument name.

    Works for the 0.16 signature (``..., wgrad_deferral_limit, async_grad_allreduce, tp_group``)
    and the 0.19 one (``..., wgrad_deferral_limit, tp_group, gtp_remat_size``).
    """

    __slots__ = ("arguments",)

    def __init__(self, signature: inspect.Signature, args: tuple, kwargs: dict):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        self.arguments = bound.arguments

    def __getattr__(self, name: str) -> Any:
        try:
            return self.arguments[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def gtp_remat_size(self) -> int:
        return self.arguments.get("gtp_remat_size", 1) or 1


def linear_signature(fn: Callable) -> inspect.Signature:
    return inspect.signature(fn)


def default_tp_group(tp_group):
    """Megatron's fallback when a layer passes no group (the default TP group)."""
    if tp_group is not None:
        return tp_group
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def transformer_engine_version() -> Optional[str]:
    for name in ("transformer-engine", "transformer_engine", "transformer-engine-torch"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def apex_version() -> Optional[str]:
    try:
        return metadata.version("apex")
    except metadata.PackageNotFoundError:
        return None
