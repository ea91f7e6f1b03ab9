"""Errors raised for configurations the plugin refuses.

Code below the config layer names what the user should change by *config field*, never by flag:
``"tp.chunks"`` (one of ours), ``"megatron.seq_length"`` (one of Megatron's arguments) or
``"env.MEGATRON_OVERLAP_CACHE"`` (an environment variable the plugin reads). Inside
a message, other fields are referred to in backticks, ``"use `cp.mode` ring"``. The error turns
both into the flags the user types through the one map in :mod:`megatron_overlap.flag_names`, so
every message names a flag and no area of the plugin spells one.
"""

from __future__ import annotations

import re
from typing import Optional

from .flag_names import flag_for

_FIELD_REF = re.compile(r"`((?:tp|cp|hdp|pp|trace|comm|megatron)\.[a-z0-9_]+|env\.[A-Z0-9_]+)`")


def render(message: str) -> str:
    """``message`` with every backticked field replaced by its flag."""
    return _FIELD_REF.sub(lambda m: flag_for(m.group(1)), message)


class OverlapConfigError(ValueError):
    """A flag, or a combination of flags and model settings, that the plugin cannot honour.

    ``field`` is the config field at fault, ``flag`` the command-line flag the user should
    change; the message says why and what would work instead.
    """

    def __init__(self, field: str, message: Optional[str] = None):
        if message is None:
            # Re-raised from its own text (Megatron's build_module does ``type(e)(f"{e} when
            # instantiating ...")``): "--flag: message ..." keeps its flag.
            text = str(field)
            self.field = None
            self.flag = text.split(": ", 1)[0] if text.startswith("--") and ": " in text else None
            self.reason = text.split(": ", 1)[1] if self.flag else text
            super().__init__(text)
            return
        self.field = field
        self.flag = flag_for(field)
        self.reason = render(message)
        super().__init__(f"{self.flag}: {self.reason}")


class MegatronVersionError(RuntimeError):
    """The installed megatron-core is outside the range this plugin supports."""
