#!/usr/bin/env bash
# Create (or reuse) the virtual environment with everything the demo and the tests need.
# Sourced by scripts/demo.sh and scripts/test.sh. Re-installs only when pyproject.toml or this
# file changed. TORCH_SPEC picks the torch wheel (default: the CPU build provisioned here;
# elsewhere set e.g. TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ ! -x "$VENV/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$VENV"
fi
stamp="$VENV/.megatron-overlap-env"
want="$(cat pyproject.toml scripts/env.sh | sha256sum | cut -c1-16) $TORCH_SPEC"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    # torch first and pinned: a bare "torch" requirement would pull a multi-GB CUDA build
    # shellcheck disable=SC2086
    "$VENV/bin/pip" install --quiet --disable-pip-version-check $TORCH_SPEC
    "$VENV/bin/pip" install --quiet --disable-pip-version-check -e ".[test,viz]"
    echo "$want" > "$stamp"
fi
export PATH="$PWD/$VENV/bin:$PATH"
