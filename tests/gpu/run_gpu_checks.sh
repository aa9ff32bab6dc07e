#!/usr/bin/env bash
# On a CUDA machine: install the GPU extras and run every gpu-marked test in one go.
# vLLM, SGLang and transformer-engine pin different torch builds, so each gets its own virtual
# environment; the worker's GPU tests run in each (TE's THD and context-parallel checks only in "gpu").
# Usage: bash tests/gpu/run_gpu_checks.sh [extra pytest args]
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"
status=0
for extra in ${RLMEGA_GPU_EXTRAS:-vllm sglang gpu}; do
    venv="${RLMEGA_GPU_VENV_PREFIX:-$root/.venv-gpu}-$extra"
    [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q -e ".[test,$extra]"
    "$venv/bin/python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
    # Every gpu-marked test; tests of packages not in this environment skip (importorskip).
    "$venv/bin/python" -m pytest -m gpu tests -q -rs "$@" || status=1
done
exit $status
