"""rlmega next to TRL's GRPOTrainer on the same tiny GRPO job, one after the other, on CPU.

The job: the quickstart's model (rlmega.trainer.assets: a 2-layer, hidden-128 Llama-architecture model
and its character tokenizer, one HF checkpoint directory for both frameworks), the quickstart's
arithmetic prompts scored by exact answer (rlmega.rewards.exact.arithmetic_score; for TRL wrapped in a
reward function of TRL's signature), 8 prompts x 8 responses per step, at most 8 new tokens,
temperature 1, no reference model (KL coefficient 0), one optimizer step per batch, the same
learning rate (constant), optimizer settings and clip range.

Runs, each in a fresh process:
  trl            GRPOTrainer (TRL 1.16): per_device_train_batch_size=64, gradient_accumulation_steps=1,
                 num_generations=8 (so generation_batch_size = 64 completions = 8 prompts and
                 steps_per_generation = 1), num_iterations=1 (no separate old log-prob pass),
                 beta=0, transformers generate (no vLLM), use_cpu, fp32, no gradient checkpointing
                 (TRL turns it on by default; rlmega recomputes nothing by default).
  rlmega 1 rank  rlmega train --config tiny_cpu, layout.world_size=1 layout.tp=1, colocated: in one process
                 (cluster.in_process=auto picks it: the rank and the engine live in the driver, without Ray)
  rlmega TP2     the same at layout.world_size=2 layout.tp=2, also without Ray: rank 0 and the engine in the
                 driver, rank 1 a child process of it (rlmega/trainer/local_ranks.py)
rlmega's old log-probs come from the update's own forward pass (trainer.fuse_old_logprob, on by
default) and the post-sync check runs after the first sync and every --check-every-th.

Threads (--threads, default 2): TRL's process gets that many (OMP_NUM_THREADS and
torch.set_num_threads); rlmega's engine gets them too (rollout.cpus_per_engine), and its training
ranks share them (1 rank: all of them; TP2: one each). --on-ray adds the TP2 run on Ray
(cluster.in_process=never: two rank actors and an engine actor) for comparison.

Step time: median over the steps after the first --skip (warm-up). TRL's from a TrainerCallback's
on_step_end wall times; rlmega's from timing_s/step in run_dir/metrics.jsonl. TRL's phases come
from its own profiling contexts (transformers.generate, _calculate_rewards, _prepare_inputs,
compute_loss), collected by this script instead of a W&B / MLflow run.

Rounds (--rounds, default 3): each round runs every configuration once, so that a machine that speeds up or
slows down (a shared VM drifts by 50 % within minutes) moves all of them alike; every other round runs them in
reverse order, so that a drift within a round favours none of them. A ratio is taken within a round, and the
report gives each round's ratios and their median.

    python benchmarks/peer_trl.py [--steps 22] [--skip 2] [--rounds 3] [--only trl|rlmega] [--threads 2] [--work-dir DIR]

Needs TRL: pip install -e .[bench]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

PROMPTS_PER_STEP = 8
RESPONSES_PER_PROMPT = 8
MAX_NEW_TOKENS = 8
LEARNING_RATE = 5.0e-4  # configs/tiny_cpu.yaml's actor.optimizer.lr
CLIP_RATIO = 0.2  # rlmega's PPO clip range; TRL's epsilon
SEED = 1
RLMEGA_PHASES = ("gen", "old_log_prob", "ref", "update_actor", "sync")
LOG_TAIL_CHARS = 4000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=22, help="RL steps per run (default 22)")
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of the medians (warm-up, default 2)")
    parser.add_argument("--only", choices=("trl", "rlmega"), default=None, help="run one framework only")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every configuration, interleaved (default 3)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads each framework may use (default 2)")
    parser.add_argument("--check-every", type=int, default=10,
                        help="rlmega's sync.check_every: post-sync check after every k-th sync (default 10)")
    parser.add_argument("--on-ray", action="store_true",
                        help="also run rlmega at TP2 on Ray (cluster.in_process=never), for comparison")
    parser.add_argument("--work-dir", default=None,
                        help="keep the assets, logs, run directories and TRL's step record here (default: a "
                             "temporary directory, removed afterwards)")
    parser.add_argument("--trl-child", nargs=2, metavar=("ASSETS", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps <= args.skip:
        parser.error(f"--steps ({args.steps}) must exceed --skip ({args.skip})")
    if args.trl_child:
        return trl_child(Path(args.trl_child[0]), Path(args.trl_child[1]), args.steps, args.threads)

    frameworks = ("trl", "rlmega") if args.only is None else (args.only,)
    if "trl" in frameworks and importlib.util.find_spec("trl") is None:
        print("peer_trl.py: TRL is not installed; install the benchmark extra with: pip install -e .[bench] "
              "(or run --only rlmega)", file=sys.stderr)
        return 2

    from rlmega.trainer.assets import prepare_tiny_assets

    rounds = []
    with tempfile.TemporaryDirectory(prefix="peer_trl_") as scratch:
        work = Path(args.work_dir or scratch)
        work.mkdir(parents=True, exist_ok=True)
        assets = Path(prepare_tiny_assets(work / "assets")["model"]).parent
        runs = [lambda: run_trl(work, assets, args)] if "trl" in frameworks else []
        if "rlmega" in frameworks:
            runs += [lambda label=label, layout=layout: run_rlmega(work, assets, args, label, layout)
                     for label, layout in rlmega_configs(args)]
        for number in range(1, args.rounds + 1):
            print(f"round {number}/{args.rounds}", file=sys.stderr, flush=True)
            # Every other round in reverse order: a machine drifting within a round favours no configuration.
            order = range(len(runs)) if number % 2 else reversed(range(len(runs)))
            results = {index: runs[index]() for index in order}
            rounds.append([results[index] for index in range(len(runs))])
    print_report(rounds, args)
    return 0


# ---- TRL ---------------------------------------------------------------------------------------

def run_trl(work: Path, assets: Path, args: argparse.Namespace) -> dict:
    result_path = work / "trl.json"
    command = [sys.executable, os.path.abspath(__file__), "--trl-child", str(assets), str(result_path),
               "--steps", str(args.steps), "--skip", str(args.skip), "--threads", str(args.threads)]
    wall = _run_logged(command, work / "trl.log", "TRL", {"OMP_NUM_THREADS": str(args.threads)})
    result = json.loads(result_path.read_text())
    steps = [later - earlier for earlier, later in zip(result["step_end_times"], result["step_end_times"][1:])]
    measured = range(args.skip, len(steps))
    phase = lambda name: statistics.median(result["phases"][str(k + 1)].get(name, 0.0) for k in measured)  # noqa: E731
    prepare, loss_forward = phase("_prepare_inputs"), phase("compute_loss")
    step = statistics.median(steps[k] for k in measured)
    return {
        "framework": "TRL", "config": f"GRPOTrainer {result['trl_version']}, 1 process",
        "step_s": step, "wall_s": wall, "step_times": steps,
        "response_length": statistics.mean(result["logs"][k].get("completions/mean_length", float("nan"))
                                           for k in measured),
        "score": statistics.mean(result["logs"][k].get("reward", float("nan")) for k in measured),
        "own_step_s": statistics.median(result["logs"][k].get("step_time", float("nan")) for k in measured),
        "phases": {"generate": phase("transformers.generate"), "rewards": phase("_calculate_rewards"),
                   "rest of _prepare_inputs": prepare - phase("transformers.generate") - phase("_calculate_rewards"),
                   "compute_loss (forward)": loss_forward,
                   "backward + optimizer + rest": step - prepare - loss_forward},
    }


def trl_child(assets: Path, result_path: Path, num_steps: int, threads: int) -> int:
    """TRL's run, in its own process: the trainer, its step times, logs and profiled phases as JSON."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    from rlmega.data.files import read_rows
    from rlmega.rewards.exact import arithmetic_score

    torch.set_num_threads(threads)
    rows = read_rows(assets / "train.parquet")
    dataset = Dataset.from_dict({"prompt": [row["prompt"] for row in rows],
                                 "ground_truth": [row["reward_model"]["ground_truth"] for row in rows]})

    def arithmetic_reward(completions, ground_truth, **kwargs) -> list[float]:
        """rlmega's arithmetic scorer in TRL's reward-function signature (conversational completions)."""
        return [arithmetic_score(completion[0]["content"], answer) for completion, answer in zip(completions, ground_truth)]

    # TRL times its phases with ProfilingContext but reports them only to W&B / MLflow / Trackio;
    # collect them per step here instead. ``step`` is the global step when the block began (0-based).
    phases: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def record(context, duration: float) -> None:
        phases[context.step + 1][context.name.split(".", 1)[1]] += duration

    profiling.ProfilingContext._log_metrics = record

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.step_end_times: list[float] = []
            self.logs: list[dict] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.step_end_times.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.step_end_times.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.logs.append({key: value for key, value in logs.items() if isinstance(value, (int, float))})

    config = GRPOConfig(
        output_dir=str(result_path.parent / "trl_output"),
        use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        max_steps=num_steps, seed=SEED,
        per_device_train_batch_size=PROMPTS_PER_STEP * RESPONSES_PER_PROMPT, gradient_accumulation_steps=1,
        num_generations=RESPONSES_PER_PROMPT, num_iterations=1,
        max_completion_length=MAX_NEW_TOKENS, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, epsilon=CLIP_RATIO, loss_type="dapo",  # dapo: token mean over the batch (rlmega's token-mean)
        scale_rewards="group",  # GRPO's group std, as rlmega's algorithm.norm_adv_by_std
        learning_rate=LEARNING_RATE, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        logging_steps=1, report_to=[], save_strategy="no", eval_strategy="no", disable_tqdm=True,
        use_vllm=False, dataloader_num_workers=0,
    )
    timer = StepTimes()
    trainer = GRPOTrainer(model=str(assets / "model"), reward_funcs=arithmetic_reward, args=config,
                          train_dataset=dataset, callbacks=[timer])
    trainer.train()
    result_path.write_text(json.dumps({
        "trl_version": trl.__version__, "step_end_times": timer.step_end_times, "logs": timer.logs,
        "phases": {str(step): dict(named) for step, named in phases.items()},
    }))
    return 0


# ---- rlmega ------------------------------------------------------------------------------------

def rlmega_configs(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """(label, layout) of each rlmega run of a round."""
    configs = [("1 rank", dict(world_size=1, tp=1, in_process="auto")),
               ("TP2", dict(world_size=2, tp=2, in_process="auto"))]
    if args.on_ray:
        configs.append(("TP2 on Ray", dict(world_size=2, tp=2, in_process="never")))
    return configs


def rlmega_overrides(run_dir: Path, assets: Path, args: argparse.Namespace, layout: dict) -> list[str]:
    """The overrides of ``rlmega train --config tiny_cpu`` for this job (check with --print-config)."""
    threads = args.threads
    return [
        f"run_dir={run_dir}", "resume=never", "overwrite=true", "tiny_assets=false",
        f"model.path={assets / 'model'}", f"data.files=['{assets / 'train.parquet'}']",
        f"val_data.files=['{assets / 'val.parquet'}']",
        f"layout.world_size={layout['world_size']}", f"layout.tp={layout['tp']}",
        f"cluster.in_process={layout['in_process']}",
        f"cluster.cpus_per_rank={max(1, threads // layout['world_size'])}", f"rollout.cpus_per_engine={threads}",
        f"trainer.total_steps={args.steps}", f"trainer.prompts_per_step={PROMPTS_PER_STEP}",
        f"trainer.seed={SEED}", "trainer.sft_steps=0", "trainer.val_every=0", "trainer.save_every=0",
        f"rollout.n={RESPONSES_PER_PROMPT}", f"rollout.max_new_tokens={MAX_NEW_TOKENS}", "rollout.temperature=1.0",
        "actor.ppo_mini_batches=1", "actor.ppo_epochs=1", "actor.policy_loss.kl_loss_coef=0",
        f"actor.optimizer.lr={LEARNING_RATE}", "actor.optimizer.lr_schedule=constant",
        f"sync.check_every={args.check_every}", "export_hf=false", "metrics.backends=[jsonl]",
    ]


def run_rlmega(work: Path, assets: Path, args: argparse.Namespace, label: str, layout: dict) -> dict:
    name = f"rlmega_{layout['world_size']}x{layout['tp']}" + ("_ray" if layout["in_process"] == "never" else "")
    run_dir = work / name
    command = [sys.executable, "-m", "rlmega.cli.main", "train", "--config", "tiny_cpu",
               *rlmega_overrides(run_dir, assets, args, layout)]
    wall = _run_logged(command, work / f"{name}.log", f"rlmega {label}", {})
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "timing_s/step" in row]
    measured = rows[args.skip:]
    median = lambda key: statistics.median(row.get(key, 0.0) for row in measured)  # noqa: E731
    step = median("timing_s/step")
    phases = {phase: median(f"timing_s/{phase}") for phase in RLMEGA_PHASES}
    rest = statistics.median(row["timing_s/step"] - sum(row.get(f"timing_s/{p}", 0.0) for p in RLMEGA_PHASES)
                             for row in measured)
    return {
        "framework": "rlmega", "step_s": step, "wall_s": wall,
        "config": f"{label}, {json.loads((run_dir / 'placement.json').read_text())['placement'].replace('_', ' ')}",
        "step_times": [row["timing_s/step"] for row in rows],
        "response_length": statistics.mean(row["response_length/mean"] for row in measured),
        "score": statistics.mean(row["critic/score/mean"] for row in measured),
        "phases": {**phases, "rest": rest},
    }


# ---- shared ------------------------------------------------------------------------------------

def _run_logged(command: list[str], log_path: Path, name: str, env: dict[str, str]) -> float:
    """Run ``command`` with its output in ``log_path``; its wall seconds. On failure, exit with the log's tail."""
    started = time.perf_counter()
    print(f"running {name} ...", file=sys.stderr, flush=True)
    with open(log_path, "w") as log:
        returncode = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}).returncode
    if returncode != 0:
        sys.exit(f"peer_trl.py: {name} failed (exit code {returncode}); the end of its output:\n"
                 f"{log_path.read_text()[-LOG_TAIL_CHARS:]}")
    return time.perf_counter() - started


def print_report(rounds: list[list[dict]], args: argparse.Namespace) -> None:
    """Each round's step times and ratios, the median ratio over rounds, and the last round's details."""
    print(f"{PROMPTS_PER_STEP} prompts x {RESPONSES_PER_PROMPT} responses, <= {MAX_NEW_TOKENS} new tokens; "
          f"median of steps {args.skip + 1}..{args.steps}; {args.threads} threads each; {len(rounds)} rounds")
    print(f"{'round':<7}{'framework':<10}{'config':<28}{'s/step':>9}{'ratio to TRL':>14}{'resp len':>10}{'score':>8}"
          f"{'wall s':>9}")
    ratios: dict[str, list[float]] = defaultdict(list)
    for number, results in enumerate(rounds, start=1):
        trl = next((r for r in results if r["framework"] == "TRL"), None)
        for r in results:
            ratio = r["step_s"] / trl["step_s"] if trl else None
            if ratio is not None:
                ratios[f"{r['framework']} {r['config']}"].append(ratio)
            shown = f"{ratio:.2f}x" if ratio is not None else "-"
            print(f"{number:<7}{r['framework']:<10}{r['config']:<28}{r['step_s']:>9.3f}{shown:>14}"
                  f"{r['response_length']:>10.2f}{r['score']:>8.3f}{r['wall_s']:>9.1f}")
    if ratios:
        print("\nmedian ratio to TRL over the rounds (each round's ratios):")
        for name, values in ratios.items():
            print(f"  {name:<40}{statistics.median(values):>6.2f}x   ({', '.join(f'{v:.2f}' for v in values)})")
    results = rounds[-1]
    trl = next((r for r in results if r["framework"] == "TRL"), None)
    if trl:
        print(f"\n(last round: TRL's own step_time log: median {trl['own_step_s']:.3f} s)")
    print("\nlast round, seconds of each step (the first --skip are warm-up):")
    for r in results:
        print(f"  {r['framework']} {r['config']}: " + " ".join(f"{seconds:.3f}" for seconds in r["step_times"]))
    for r in results:
        print(f"\nlast round, {r['framework']} {r['config']}: median seconds per phase (share of the median step)")
        for phase, seconds in r["phases"].items():
            print(f"  {phase:<30}{seconds:>8.3f}{seconds / r['step_s']:>8.1%}")


if __name__ == "__main__":
    sys.exit(main())
