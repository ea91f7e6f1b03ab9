"""Print every flag of Megatron-LM's own argument parser, one per line, sorted (for
tests/data/megatron_lm_parser_flags.txt). Run with the Megatron-LM tree on the path:

    cd /work/shared/third_party/megatron-lm/core_v0.16.1 && python /path/to/scripts/megatron_parser_flags.py
"""

import argparse
import sys
import warnings

sys.path.insert(0, ".")
warnings.simplefilter("ignore")
from megatron.training import arguments  # noqa: E402

parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
for flag in sorted({o for action in parser._actions for o in action.option_strings if o.startswith("--")}):
    print(flag)
