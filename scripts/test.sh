#!/usr/bin/env bash
# The whole test suite (CPU, gloo; 669 tests, 27 minutes on 2 cores, 2026-12-05 08:34 UTC, the configuration matrix included). Arguments go to pytest; -m "not matrix" is the quick subset (635 tests, 13 minutes, 06:53 UTC with one test fewer).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python -m pytest -q --durations=25 "$@"
