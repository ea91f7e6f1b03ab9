#!/usr/bin/env bash
# The whole test suite (CPU, gloo; 678 tests, 31 minutes on 2 cores, 2026-12-05 23:44 UTC, the configuration matrix included). Arguments go to pytest; -m "not matrix" is the quick subset (644 tests, 13 minutes, 2026-12-06 00:02 UTC).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python -m pytest -q --durations=25 "$@"
