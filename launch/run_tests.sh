#!/usr/bin/env bash
# Set up the environment and run the whole test suite (CPU; GPU-only tests skip with a reason).
# Extra arguments go to pytest, e.g. `bash launch/run_tests.sh -k megatron -x`.
#
# `--mcore 0.19` (or RLMEGA_MCORE=0.19; also 0.17, 0.18) runs the Megatron-facing suites instead, on that
# megatron-core release unpacked from its wheel over rlmega's environment (launch/setup_mcore_env.sh);
# RLMEGA_MCORE_SUITES replaces the list of suites (paths or node ids, space-separated). 0.16 is the default run.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mcore="${RLMEGA_MCORE:-}"
if [ "${1:-}" = --mcore ]; then
    [ $# -ge 2 ] || { echo "--mcore needs a megatron-core release, e.g. --mcore 0.19" >&2; exit 2; }
    mcore="$2"; shift 2
fi
# The suites that reach into Megatron-Core: the CPU platform, layouts and process groups, the workers
# (router replay, checkpoints, optimizer offload), the bridge and converters, the planner's meta-device models.
MCORE_SUITES="tests/test_megatron_parallel.py tests/test_cpu_platform.py tests/test_mcore_without_te.py
    tests/test_multirank.py tests/test_layout.py tests/test_mcore_versions.py tests/workers tests/bridge
    tests/converters tests/plan"

bash "$root/launch/setup_env.sh"
cd "$root"
if [ -z "$mcore" ] || [ "$mcore" = 0.16 ]; then
    exec "${RLMEGA_VENV:-$root/.venv}/bin/python" -m pytest tests "$@"
fi
python="$(bash "$root/launch/setup_mcore_env.sh" "$mcore" | tail -n 1)"
# shellcheck disable=SC2086  # the suites are words
exec "$python" -m pytest ${RLMEGA_MCORE_SUITES:-$MCORE_SUITES} "$@"
