"""megatron-overlap: hide the communication of Megatron-LM's 4D parallelism behind compute.

    parser = megatron_overlap.add_overlap_args(parser)   # or extra_args_provider=...
    installation = megatron_overlap.install(args)        # after parsing
    installation.uninstall()                             # or megatron_overlap.uninstall()
"""

from .args import FLAGS, add_overlap_args, overlap_parser
from .config import OverlapConfig
from .errors import MegatronVersionError, OverlapConfigError
from .integration.install import Installation, active_config, install, is_installed, uninstall
from .version import __version__

__all__ = [
    "FLAGS",
    "Installation",
    "MegatronVersionError",
    "OverlapConfig",
    "OverlapConfigError",
    "__version__",
    "active_config",
    "add_overlap_args",
    "install",
    "is_installed",
    "overlap_parser",
    "uninstall",
]
