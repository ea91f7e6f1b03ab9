"""The plugin apart from its lab: ``megatron-overlap run`` (and the ``install`` it does right
after Megatron parses its arguments) loads no module of the lab, of the other commands (bench,
demo, floor, plan) or of the tests. Checked on ``sys.modules`` in a fresh ``python -m
megatron_overlap run`` of a script; every import it could make, lazily or not, is checked on the
source (tests/test_layout.py)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A stand-in for Megatron-LM's megatron.training.arguments: only the parse_args contract the
# launcher wraps matters here.
ARGUMENTS = '''
import argparse

def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--transformer-impl", default="transformer_engine")
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser.parse_args()
'''
SCRIPT = '''
import json, sys
import megatron_overlap
from megatron.training.arguments import parse_args

args = parse_args()
print(json.dumps(dict(installed=megatron_overlap.is_installed(),
                      modules=sorted(m for m in sys.modules if m.startswith(("megatron_overlap", "tests"))))))
'''


def test_run_loads_no_lab_module(tmp_path):
    training = tmp_path / "megatron" / "training"
    training.mkdir(parents=True)
    (training / "__init__.py").write_text("")
    (training / "arguments.py").write_text(ARGUMENTS)
    (tmp_path / "pretrain_gpt.py").write_text(SCRIPT)
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "megatron_overlap", "run", str(tmp_path / "pretrain_gpt.py"),
                          "--tensor-model-parallel-size", "2", "--sequence-parallel", "--transformer-impl", "local",
                          "--overlap-tp", "p2p", "--overlap-pp", "zb", "--overlap-timeout-s", "60"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["installed"]
    loaded = result["modules"]
    assert "megatron_overlap.integration.install" in loaded and "megatron_overlap.cli.main" in loaded  # it ran
    offenders = [m for m in loaded if m.startswith(("megatron_overlap.lab", "tests", "megatron_overlap.kernels.bench"))
                 or (m.startswith("megatron_overlap.cli.") and m != "megatron_overlap.cli.main")]
    assert not offenders, offenders
