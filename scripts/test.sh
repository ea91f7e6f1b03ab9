#!/usr/bin/env bash
# The whole test suite (CPU, gloo; 542 tests, 8-14 minutes on 2 cores: 507 s on 2026-12-04 22:45 UTC). Arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python -m pytest -q --durations=25 "$@"
