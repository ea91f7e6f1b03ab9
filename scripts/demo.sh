#!/usr/bin/env bash
# The main job on this CPU: stock Megatron vs megatron-overlap, one gloo rank per core, emulated link.
# Arguments go to `megatron-overlap demo` (e.g. --json, --steps 20, --tp 4).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec megatron-overlap demo "$@"
