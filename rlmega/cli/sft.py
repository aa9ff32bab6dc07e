"""``rlmega sft``: the supervised warm-start alone, on the same Megatron workers as RL."""

from __future__ import annotations

import argparse

HELP = "supervised fine-tuning on the dataset's ground-truth answers (the RL warm-start, run alone)"

EPILOG = """\
examples:
  rlmega sft --config tiny_cpu trainer.sft_steps=100 run_dir=runs/sft
  rlmega train --config tiny_cpu model.path=runs/sft/sft_hf trainer.sft_steps=0   # RL from it

trains trainer.sft_steps steps (prompts_per_step x rollout.n sequences each, lr trainer.sft_lr) on
the prompts of data.files followed by their reward_model.ground_truth and EOS; writes the Megatron
checkpoint to run_dir/sft_checkpoints and the HF model to run_dir/sft_hf.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("--config", default="tiny_cpu", help="a config name in configs/ or a YAML path (default: tiny_cpu)")
    parser.add_argument("overrides", nargs="*", help="Hydra-style overrides, e.g. trainer.sft_steps=100")


def run(args: argparse.Namespace) -> int:
    from rlmega.config import ConfigError, load_config

    config = load_config(args.config, args.overrides, check=False)
    if config.trainer.sft_steps < 1:
        raise ConfigError("trainer.sft_steps: rlmega sft needs at least one step")
    from rlmega.trainer.run_assets import validate_with_assets
    from rlmega.trainer.build import run_sft

    datasets = validate_with_assets(config)  # every check before anything is written into run_dir
    return run_sft(config, datasets)
