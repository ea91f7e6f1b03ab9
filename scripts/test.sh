#!/usr/bin/env bash
# The whole test suite (CPU, gloo; 495 tests, 12.6 minutes on 2 cores). Arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python -m pytest -q --durations=25 "$@"
