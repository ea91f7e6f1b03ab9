#!/usr/bin/env bash
# The whole test suite (CPU, gloo; 13-15 minutes on 2 cores). Arguments go to pytest.
# MEGATRON_OVERLAP_LONG_TESTS=1 adds the 4-rank pretrain_gpt.py HDP tests left out for time.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python -m pytest -q --durations=25 "$@"
