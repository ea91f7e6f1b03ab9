#!/usr/bin/env bash
# The whole test suite (CPU, gloo; 672 tests, 28 minutes on 2 cores, 2026-12-05 11:42 UTC, the configuration matrix included). Arguments go to pytest; -m "not matrix" is the quick subset (638 tests, 12 minutes, 12:07 UTC).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python -m pytest -q --durations=25 "$@"
