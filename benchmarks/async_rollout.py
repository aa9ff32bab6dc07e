"""Synchronous vs one-step-off vs fully asynchronous rollout on a long-tailed tiny GRPO job, side by side.

The job: the quickstart's model and character tokenizer, warm-started on a long-tailed task. Three
prompts in four are the quickstart's sums (``"3+5="`` -> ``"8"``); the fourth asks for the sum written k
times (``"3+5x12="`` -> ``"888888888888"``, k in 8..40), so a few responses in every batch are 10-40x
longer than the rest, as reasoning traces are. Scored by exact answer. Disaggregated: one training rank
and one transformers engine, one CPU thread each (2 of this machine's 2 cores).

Each mode runs in a fresh ``rlmega train`` process from the same warm-started checkpoint, for the same
number of RL steps (the same number of trained samples), once per seed (``--seeds``), the modes
interleaved. GRPO without a reference model; PPO clips against the engine's log-probs
(``algorithm.rollout_correction.bypass_mode``, so no old-log-prob pass), in every mode alike:

  sync           rollout.mode=sync: generate, train, sync
  one_step_off   rollout.mode=one_step_off: step k+1 generates while step k trains
  async          rollout.mode=async, rollout.max_staleness=s for each s of --max-staleness (default 1),
                 partial rollouts continued; shown as "async s=2" when more than one s is asked for

Reported per mode: wall time of the RL steps (the sum of ``timing_s/step``) and its ratio to sync,
response tokens trained per second, the trainer's idle fraction (waiting for rollouts) and the
engine's (no request in flight; for sync, the time it is not generating; for one_step_off, the time
outside its prefetches), the largest staleness
trained on, and validation accuracy (256 validation prompts at temperature 1) after the last step.

    python benchmarks/async_rollout.py [--steps 30] [--prompts 16] [--n 8] [--seeds 1,2] [--only sync,async]
                                       [--max-staleness 1,2] [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("sync", "one_step_off", "async")


def long_tailed_rows(count: int, seed: int, split: str, long_fraction: float = 0.25) -> list[dict]:
    """Sums, a ``long_fraction`` of them to be written k times over (k in 8..40)."""
    from rlmega.data.synthetic import ARITHMETIC_DATA_SOURCE

    rng = random.Random(seed)
    rows = []
    for index in range(count):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        repeat = rng.randint(8, 40) if rng.random() < long_fraction else 1
        prompt = f"{a}+{b}=" if repeat == 1 else f"{a}+{b}x{repeat}="
        rows.append({"data_source": ARITHMETIC_DATA_SOURCE, "prompt": [{"role": "user", "content": prompt}],
                     "ability": "arithmetic", "reward_model": {"style": "rule", "ground_truth": str(a + b) * repeat},
                     "extra_info": {"index": index, "split": split}})
    return rows


def prepare(work: Path) -> Path:
    """The tiny model, the long-tailed train / validation sets, under work/assets."""
    from rlmega.data.files import write_rows
    from rlmega.trainer.assets import prepare_tiny_assets

    assets = work / "assets"
    prepare_tiny_assets(assets, num_train=16, num_val=16)  # the model and tokenizer; the data is replaced
    write_rows(long_tailed_rows(4000, seed=1, split="train"), assets / "long_train.parquet")
    write_rows(long_tailed_rows(256, seed=2, split="val"), assets / "long_val.parquet")
    return assets


def common(assets: Path, args: argparse.Namespace) -> list[str]:
    return [
        f"model.path={assets / 'model'}", f"data.files=[{assets / 'long_train.parquet'}]",
        f"val_data.files=[{assets / 'long_val.parquet'}]", "tiny_assets=false",
        "layout.world_size=1", "layout.tp=1", "cluster.cpus_per_rank=1",
        "rollout.placement=disaggregated", "rollout.num_engines=1", "rollout.cpus_per_engine=1",
        f"rollout.n={args.n}", f"trainer.prompts_per_step={args.prompts}", "rollout.max_new_tokens=48",
        "actor.ppo_mini_batches=1", "reward.num_workers=1", "export_hf=false", "metrics.plot=false",
        "metrics.backends=[console,jsonl]", "sync.check_every=10", "trainer.save_every=0",
        "trainer.val_prompts=256", "trainer.val_before_train=false",
        # PPO clips against the behaviour policy (the engine's log-probs: no old-log-prob pass), the usual
        # choice for asynchronous runs; the same for every mode (in sync mode it is the on-policy ratio).
        "algorithm.rollout_correction.bypass_mode=true",
        "actor.policy_loss.kl_loss_coef=0",  # no reference model (as DAPO)
    ]


def run(command: list[str], log: Path, timeout_s: float) -> None:
    with open(log, "w") as out:
        result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command[:4])} ... failed (exit {result.returncode}); see {log}:\n"
                         + log.read_text()[-3000:])


def warm_start(work: Path, assets: Path, args: argparse.Namespace) -> Path:
    """One supervised warm-start for all modes (``rlmega sft``), exported as the runs' start checkpoint."""
    run_dir = work / "sft"
    command = [sys.executable, "-m", "rlmega.cli.main", "sft", f"run_dir={run_dir}", *common(assets, args),
               f"trainer.sft_steps={args.sft_steps}", "trainer.sft_lr=2e-3", "trainer.val_every=0"]
    run(command, work / "sft.log", timeout_s=1800)
    model = run_dir / "sft_hf"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (assets / "model" / name).exists() and not (model / name).exists():
            shutil.copy(assets / "model" / name, model / name)
    return model


def measure(mode: str, seed: int, work: Path, assets: Path, model: Path, args: argparse.Namespace,
            staleness: int = 1, label: str = "") -> dict:
    label = label or mode
    name = label.replace(" ", "-").replace("=", "")
    run_dir = work / f"{name}-seed{seed}"
    command = [sys.executable, "-m", "rlmega.cli.main", "train", f"run_dir={run_dir}", *common(assets, args),
               f"model.path={model}", f"rollout.mode={mode}", f"trainer.total_steps={args.steps}",
               "trainer.sft_steps=0", f"trainer.val_every={args.steps}", "resume=never", "overwrite=true",
               f"trainer.seed={seed}", f"rollout.max_staleness={staleness}"]
    run(command, work / f"{name}-seed{seed}.log", timeout_s=3600)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "timing_s/step" in row]
    validation = [row for row in rows if "val/accuracy" in row]
    trained = [json.loads(line) for line in (run_dir / "trained_prompts.jsonl").read_text().splitlines()]
    wall = sum(row["timing_s/step"] for row in steps)
    tokens = sum(row["batch/response_tokens"] for row in steps)
    gen = sum(row["timing_s/gen"] + row.get("timing_s/wait_rollout", 0.0) for row in steps)
    result = {
        "mode": label, "seed": seed, "steps": len(steps), "wall_s": wall, "response_tokens_per_s": tokens / wall,
        "trainer_idle": gen / wall,
        "val_accuracy": validation[-1]["val/accuracy"] if validation else float("nan"),
        "staleness_max": max(row["step"] - 1 - min(row["weight_versions"]) for row in trained),
    }
    if mode == "sync":
        result["engine_idle"] = 1 - sum(row["timing_s/gen"] for row in steps) / wall
    elif mode == "async":
        result["engine_idle"] = sum(row["async/engine_idle_fraction"] * row["timing_s/step"] for row in steps) / wall
    else:  # one_step_off: the prefetch's own duration is the engine's busy time
        result["engine_idle"] = 1 - sum(row.get("timing_s/prefetch", 0.0) for row in steps) / wall
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="RL steps per mode (default 30)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (default 16)")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt (default 8)")
    parser.add_argument("--sft-steps", type=int, default=60, help="supervised warm-start steps (default 60)")
    parser.add_argument("--only", default=",".join(MODES), help="comma-separated modes (default: all three)")
    parser.add_argument("--seeds", default="1,2", help="comma-separated trainer.seed values, each mode once per seed "
                        "(default 1,2); wall times and accuracies are averaged over them")
    parser.add_argument("--max-staleness", default="1", help="comma-separated rollout.max_staleness values for "
                        "the async mode, one async run per value and seed (default 1)")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the runs here (default: a temporary dir)")
    args = parser.parse_args()
    modes = [m for m in args.only.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"--only: unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="rlmega-async-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    assets = prepare(work)
    print(f"warm-start ({args.sft_steps} steps) ...", flush=True)
    model = warm_start(work, assets, args)
    seeds = [int(seed) for seed in args.seeds.split(",") if seed]
    bounds = [int(value) for value in args.max_staleness.split(",") if value]
    if not bounds or min(bounds) < 0:
        parser.error(f"--max-staleness: expected comma-separated integers >= 0, got {args.max_staleness!r}")
    runs = []  # (mode, max_staleness, label)
    for mode in modes:
        if mode != "async":
            runs.append((mode, 1, mode))
        else:
            runs += [(mode, s, mode if len(bounds) == 1 else f"async s={s}") for s in bounds]
    results = []
    for seed in seeds:  # the modes interleaved, so a change in the machine's load touches all of them alike
        for mode, staleness, label in runs:
            print(f"{label}, seed {seed}: {args.steps} steps ...", flush=True)
            results.append(measure(mode, seed, work, assets, model, args, staleness, label))
    labels = [label for _, _, label in runs]
    summary = {label: {key: sum(r[key] for r in results if r["mode"] == label) / len(seeds)
                       for key in ("wall_s", "response_tokens_per_s", "trainer_idle", "engine_idle", "val_accuracy")}
               for label in labels}
    base = summary.get("sync", summary[labels[0]])
    print(f"\n{'mode':<14}{'wall s':>9}{'speed-up':>10}{'tok/s':>9}{'trainer idle':>14}{'engine idle':>13}"
          f"{'max stale':>11}{'val acc':>9}  per seed")
    for mode, r in summary.items():
        stale = max(x["staleness_max"] for x in results if x["mode"] == mode)
        per_seed = " / ".join(f"{x['val_accuracy']:.1%}" for x in results if x["mode"] == mode)
        print(f"{mode:<14}{r['wall_s']:>9.1f}{base['wall_s'] / r['wall_s']:>9.2f}x{r['response_tokens_per_s']:>9.1f}"
              f"{r['trainer_idle']:>14.1%}{r['engine_idle']:>13.1%}{stale:>11.0f}{r['val_accuracy']:>9.1%}  {per_seed}")
    (work / "results.json").write_text(json.dumps({"runs": results, "summary": summary}, indent=1))
    print(f"\nruns and results.json in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
