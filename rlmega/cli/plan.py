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
  rlmega plan my_run.yaml --search                # the layouts that fit this job, ranked, and the best one's plan

every parameter, gradient and optimizer-shard count is read from each distinct rank's real model, built
under a fake process group of the run's full world size on the meta device (no memory, seconds);
activations and KV cache are formulas (rlmega/plan/README.md). The hardware is the config's plan: slice
(plan.gpu H100 / H200 / B200 or plan.gpu_memory_gib, plan.gpus_per_node, link speeds: plan.nvlink_gb_per_s,
plan.ib_gb_per_s, plan.object_store_gb_per_s, plan.host_copy_gb_per_s, the last an assumption to measure on
the GPU node: bash tests/gpu/run_gpu_checks.sh --tier cluster --only host-memcpy). Exit code 2 when a rank
does not fit, naming the rank, the phase and the shortfall.

--search enumerates TP, PP (uneven stages too), VPP, CP, EP, ETP, recomputation, optimizer offload and the
colocated engines' TP for the config's model, GPUs and job, drops what a memory bound rules out, ranks the
rest by predicted step time and lets the planner decide on the cheapest; it prints those that fit, the
overrides that select the best, and the best one's plan (exit code 2 when none fits).
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
    parser.add_argument("--search", action="store_true",
                        help="search the layouts, recomputation, offload and engine layouts that fit this job, "
                             "ranked by predicted step time, and show the best one's plan")
    parser.add_argument("--top", type=int, default=3, help="with --search: stop once this many fit (default 3)")
    parser.add_argument("--max-plans", type=int, default=12,
                        help="with --search: build at most this many candidates with the planner (default 12)")


def run(args: argparse.Namespace) -> int:
    from rlmega.config import load_config
    from rlmega.config.load import check_choices
    from rlmega.plan import check, make_plan, render, render_explain

    config = load_config(args.config, args.overrides, check=False)
    check_choices(config)  # no data or weights are read: the rest of the checks are the plan's own
    if args.search:
        return _search(config, args)
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


def _search(config, args: argparse.Namespace) -> int:
    from rlmega.plan import PlanError, render
    from rlmega.plan.search import render_search, search

    if args.top < 1 or args.max_plans < 1:
        raise PlanError("--top and --max-plans must be at least 1")
    result = search(config, args.config, top=args.top, max_plans=args.max_plans)
    print(render_search(result))
    if result.best is None:
        raise PlanError(f"{args.config}: no layout the search planned fits; raise --max-plans, add GPUs or "
                        "shorten the sequences (the refused ones are listed above)")
    print("\n" + render(result.best.plan))
    if args.json:  # the best one's plan
        with open(args.json if args.json != "-" else "/dev/stdout", "w") as handle:
            json.dump(result.best.plan.to_json(), handle, indent=1)
    return 0
