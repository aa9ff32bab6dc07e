"""Where an RL step's time goes, for the tiny CPU job, and the framework's own overhead.

Runs `rlmega train --config tiny_cpu` for a few steps (no validation, no checkpoints), reads
metrics.jsonl and prints, per phase, the mean seconds and share of the step. "Overhead" is the
step's wall time outside the phases that do the work (generation, log-prob/value forwards,
forward-backward + optimizer, weight sync): the controller's own bookkeeping, reward scoring,
advantage computation, batching and Ray round trips between phases. Target: <= 10 % of the step.

    python benchmarks/step_breakdown.py [--steps 12] [--skip 2] [overrides...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

WORK_PHASES = ("gen", "old_log_prob", "ref", "values", "update_critic", "update_actor", "sync")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="RL steps to run (default 12)")
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of the means (warm-up)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra-style overrides for rlmega train")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as run_dir:
        command = [sys.executable, "-m", "rlmega.cli.main", "train", "--config", "tiny_cpu", f"run_dir={run_dir}",
                   f"trainer.total_steps={args.steps}", "trainer.val_every=0", "trainer.save_every=0",
                   "trainer.sft_steps=5", "export_hf=false", "resume=never", "metrics.backends=[jsonl]", *args.overrides]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "timing_s/step" in row][args.skip:]
    mean = lambda key: sum(row.get(key, 0.0) for row in rows) / len(rows)  # noqa: E731
    step = mean("timing_s/step")
    print(f"{len(rows)} steps measured, mean step {step:.3f} s")
    print(f"{'phase':<16}{'seconds':>10}{'share':>9}")
    work = 0.0
    for phase in WORK_PHASES:
        seconds = mean(f"timing_s/{phase}")
        if seconds:
            work += seconds
            print(f"{phase:<16}{seconds:>10.3f}{seconds / step:>9.1%}")
    overhead = step - work
    print(f"{'overhead':<16}{overhead:>10.3f}{overhead / step:>9.1%}   (target <= 10%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
