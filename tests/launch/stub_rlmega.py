"""A stand-in for ``rlmega train`` with the same command line and outputs, for the launcher tests.

    python tests/launch/stub_rlmega.py train [--config NAME] [key=value ...]

It joins the Ray cluster (``cluster.ray_address=auto`` reads ``$RAY_ADDRESS``), places
``rollout.num_engines`` engine actors with a placement group (``rollout.placement=disaggregated``
with ``rollout.engine_spread=spread``: SPREAD; otherwise PACK), runs
``trainer.total_steps`` steps, and writes what the real trainer writes under ``run_dir``:
``placement.json``, ``metrics.jsonl``, ``checkpoints/iter_XXXXXXX/`` and
``checkpoints/latest_checkpointed_iteration.txt``. On SIGTERM it finishes the step, saves a
checkpoint, prints ``preempted: checkpoint saved at step k`` and exits 143; ``resume=auto`` continues.
``stub.step_seconds`` sets how long a step takes (default 1).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

DEFAULTS = {
    "run_dir": "runs/stub",
    "trainer.total_steps": "3",
    "trainer.save_every": "1",
    "resume": "auto",
    "cluster.ray_address": "auto",
    "rollout.num_engines": "2",
    "rollout.placement": "colocated",
    "rollout.engine_spread": "pack",
    "stub.step_seconds": "1",
}


def parse(argv):
    if not argv or argv[0] != "train":
        sys.exit("usage: stub_rlmega.py train [--config NAME] [key=value ...]")
    config, argv = "tiny_cpu", argv[1:]
    if argv[:1] == ["--config"]:
        config, argv = argv[1], argv[2:]
    settings = dict(DEFAULTS)
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or key not in DEFAULTS:
            sys.exit(f"stub_rlmega: unknown override {item!r}; known: {', '.join(DEFAULTS)}")
        settings[key] = value
    return config, settings


def latest_step(checkpoints: Path) -> int:
    marker = checkpoints / "latest_checkpointed_iteration.txt"
    return int(marker.read_text()) if marker.exists() else 0


def save(checkpoints: Path, step: int) -> None:
    directory = checkpoints / f"iter_{step:07d}"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "state.json").write_text(json.dumps({"step": step}))
    marker = checkpoints / "latest_checkpointed_iteration.txt"
    marker.with_suffix(".tmp").write_text(str(step))
    marker.with_suffix(".tmp").replace(marker)


def main() -> int:
    config, settings = parse(sys.argv[1:])
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    address = settings["cluster.ray_address"]
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS", "auto")
    ray.init(address=None if address == "null" else address, log_to_driver=False)
    # After ray.init: it installs its own SIGTERM handler (exit code 15) in drivers.
    preempted = []
    signal.signal(signal.SIGTERM, lambda *_: preempted.append(True))

    run_dir = Path(settings["run_dir"])
    checkpoints = run_dir / "checkpoints"
    run_dir.mkdir(parents=True, exist_ok=True)
    start = latest_step(checkpoints) if settings["resume"] == "auto" else 0
    total_steps = int(settings["trainer.total_steps"])
    save_every = int(settings["trainer.save_every"])
    step_seconds = float(settings["stub.step_seconds"])
    num_engines = int(settings["rollout.num_engines"])
    print(f"stub trainer: config {config}, steps {start + 1}..{total_steps}, {num_engines} engines",
          flush=True)

    @ray.remote(num_cpus=0.1)
    class Engine:
        def where(self):
            context = ray.get_runtime_context()
            return {"node_id": context.get_node_id(), "ip": ray.util.get_node_ip_address()}

        def generate(self, step):
            return float(step)

    spread = (settings["rollout.placement"], settings["rollout.engine_spread"]) == ("disaggregated", "spread")
    strategy = "SPREAD" if spread else "PACK"
    group = placement_group([{"CPU": 0.1}] * num_engines, strategy=strategy)
    ray.get(group.ready(), timeout=120)
    engines = [
        Engine.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, index)).remote()
        for index in range(num_engines)
    ]
    where = ray.get([engine.where.remote() for engine in engines], timeout=120)
    context = ray.get_runtime_context()
    placement = {
        "placement": settings["rollout.placement"],
        "training_ranks": [{"rank": 0, "node_id": context.get_node_id(), "ip": ray.util.get_node_ip_address()}],
        "engines": [{"engine": index, **spot} for index, spot in enumerate(where)],
        "cluster_nodes": sorted(node["NodeID"] for node in ray.nodes() if node["Alive"]),
        "gcs_address": context.gcs_address,
    }
    (run_dir / "placement.json").write_text(json.dumps(placement, indent=1))

    step = start
    with open(run_dir / "metrics.jsonl", "a") as metrics:
        while step < total_steps:
            step += 1
            rewards = ray.get([engine.generate.remote(step) for engine in engines], timeout=120)
            time.sleep(step_seconds)
            metrics.write(json.dumps({"step": step, "reward": sum(rewards) / len(rewards)}) + "\n")
            metrics.flush()
            print(f"step {step}/{total_steps}", flush=True)
            if preempted:
                save(checkpoints, step)
                print(f"preempted: checkpoint saved at step {step}", flush=True)
                return 143
            if step % save_every == 0 or step == total_steps:
                save(checkpoints, step)
    print("stub trainer: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
