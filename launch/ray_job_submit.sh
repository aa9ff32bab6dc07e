#!/usr/bin/env bash
# Submit `rlmega train ...` to a running Ray cluster (ray job submit, with the checkout as the job's
# working directory). Options and details: python -m rlmega.launch.ray_job --help, launch/README.md.
#   bash launch/ray_job_submit.sh --address http://127.0.0.1:8265 -- train --config tiny_cpu run_dir=/shared/runs/x
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${RLMEGA_VENV:-$root/.venv}"
[ -x "$venv/bin/python" ] && export PATH="$venv/bin:$PATH"
exec python -m rlmega.launch.ray_job --working-dir "$root" "$@"
