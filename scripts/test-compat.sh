#!/usr/bin/env bash
# megatron-core 0.19 for real (not part of .ci/run: the venv is ~5.5 GB, torch 2.14's CUDA build
# and its nvidia wheels being the only torch 2.14 for Python 3.12 on the registries here).
# Builds (or reuses) .venv-compat with Python 3.12, torch 2.14.x, megatron-core 0.19.2 and this
# package, then runs the TP parity and training tests (sub-batches included) and the pretrain_gpt.py tests against Megatron-LM's
# core_v0.19.0 training loop (MEGATRON_LM_DIR; default: the shared copy). Arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY312=${PY312:-$(ls -d "$HOME"/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | head -1 || true)}
PY312=${PY312:-$(command -v python3.12 || true)}
if [ -z "$PY312" ]; then
    echo "test-compat: needs Python 3.12 (megatron-core 0.17+ require it); set PY312=/path/to/python3.12" >&2
    exit 2
fi
VENV=${VENV_COMPAT:-.venv-compat}
TORCH_SPEC=${TORCH_SPEC_COMPAT:-torch==2.14.1}
MCORE_SPEC=${MCORE_SPEC_COMPAT:-megatron-core==0.19.2}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY312" -m venv "$VENV"
fi
stamp="$VENV/.megatron-overlap-env"
want="$(cat pyproject.toml scripts/test-compat.sh | sha256sum | cut -c1-16) $TORCH_SPEC $MCORE_SPEC"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    # shellcheck disable=SC2086
    "$VENV/bin/pip" install --quiet --disable-pip-version-check $TORCH_SPEC "$MCORE_SPEC"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps -e .
    "$VENV/bin/pip" install --quiet --disable-pip-version-check pytest "numpy<2.4" pyyaml six regex pydantic \
        matplotlib tqdm
    echo "$want" > "$stamp"
fi
export MEGATRON_LM_DIR=${MEGATRON_LM_DIR:-$PWD/../shared/third_party/megatron-lm/core_v0.19.0}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} CUDA_VISIBLE_DEVICES=""
"$VENV/bin/python" -c "import torch, megatron.core as m; print('test-compat: torch', torch.__version__, \
'megatron-core', m.__version__)"
exec "$VENV/bin/python" -m pytest -q tests/test_parity.py tests/test_training.py tests/test_pretrain_gpt.py tests/test_install.py "$@"
