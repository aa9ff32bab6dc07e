"""A long run of the quickstart job, watching its memory: does any process of the run grow?

Runs `rlmega train --config tiny_cpu` (the quickstart config: warm-start, validation, checkpoints as it ships)
for `--steps` RL steps and, every `--every` steps (when that step's metrics row appears), samples the resident
memory of every process of the run (the driver and everything below it: the guardian, reward workers, Ray's GCS,
raylet and agents, the training ranks, the engine and what they started; without Ray, the default on one machine
since 2026-12-03, rank 0 and the engine are the driver and rank 1 its child) and the space used in /dev/shm. It
prints the samples, grouped by kind of process, then each kind's growth from the first sample at or after
`--from-step` to the last (target: <= 5 %) and its trend (the least-squares slope from there, per 100 steps).
Each sample's total is printed as it is taken; Ctrl-C stops the run early and reports what was sampled.

    python benchmarks/soak.py [--steps 500] [--every 10] [--from-step 50] [overrides...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_GROWTH = 0.05
KINDS = (  # (kind, what its command line contains), the first match wins
    ("training rank", "ray::RankProcess"),
    ("training rank", "rlmega.trainer.local_ranks"),  # ranks 1..N-1 of a run without Ray (rank 0 is the driver)
    ("engine", "ray::HFEngine"),
    ("reward worker", "rlmega.rewards._worker"),
    ("guardian", "rlmega.launch.guardian"),
    ("gcs", "gcs_server"),
    ("raylet", "raylet/raylet"),
    ("ray agents", "Agent"),
    ("ray helpers", "site-packages/ray/"),
    ("rank children", "spawn_main"),
)


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def sample(driver: int) -> dict[str, float]:
    """Resident bytes per kind of process under ``driver`` (itself included), and /dev/shm's used bytes."""
    from rlmega.launch.guardian import process_tree

    tree = sorted(process_tree(driver))
    sizes: dict[str, float] = {"driver": 0.0}
    for pid in tree:
        command = _cmdline(pid)
        kind = "driver" if pid == driver else next((name for name, marker in KINDS if marker in command), "other")
        sizes[kind] = sizes.get(kind, 0.0) + _rss_bytes(pid)
    sizes["all processes"] = sum(sizes.values())
    sizes["/dev/shm used"] = float(shutil.disk_usage("/dev/shm").used) if os.path.isdir("/dev/shm") else 0.0
    sizes["processes"] = float(len(tree))
    return sizes


def _last_step(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    last = 0
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a row being written
            continue
        if "timing_s/step" in row:
            last = max(last, row["step"])
    return last


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500, help="RL steps to run (default 500)")
    parser.add_argument("--every", type=int, default=10, help="sample every this many steps (default 10)")
    parser.add_argument("--from-step", type=int, default=50, help="growth is measured from here (default 50)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra-style overrides for rlmega train")
    args = parser.parse_args()
    samples: list[tuple[int, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="rlmega-soak-") as run_dir:
        metrics = Path(run_dir) / "metrics.jsonl"
        command = [sys.executable, "-m", "rlmega.cli.main", "train", "--config", "tiny_cpu", f"run_dir={run_dir}",
                   f"trainer.total_steps={args.steps}", "resume=never", "metrics.backends=[jsonl]", *args.overrides]
        started = time.monotonic()
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        interrupted = False
        try:
            next_sample = args.every
            while process.poll() is None:
                step = _last_step(metrics)
                if step >= next_sample:
                    samples.append((step, sample(process.pid)))
                    total = samples[-1][1]["all processes"] / 2**20
                    print(f"step {step}: {total:.1f} MB in all processes ({time.monotonic() - started:.0f} s)",
                          file=sys.stderr, flush=True)  # progress, so that a stopped soak still says something
                    next_sample = (step // args.every + 1) * args.every
                time.sleep(0.2)
        except KeyboardInterrupt:  # stopped by hand: report what was sampled
            interrupted = True
            print(f"stopped at step {_last_step(metrics)} of {args.steps}", file=sys.stderr)
        finally:
            if process.poll() is None:
                process.kill()
            process.wait()
        if process.returncode != 0 and not interrupted:
            print(f"rlmega train exited with code {process.returncode}", file=sys.stderr)
            return process.returncode
    elapsed = time.monotonic() - started
    return report(samples, args, elapsed)


def _slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of value over step (0 with fewer than two distinct steps)."""
    if len({step for step, _ in points}) < 2:
        return 0.0
    mean_step = sum(step for step, _ in points) / len(points)
    mean_value = sum(value for _, value in points) / len(points)
    spread = sum((step - mean_step) ** 2 for step, _ in points)
    return sum((step - mean_step) * (value - mean_value) for step, value in points) / spread


def report(samples: list[tuple[int, dict[str, float]]], args: argparse.Namespace, elapsed: float) -> int:
    """Print the samples and each kind's growth from ``--from-step`` to the last sample."""
    if not samples:
        print("no sample taken: the run ended before its first sampled step", file=sys.stderr)
        return 1
    kinds = [kind for kind in ("driver", *(name for name, _ in KINDS), "other", "all processes", "/dev/shm used")
             if any(kind in sizes for _, sizes in samples)]
    print(f"{samples[-1][0]} of {args.steps} steps sampled in {elapsed:.0f} s; resident MB per kind of process, "
          f"sampled every {args.every} steps")
    print(f"{'step':>6}{'procs':>7}" + "".join(f"{kind[:13]:>15}" for kind in kinds))
    for step, sizes in samples:
        columns = "".join(f"{sizes.get(kind, 0.0) / 2**20:>15.1f}" for kind in kinds)
        print(f"{step:>6}{sizes['processes']:>7.0f}{columns}")
    first = next(((step, sizes) for step, sizes in samples if step >= args.from_step), samples[0])
    last = samples[-1]
    print(f"\ngrowth from step {first[0]} to step {last[0]} (target <= {TARGET_GROWTH:.0%}); trend: the least-squares "
          "slope over those samples, per 100 steps (samples swing with checkpoints and validation; a leak shows as a "
          "steady slope)")
    window = [(step, sizes) for step, sizes in samples if step >= first[0]]
    worst = 0.0
    for kind in kinds:
        before, after = first[1].get(kind, 0.0), last[1].get(kind, 0.0)
        growth = (after - before) / before if before else 0.0
        if kind != "/dev/shm used":
            worst = max(worst, growth)
        slope = _slope([(step, sizes.get(kind, 0.0)) for step, sizes in window])
        trend = f"{slope * 100 / before:>+8.2%} per 100 steps" if before else ""
        print(f"{kind:<16}{before / 2**20:>10.1f} MB -> {after / 2**20:>10.1f} MB  {growth:>+8.1%}   trend {trend}")
    print(f"largest process-memory growth {worst:+.1%}: target {'met' if worst <= TARGET_GROWTH else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
