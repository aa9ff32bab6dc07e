#!/usr/bin/env bash
# The main job on a fresh machine: set up the environment, then train the tiny model on CPU with a
# live loss readout. Extra arguments go to `rlmega quickstart` (see `rlmega quickstart --help`).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/launch/setup_env.sh"
exec "${RLMEGA_VENV:-$root/.venv}/bin/rlmega" quickstart "$@"
