"""The training ranks as Ray actors: one process per rank, hosting that rank's actor, reference and
critic workers (they share the rank's devices and process groups).

The controller calls every rank with the same arguments (the workers are collective) and keeps
rank 0's answer.
"""

from __future__ import annotations

import dataclasses
import datetime
import socket
from pathlib import Path
from typing import Any, Optional

from rlmega.config.schema import RLConfig
from rlmega.trainer.remote import wait_all


class RankProcess:
    """What runs inside one training rank's Ray actor."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.workers: dict = {}

    def address(self) -> tuple[str, int, str]:
        """This node's IP, a free port on it, and the Ray node id (for rank 0's rendezvous and placement)."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((ip, 0))
            port = sock.getsockname()[1]
        return ip, port, ray.get_runtime_context().get_node_id()

    def setup(self, master: tuple[str, int], config: RLConfig, total_steps: int) -> None:
        import torch
        import torch.distributed as dist

        from rlmega.models import model_spec_from_hf
        from rlmega.parallel.layout import ParallelLayout, default_backend, initialize
        from rlmega.workers.worker import MegatronWorker

        torch.set_num_threads(max(1, int(config.cluster.cpus_per_rank)))
        timeout = datetime.timedelta(seconds=config.cluster.timeout_s)
        dist.init_process_group(default_backend(), init_method=f"tcp://{master[0]}:{master[1]}",
                                rank=self.rank, world_size=self.world_size, timeout=timeout)
        self.layout = ParallelLayout(**dataclasses.asdict(config.layout))
        initialize(self.layout, timeout_s=config.cluster.timeout_s, seed=config.trainer.seed)
        self.spec = model_spec_from_hf(config.model.path)
        roles = {"actor": config.actor}
        if config.needs_reference:
            roles["ref"] = config.ref
        if config.needs_critic:
            roles["critic"] = config.critic
        # A warm-started reference is the warm-started actor, so checkpoints keep it too.
        self.reference_warm_started = "ref" in roles and config.trainer.sft_steps > 0
        for name, worker_config in roles.items():
            self.workers[name] = MegatronWorker(self.spec, self.layout, worker_config, hf_dir=config.model.path,
                                                total_steps=total_steps)

    def call(self, role: str, method: str, *args, **kwargs) -> Any:
        result = getattr(self.workers[role], method)(*args, **kwargs)
        return result if self.rank == 0 else None

    def reference_from_actor(self) -> None:
        """Make the reference model the actor's current weights (after a supervised warm-start the
        warm-started model, not the initial checkpoint, is what the KL term should stay near)."""
        import torch

        reference, actor = self.workers["ref"], self.workers["actor"]
        with reference._on_device(), torch.no_grad():
            for target, source in zip(_parameters(reference.chunks), _parameters(actor.chunks), strict=True):
                target.copy_(source)

    def sft_step(self, batch, lr: float) -> Optional[dict]:
        result = self.workers["actor"].sft_step(batch, lr)
        return result if self.rank == 0 else None

    def set_offloaded(self, offloaded: bool) -> int:
        """Offload (or onload) the trained roles; the bytes moved on this rank."""
        moved = 0
        for name, worker in self.workers.items():
            if name != "ref" and worker.offloaded != offloaded:
                moved += worker.offload() if offloaded else worker.onload()
        return moved

    def push_weights(self, engines: list, version: int, bucket_bytes: int, transport: str, timeout_s: float):
        from rlmega.sync import push_weights

        actor = self.workers["actor"]
        stats = push_weights(actor.chunks, self.spec, engines if self.rank == 0 else None, version,
                             engine_rank=0, bucket_bytes=bucket_bytes, transport=transport, timeout_s=timeout_s)
        return stats if self.rank == 0 else None

    def post_sync_check(self, engines: list, prompts: list[list[int]], version: int) -> Optional[float]:
        from rlmega.sync import post_sync_check

        actor = self.workers["actor"]
        worst = 0.0
        for engine in engines:
            worst = max(worst, post_sync_check(actor.chunks, self.spec, engine if self.rank == 0 else None, prompts,
                                               engine_rank=0, version=version))
        return worst if self.rank == 0 else None

    def save(self, root: str, extra: dict) -> Optional[dict]:
        """Each trained role under ``root/<role>``; the actor last, so its tracker names a step whose
        critic checkpoint is complete too."""
        paths = {}
        for name in sorted(self.workers, key=lambda role: role == "actor"):
            if name != "ref" or self.reference_warm_started:
                paths[name] = str(self.workers[name].save_checkpoint(Path(root) / name, extra, step=extra["step"]))
        return paths if self.rank == 0 else None

    def load(self, root: str, step: int) -> Optional[dict]:
        from rlmega.workers.checkpoint import iteration_dir

        extra = {}
        for name, worker in self.workers.items():
            if name != "ref" or self.reference_warm_started:
                extra = worker.load_checkpoint(iteration_dir(Path(root) / name, step))
        return extra if self.rank == 0 else None

    def shutdown(self) -> None:
        import torch.distributed as dist

        from rlmega.parallel.layout import destroy

        destroy(including_default_group=dist.is_initialized())


def _parameters(chunks: list):
    for chunk in chunks:
        yield from chunk.parameters()


class TrainingGroup:
    """``world_size`` rank actors placed in ``placement_group`` bundles 0..world_size-1."""

    def __init__(self, config: RLConfig, placement_group, total_steps: int):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.config = config
        self.timeout_s = config.cluster.timeout_s
        world_size = config.layout.world_size
        actor_class = ray.remote(RankProcess)
        self.ranks = [
            actor_class.options(
                num_cpus=config.cluster.cpus_per_rank, num_gpus=config.cluster.gpus_per_rank,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=rank),
                runtime_env={"env_vars": {"OMP_NUM_THREADS": str(max(1, int(config.cluster.cpus_per_rank)))}},
            ).remote(rank, world_size)
            for rank in range(world_size)
        ]
        self.names = [f"training rank {rank}" for rank in range(world_size)]
        addresses = self._all("address")
        self.nodes = [{"rank": rank, "ip": ip, "node_id": node} for rank, (ip, _, node) in enumerate(addresses)]
        master = addresses[0][:2]
        self._all("setup", master, config, total_steps, timeout_s=max(self.timeout_s, 600.0))

    def _all(self, method: str, *args, timeout_s: Optional[float] = None, **kwargs) -> list:
        refs = [getattr(rank, method).remote(*args, **kwargs) for rank in self.ranks]
        return wait_all(refs, self.names, timeout_s or self.timeout_s, method)

    def run(self, method: str, *args, **kwargs) -> Any:
        """Call ``method`` on every rank; rank 0's answer."""
        return self._all(method, *args, **kwargs)[0]

    def call(self, role: str, method: str, *args, **kwargs) -> Any:
        """``worker.method(*args)`` of role ``role`` on every rank; rank 0's answer."""
        return self.run("call", role, method, *args, **kwargs)

    def shutdown(self) -> None:
        import ray

        try:
            self._all("shutdown", timeout_s=30.0)
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
        for rank in self.ranks:
            ray.kill(rank)

