#!/usr/bin/env bash
# The whole test suite (CPU, gloo; 506 tests, ~16 minutes on 2 cores: 956 s, 2026-12-03 14:03). Arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python -m pytest -q --durations=25 "$@"
