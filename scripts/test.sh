#!/usr/bin/env bash
# The whole test suite (CPU, gloo; 506 tests, 10-14 minutes on 2 cores: 814 s and 604 s, 2026-12-04 16:10 and 17:55). Arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python -m pytest -q --durations=25 "$@"
