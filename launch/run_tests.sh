#!/usr/bin/env bash
# Set up the environment and run the whole test suite (CPU; GPU-only tests skip with a reason).
# Extra arguments go to pytest, e.g. `bash launch/run_tests.sh -k megatron -x`.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/launch/setup_env.sh"
cd "$root"
exec "${RLMEGA_VENV:-$root/.venv}/bin/python" -m pytest tests "$@"
