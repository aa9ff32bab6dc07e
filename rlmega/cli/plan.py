"""``rlmega plan``: whether a run fits its GPUs, from the model's config.json alone (no weights)."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "per rank and phase GPU memory, engine KV cache and weight-sync time of a run, built on the meta device"

EPILOG = """\
examples:
  rlmega plan configs/recipes/deepseek_v3_671b/grpo.yaml
  rlmega plan configs/recipes/qwen3_8b/grpo.yaml plan.gpu=H200 actor.recompute_granularity=full
  rlmega plan my_run.yaml --json plan.json        # also write the plan as JSON ("-": to stdout, no table)
  rlmega plan my_run.yaml --explain               # every term of every phase, with where its bytes come from

every parameter, gradient and optimizer-shard count is read from each distinct rank's real model, built
under a fake process group of the run's full world size on the meta device (no memory, seconds);
activations and KV cache are formulas (rlmega/plan/README.md). The hardware is the config's plan: slice
(plan.gpu H100 / H200 / B200 or plan.gpu_memory_gib, plan.gpus_per_node, link speeds). Exit code 2 when a
rank does not fit, naming the rank, the phase and the shortfall.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("config", help="a config name in configs/ or a path to a YAML file")
    parser.add_argument("overrides", nargs="*", help="Hydra-style overrides, e.g. layout.pp=4 plan.gpu=H200")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the plan as JSON to PATH ('-': stdout)")
    parser.add_argument("--explain", action="store_true",
                        help="after the table, list every term each position's phases add up, with its source "
                             "(measured on the meta device, a formula, a config value)")


def run(args: argparse.Namespace) -> int:
    from rlmega.config import load_config
    from rlmega.config.load import check_choices
    from rlmega.plan import check, make_plan, render, render_explain

    config = load_config(args.config, args.overrides, check=False)
    check_choices(config)  # no data or weights are read: the rest of the checks are the plan's own
    plan = make_plan(config, args.config)
    if args.json == "-":
        json.dump(plan.to_json(), sys.stdout, indent=1)
        print()
    else:
        print(render(plan))
        if args.explain:
            print("\n" + render_explain(plan))
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(plan.to_json(), handle, indent=1)
    check(plan)
    return 0
