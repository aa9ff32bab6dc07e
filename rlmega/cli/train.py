"""``rlmega train``: run RL training from a config and Hydra-style overrides."""

from __future__ import annotations

import argparse

HELP = "run RL training (GRPO, DAPO, PPO, REINFORCE++, RLOO) from a config"
QUICKSTART_HELP = "the tiny GRPO run on CPU, built locally (the same as 'rlmega train --config tiny_cpu')"

EPILOG = """\
examples:
  rlmega train                                   # the tiny CPU GRPO run (configs/tiny_cpu.yaml)
  rlmega train --config tiny_cpu algo=dapo trainer.total_steps=10
  rlmega train --config my_run.yaml run_dir=/scratch/run1 layout.world_size=8 layout.tp=4
  rlmega train --print-config                    # show the resolved configuration and exit
  rlmega train --from-verl configs/verl/tiny_cpu_grpo.yaml actor_rollout_ref.rollout.n=4 --set run_dir=runs/v
                                                 # a verl config (and verl-style overrides) on top of --config

overrides use Hydra syntax: key.sub=value, algo=<name> picks configs/algo/<name>.yaml.
the run resumes from the newest complete checkpoint in run_dir unless resume=never, and refuses
settings that change what its checkpoints were trained with; resume=never over checkpoints needs
--overwrite. SIGTERM saves a checkpoint after the current step and exits with code 143.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("--config", default="tiny_cpu",
                        help="a config name in configs/ or a path to a YAML file (default: tiny_cpu)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")
    parser.add_argument("--from-verl", metavar="FILE", default=None,
                        help="a verl trainer config (YAML); the overrides are then verl-style keys, translated "
                             "with it (rlmega/config/VERL.md) and applied on top of --config")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="rlmega_overrides",
                        help="with --from-verl: an rlmega override applied after the translation "
                             "(e.g. --set trainer.val_prompts=64); repeatable")
    parser.add_argument("--overwrite", action="store_true",
                        help="with resume=never: start afresh over the checkpoints in run_dir and replace them "
                             "(the same as overwrite=true)")
    parser.add_argument("overrides", nargs="*", help="Hydra-style overrides, e.g. trainer.total_steps=10")


def run(args: argparse.Namespace) -> int:
    from rlmega.config import ConfigError, load_config
    from rlmega.config.load import to_yaml

    overrides = args.overrides
    if args.from_verl:
        translated = _from_verl(args.from_verl, overrides)
        overrides = translated + _searched_layout(args.config, translated, args.rlmega_overrides) + args.rlmega_overrides
    elif args.rlmega_overrides:
        raise ConfigError("--set is for rlmega overrides next to --from-verl; without it, give them as arguments")
    if args.overwrite:
        overrides = [*overrides, "overwrite=true"]
    config = load_config(args.config, overrides, check=False)
    if args.print_config:
        print(to_yaml(config))
        return 0
    from rlmega.trainer.run_assets import validate_with_assets
    from rlmega.trainer.build import run as run_training

    datasets = validate_with_assets(config)  # every check before anything is written into run_dir
    return run_training(config, datasets)


def _from_verl(path: str, verl_overrides: list[str]) -> list[str]:
    """The rlmega overrides of a verl config. The settings rlmega takes differently are shown as a table on stderr;
    refused ones stop the command: one refusal on one line, several as a table and a line naming them."""
    import sys

    from rlmega.config import ConfigError
    from rlmega.config.verl import translate_verl
    from rlmega.config.verl_report import report_table

    try:
        translation = translate_verl(path, verl_overrides)
    except ValueError as error:  # a verl config verl could not read either, named on one line
        raise ConfigError(str(error)) from error
    if translation.refused:
        rows = translation.refused
        if len(rows) == 1:
            raise ConfigError(rows[0].line())
        print(f"verl settings rlmega refuses ({len(rows)}):\n{report_table(rows)}", file=sys.stderr)
        raise ConfigError(f"{len(rows)} verl settings cannot cross over (the table above says why): "
                          f"{', '.join(row.key for row in rows)}; change or remove them and run again")
    if translation.changed:
        print(f"verl settings rlmega takes differently ({len(translation.changed)}):\n"
              f"{report_table(translation.changed)}", file=sys.stderr)
    return translation.overrides


LAYOUT_DEGREES = ("layout.tp=", "layout.pp=")


def _searched_layout(base: str, translated: list[str], rlmega_overrides: list[str]) -> list[str]:
    """A verl config without a Megatron layout (an FSDP run) gets the one ``rlmega plan --search`` ranks first
    for its job, with the report of the choice on stderr; a layout given with --set, or a model whose
    config.json cannot be read, leaves the degrees as they are (said on stderr)."""
    import sys
    from pathlib import Path

    from rlmega.config import load_config
    from rlmega.errors import UserError
    from rlmega.plan.search import render_search, search

    if any(item.startswith(LAYOUT_DEGREES) for item in translated + rlmega_overrides):
        return []
    config = load_config(base, translated + rlmega_overrides, check=False)
    path = Path(config.model.path)
    if not (path / "config.json" if path.is_dir() else path).is_file():
        print(f"layout: the verl config sets no Megatron layout and {path}/config.json cannot be read, so "
              f"rlmega cannot search one; layout.tp={config.layout.tp} layout.pp={config.layout.pp} stay "
              "(choose them with --set layout.tp=... layout.pp=...; rlmega plan checks the memory)", file=sys.stderr)
        return []
    try:
        result = search(config, base, top=2)
    except UserError as error:
        print(f"layout: the layout search failed ({error}); the degrees stay as they are", file=sys.stderr)
        return []
    if result.best is None:
        print(f"{render_search(result)}\nlayout: no layout the search planned fits this job on "
              f"{config.layout.world_size} {config.plan.gpu}; the degrees stay as they are", file=sys.stderr)
        return []
    print(f"layout: the verl config sets no Megatron layout (FSDP); rlmega plan --search chose "
          f"{result.best.candidate.describe()} for {config.layout.world_size} {config.plan.gpu}:\n"
          f"{render_search(result)}", file=sys.stderr)
    replaced = _replaced_by_search(translated, result.best.overrides)
    if replaced:
        from rlmega.config.verl_report import report_table

        print(f"translated settings the layout search replaced ({len(replaced)}):\n{report_table(replaced)}",
              file=sys.stderr)
    return result.best.overrides


def _replaced_by_search(translated: list[str], searched: list[str]) -> list:
    """Report rows for the translated settings whose value the searched layout's overrides change (a verl
    script's Ulysses degree or engine TP, say): the report of a translation names every setting taken
    differently."""
    from rlmega.config.verl_report import ReportRow

    given = dict(item.split("=", 1) for item in translated if "=" in item)
    rows = []
    for item in searched:
        key, value = item.split("=", 1)
        if key in given and given[key] != value:
            rows.append(ReportRow(key=key, value=given[key], rlmega=f"`{key}={value}`",
                                  why="the layout rlmega plan --search ranks first for this job on these GPUs "
                                      "(the translation's value is the verl run's, for FSDP)"))
    return rows
