#!/usr/bin/env bash
# Create (or reuse) rlmega's virtual environment and install rlmega into it with its test extras.
#   bash launch/setup_env.sh            # .venv at the repository root
#   RLMEGA_VENV=/path/to/venv PYTHON=python3.11 bash launch/setup_env.sh
# On a machine without an NVIDIA driver, torch is pinned to 2.13.0 first: an unpinned torch
# resolves to a multi-GB CUDA build. apex (GPU clusters) is built from NVIDIA's source, see README.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${RLMEGA_VENV:-$root/.venv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    echo "rlmega: creating virtual environment $venv"
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e "$root[test]"
echo "rlmega: environment ready in $venv"
