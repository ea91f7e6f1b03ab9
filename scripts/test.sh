#!/usr/bin/env bash
# The whole test suite (CPU, gloo; 668 tests, 30 minutes on 2 cores, 2026-12-05 06:37 UTC, the configuration matrix included). Arguments go to pytest; -m "not matrix" is the quick subset (634 tests, 13 minutes, 06:53 UTC).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python -m pytest -q --durations=25 "$@"
