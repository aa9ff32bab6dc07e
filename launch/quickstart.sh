#!/usr/bin/env bash
# The main job on a fresh machine: set up the environment, then run GRPO on CPU on the embedded
# tiny default (configs/tiny_cpu.yaml: a tiny model and tokenizer built locally, an arithmetic task
# generated locally, a short supervised warm-start, then RL). Extra arguments are Hydra-style
# overrides for `rlmega train` (see `rlmega train --help`), e.g. trainer.total_steps=20.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/launch/setup_env.sh"
exec "${RLMEGA_VENV:-$root/.venv}/bin/rlmega" train --config tiny_cpu "$@"
