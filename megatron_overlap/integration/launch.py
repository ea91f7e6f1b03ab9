"""``megatron-overlap run pretrain_gpt.py <megatron args> <overlap flags>``.

Runs a Megatron-LM training script unmodified: before the script starts, Megatron's
``megatron.training.arguments.parse_args`` is wrapped so that the plugin's flags join
Megatron's parser (chained after the script's own ``extra_args_provider``, if any) and
``megatron_overlap.install(args)`` runs right after parsing. This covers every supported
Megatron-LM: <= 0.17 parse inside ``initialize_megatron`` (via ``pretrain(extra_args_provider=)``),
0.18+ call ``parse_and_validate_args`` from the script; both go through ``parse_args``.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Callable, Optional

from ..args import add_overlap_args


class LaunchError(RuntimeError):
    pass


def _chain(extra_args_provider: Optional[Callable]) -> Callable:
    def provider(parser):
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return add_overlap_args(parser)

    return provider


def hook_megatron_training() -> Callable:
    """Wrap ``megatron.training.arguments.parse_args`` everywhere it is bound; return the wrapper."""
    try:
        from megatron.training import arguments
    except ImportError as exc:
        raise LaunchError(
            "megatron-overlap run: cannot import megatron.training "
            f"({exc}). Run a script from a Megatron-LM checkout (its directory is put on "
            "sys.path, as `python pretrain_gpt.py` would), or set PYTHONPATH to the checkout."
        ) from exc
    from .install import install

    original = arguments.parse_args
    if getattr(original, "__megatron_overlap__", False):
        return original

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        args = original(_chain(extra_args_provider), ignore_unknown_args)
        install(args)
        return args

    parse_args.__megatron_overlap__ = True
    parse_args.__wrapped__ = original
    parse_args.__doc__ = original.__doc__
    for name, module in list(sys.modules.items()):
        if module is not None and name.startswith("megatron") and getattr(module, "parse_args", None) is original:
            module.parse_args = parse_args
    return parse_args


def run_script(script: str, argv: list[str]) -> None:
    """Execute ``script`` as ``__main__`` with ``argv``, the plugin hooked in."""
    path = os.path.abspath(script)
    if not os.path.isfile(path):
        raise LaunchError(f"megatron-overlap run: no such script: {script}")
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))
    hook_megatron_training()
    runpy.run_path(path, run_name="__main__")
