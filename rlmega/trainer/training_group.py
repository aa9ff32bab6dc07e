"""The training ranks as Ray actors: one process per rank, hosting that rank's actor, reference and
critic workers (they share the rank's devices and process groups); a reward model's ranks and each
teacher's are a group of their own, with their own world, layout and placement group.

``RankProcess`` is what runs in each actor; ``TrainingRanks`` calls every rank with the same
arguments (the workers are collective) and keeps rank 0's answer. The controller does not call it
directly: it holds the typed role groups of ``rlmega.trainer.roles``, built on one ``TrainingRanks``
(``TrainingRanks.for_policy``; ``TrainingRanks.for_frozen_model`` for a reward model's or a teacher's group).
"""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path
from typing import Any, Callable, Optional

from rlmega.config.schema import RLConfig
from rlmega.trainer.remote import wait_all
from rlmega.workers.batching import SequenceBatch

STORE_TIMEOUT_S = 600.0
"""How long rank 0's store waits on a key until set-up gives it ``cluster.timeout_s``."""


class RankProcess:
    """What runs in one training rank's process: a Ray actor, or the driver of a run in one process
    (``rlmega.trainer.in_process``). Every method is collective over the ranks and returns rank 0's result
    (None elsewhere)."""

    def __init__(self, rank: int, world_size: int):
        from rlmega.trainer.worker_logs import redirect_output

        redirect_output()  # library warnings and progress bars go to this rank's log, not the console
        self.rank, self.world_size = rank, world_size
        self.workers: dict = {}
        self.weight_sync = None
        """The run's weight sync into the engines (``connect_engines``), on the policy's ranks."""
        self.sliced_setup = None  # where things are, for sync.transport=sliced (set up with the policy)
        self.engine_weight_dtype = "auto"

    def address(self) -> tuple[str, int, str, str]:
        """This node's IP, the rendezvous port (rank 0: its process-group store's, bound here; 0 on the
        others), the Ray node id (for rank 0's rendezvous and placement) and the GPUs Ray gave this rank
        (its CUDA_VISIBLE_DEVICES; colocated engines run on them, ``rlmega.trainer.engine_devices``)."""
        import os

        import ray

        ip = self.node_ip = ray.util.get_node_ip_address()
        port = self.listen(ip) if self.rank == 0 else 0
        gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "") if ray.get_gpu_ids() else ""
        return ip, port, ray.get_runtime_context().get_node_id(), gpus

    def listen(self, ip: str) -> int:
        """Rank 0: start the group's store on ``ip`` and return its port. The store binds its port now and holds
        it: a port found free and bound only at set-up could be taken in between by another process (seen
        under load: EADDRINUSE)."""
        import torch.distributed as dist

        self._store = dist.TCPStore(ip, 0, self.world_size, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
        return self._store.port

    def setup(self, master: tuple[str, int], config: RLConfig, total_steps: int, cpus: Optional[float] = None) -> None:
        """This rank of the policy's world: the actor, and the reference and critic when the run needs them.
        ``cpus``: torch's threads (default ``cluster.cpus_per_rank``)."""
        from rlmega.models import model_spec_from_hf
        from rlmega.workers.worker import MegatronWorker

        self._join(master, config.layout, config.cluster.cpus_per_rank if cpus is None else cpus, config)
        self.spec = model_spec_from_hf(config.model.path, mtp=config.model.mtp)
        self.sync_config, self.post_sync_atol = config.sync, config.post_sync_atol()
        from rlmega.sync.sliced import SlicedSetup

        self.sliced_setup = SlicedSetup(self.layout, config.model.path, config.rollout.placement == "colocated",
                                        config.plan.gpus_per_node)
        self.engine_weight_dtype = config.rollout.weight_dtype  # fp8: the sync sends quantized weights
        self.base_model = config.model.path  # the engines' start checkpoint: a LoRA actor's adapters apply to it
        roles = {"actor": config.actor}
        if config.builds_reference_model:  # a LoRA actor is its own reference, adapters off
            roles["ref"] = config.ref
        if config.needs_critic:
            roles["critic"] = config.critic
        # A warm-started reference is the warm-started actor, so checkpoints keep it too.
        self.reference_warm_started = "ref" in roles and config.trainer.sft_steps > 0
        for name, worker_config in roles.items():
            self.workers[name] = MegatronWorker(self.spec, self.layout, worker_config, hf_dir=config.model.path,
                                                total_steps=total_steps)

    def setup_frozen_model(self, master: tuple[str, int], config: RLConfig, settings) -> None:
        """This rank of a frozen model's own world (``settings``: ``reward_model`` or a teacher of ``teacher``):
        its layout, and the worker of ``settings.worker_config()``'s role (reward, teacher) loaded from
        ``settings.path`` through the bridge. No optimizer and no gradient buffers; with ``settings.offload``, the
        weights rest in host memory between calls."""
        from rlmega.models import model_spec_from_hf
        from rlmega.workers.worker import MegatronWorker

        worker_config = settings.worker_config()
        self._join(master, settings.layout, settings.cpus_per_rank, config)
        self.spec = model_spec_from_hf(settings.path)
        self.reference_warm_started = False
        self.workers[worker_config.role] = MegatronWorker(self.spec, self.layout, worker_config, hf_dir=settings.path)

    def _join(self, master: tuple[str, int], layout, cpus: float, config: RLConfig) -> None:
        """Join this group's process group at ``master`` and build Megatron's groups for ``layout``."""
        import torch
        import torch.distributed as dist

        from rlmega.parallel.gloo_interface import bind_gloo_where_ranks_meet
        from rlmega.parallel.layout import default_backend, initialize

        torch.set_num_threads(max(1, int(cpus)))
        timeout = datetime.timedelta(seconds=config.cluster.timeout_s)
        store = getattr(self, "_store", None)  # rank 0's, from listen()
        if store is None:
            store = dist.TCPStore(master[0], master[1], self.world_size, is_master=False, timeout=timeout)
        store.set_timeout(timeout)
        bind_gloo_where_ranks_meet([getattr(self, "node_ip", None), master[0]])  # this rank's node, else the store's
        dist.init_process_group(default_backend(), store=store, rank=self.rank, world_size=self.world_size,
                                timeout=timeout)
        self.layout = layout.build()
        initialize(self.layout, timeout_s=config.cluster.timeout_s, seed=config.trainer.seed)

    def _rank0(self, result: Any) -> Any:
        """Rank 0's answer (per-sequence tensors packed for the trip to the driver); None on the others."""
        from rlmega.workers.packed import portable

        return portable(result) if self.rank == 0 else None

    # ---- the roles' work ------------------------------------------------------------------

    def compute_logprobs(self, role: str, batch: SequenceBatch):
        if role == "ref" and role not in self.workers:  # a LoRA actor: the reference is its base model
            return self._rank0(self.workers["actor"].compute_logprobs(batch, adapters=False))
        return self._rank0(self.workers[role].compute_logprobs(batch))

    def compute_values(self, batch: SequenceBatch):
        return self._rank0(self.workers["critic"].compute_values(batch))

    def compute_scores(self, batch: SequenceBatch):
        return self._rank0(self.workers["reward"].compute_scores(batch))

    def compute_top_k(self, batch: SequenceBatch, k: int):
        return self._rank0(self.workers["teacher"].compute_top_k(batch, k))

    def update(self, role: str, batch: SequenceBatch) -> Optional[dict]:
        return self._rank0(self.workers[role].update(batch))

    def update_on_policy(self, batch: SequenceBatch):
        return self._rank0(self.workers["actor"].update_on_policy(batch))

    def sft_step(self, batch: SequenceBatch, lr: float) -> Optional[dict]:
        return self._rank0(self.workers["actor"].sft_step(batch, lr))

    def export_lora(self, merged_dir: str, adapter_dir: str, base_model: str) -> Optional[str]:
        from rlmega.trainer.lora_export import export_lora

        return self._rank0(export_lora(self.workers["actor"], Path(merged_dir), Path(adapter_dir), base_model))

    def reference_from_actor(self) -> None:
        """Make the reference model the actor's current weights (after a supervised warm-start the
        warm-started model, not the initial checkpoint, is what the KL term should stay near). A LoRA actor's
        reference is its base model, so its adapters are folded into the base."""
        import torch

        if "ref" not in self.workers:  # a LoRA actor's reference is its base model: the adapters go into it
            self.workers["actor"].fold_adapters()
            return
        reference, actor = self.workers["ref"], self.workers["actor"]
        with reference._on_device(), torch.no_grad():
            for target, source in zip(_parameters(reference.chunks), _parameters(actor.chunks), strict=True):
                target.copy_(source)

    def connect_engines(self, engines: list) -> None:
        """The run's weight sync into ``engines`` (their handles), its transport chosen now, once (``sync``);
        it replaces the one before (engines restarted in place have new handles). Collective."""
        if self.weight_sync is not None:
            self.weight_sync.close()
        self.weight_sync = self._weight_sync_into(engines)

    def push_weights(self, version: int):
        """The actor's weights into the engines as ``version``: ``SyncStats`` on rank 0."""
        return self._rank0(self.weight_sync.push(version))

    def check_weights(self, probes: list[list[int]], version: int) -> Optional[float]:
        """The post-sync check on ``probes``: the largest log-prob difference, on rank 0."""
        return self._rank0(self.weight_sync.check(probes, version))

    def serve_replacement(self, engine, probes: Optional[list[list[int]]]) -> Optional[float]:
        """The weights of the last push into one engine restarted in place, through a weight sync of its own; with
        ``probes`` the post-sync check (its largest log-prob difference, on rank 0), then the version it serves.
        Collective."""
        from rlmega.sync import require_version

        version = self.weight_sync.pushed_version
        weight_sync = self._weight_sync_into([engine])
        try:
            weight_sync.push(version)
            difference = weight_sync.check(probes, version) if probes is not None else None
        finally:
            weight_sync.close()
        if self.rank == 0:
            require_version(engine, version)
        return self._rank0(difference)

    def _weight_sync_into(self, engines: list):
        from rlmega.sync import WeightSync
        from rlmega.sync.lora_adapters import AdapterSource

        actor = self.workers["actor"]
        adapters = AdapterSource(actor.config.lora, str(self.base_model), lambda: actor.base_folded) \
            if actor.config.lora.enabled else None
        return WeightSync.build(self.sync_config, actor.chunks, self.spec,
                                engines if self.rank == 0 else None, atol=self.post_sync_atol, sliced=self.sliced_setup,
                                weight_dtype=self.engine_weight_dtype, adapters=adapters)

    # ---- the job's state ------------------------------------------------------------------

    def set_offloaded(self, offloaded: bool) -> int:
        """Offload (or onload) the trained roles; the bytes moved on this rank."""
        moved = 0
        for worker in self.workers.values():
            if worker.config.trains and worker.offloaded != offloaded:
                moved += worker.offload() if offloaded else worker.onload()
        return moved

    def release_training_state(self) -> int:
        """Before the engines wake for a weight sync: the trained roles' gradient buffers freed and optimizer state
        in host memory (``MegatronWorker.release_training_state``); the device bytes freed on this rank."""
        return sum(worker.release_training_state() for worker in self.workers.values())

    def save(self, root: str, extra: dict, keep: Optional[int] = None) -> Optional[dict]:
        """Each trained role under ``root/<role>``; the actor last, so its tracker names a step whose
        critic checkpoint is complete too. With ``keep``, then only the newest ``keep`` of each role stay."""
        from rlmega.workers.checkpoint import rotate_checkpoints

        paths = {}
        for name in sorted(self.workers, key=lambda role: role == "actor"):
            if self._keeps_checkpoints(name):
                paths[name] = str(self.workers[name].save_checkpoint(Path(root) / name, extra, step=extra["step"]))
        if keep is not None and self.rank == 0:
            for name in paths:
                rotate_checkpoints(Path(root) / name, keep)
        return self._rank0(paths)

    def load(self, root: str, step: int) -> Optional[dict]:
        from rlmega.workers.checkpoint import iteration_dir

        extra = {}
        for name, worker in self.workers.items():
            if self._keeps_checkpoints(name):
                extra = worker.load_checkpoint(iteration_dir(Path(root) / name, step))
        return self._rank0(extra)

    def _keeps_checkpoints(self, name: str) -> bool:
        """The trained roles, and a warm-started reference; not the frozen models loaded from HF."""
        return self.workers[name].config.trains or (name == "ref" and self.reference_warm_started)

    def shutdown(self) -> None:
        import torch.distributed as dist

        from rlmega.parallel.layout import destroy

        if self.weight_sync is not None:
            self.weight_sync.close()
        destroy(including_default_group=dist.is_initialized())


def _parameters(chunks: list):
    for chunk in chunks:
        yield from chunk.parameters()


@dataclasses.dataclass(frozen=True)
class RankResources:
    """How many rank actors a group has, what each asks of Ray, and what they are called in errors."""

    world_size: int
    cpus_per_rank: float
    gpus_per_rank: float
    name: str

    @classmethod
    def of_policy(cls, config: RLConfig) -> RankResources:
        return cls(config.layout.world_size, config.cluster.cpus_per_rank, config.cluster.gpus_per_rank,
                   "training rank")

    @classmethod
    def of_frozen_model(cls, settings, name: str) -> RankResources:
        """A frozen model's ranks (``reward_model``, a teacher): ``settings.layout.world_size`` of them."""
        return cls(settings.layout.world_size, settings.cpus_per_rank, settings.gpus_per_rank, name)

    def bundles(self) -> list[dict]:
        """One placement-group bundle per rank."""
        return [{"CPU": self.cpus_per_rank, "GPU": self.gpus_per_rank}] * self.world_size


class RankCalls:
    """The job's calls on its ranks: ``each(RankProcess.method, *args)`` calls that method on every rank (answers in
    rank order), through ``_on_ranks``, which a group of ranks defines: ``TrainingRanks`` on Ray, ``InProcessRanks``
    in one process."""

    def each(self, method: Callable, *args, what: str, timeout_s: Optional[float] = None) -> list:
        """``method(rank, *args)`` on every rank's ``RankProcess`` (``method`` is the function itself, e.g.
        ``RankProcess.update``); all answers, in rank order."""
        return self._on_ranks(lambda rank: getattr(rank, method.__name__).remote(*args), what, timeout_s)

    def first(self, method: Callable, *args, what: str, timeout_s: Optional[float] = None) -> Any:
        """``each``, and rank 0's answer."""
        return self.each(method, *args, what=what, timeout_s=timeout_s)[0]

    def _on_ranks(self, call: Callable[[Any], Any], what: str, timeout_s: Optional[float] = None) -> list:
        """``call(rank_handle)`` (a ``.remote(...)`` call) on every rank; all answers, in rank order."""
        raise NotImplementedError

    def set_offloaded(self, offloaded: bool) -> None:
        self.each(RankProcess.set_offloaded, offloaded, what="offload" if offloaded else "onload")

    def release_training_state(self) -> None:
        self.each(RankProcess.release_training_state, what="releasing the training state")

    def save(self, root: str, extra: dict, keep: Optional[int] = None) -> dict:
        return self.first(RankProcess.save, root, extra, keep, what="save")

    def load(self, root: str, step: int) -> dict:
        return self.first(RankProcess.load, root, step, what="load")

    def shutdown(self) -> None:
        raise NotImplementedError


class TrainingRanks(RankCalls):
    """``resources.world_size`` rank actors placed in ``placement_group`` bundles 0..world_size-1, one
    world of their own; ``setup(rank, master)`` builds each rank's workers (a ``.remote`` call).
    ``placed(nodes)``, if given, runs once the ranks are placed and before they set up: ``nodes`` holds each
    rank's ``{"rank", "ip", "node_id", "gpus"}``."""

    def __init__(self, resources: RankResources, placement_group, timeout_s: float,
                 setup: Callable[[Any, tuple[str, int]], Any], run_dir: Optional[str] = None,
                 placed: Optional[Callable[[list[dict]], None]] = None):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlmega.trainer.worker_logs import actor_env

        self.timeout_s = timeout_s
        world_size = resources.world_size
        actor_class = ray.remote(RankProcess)
        self.names = [f"{resources.name} {rank}" for rank in range(world_size)]
        threads = str(max(1, int(resources.cpus_per_rank)))
        self.ranks = [
            actor_class.options(
                num_cpus=resources.cpus_per_rank, num_gpus=resources.gpus_per_rank,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=rank),
                runtime_env={"env_vars": {"OMP_NUM_THREADS": threads, **actor_env(run_dir, self.names[rank])}},
            ).remote(rank, world_size)
            for rank in range(world_size)
        ]
        try:
            addresses = self.each(RankProcess.address, what="address")
            self.nodes = [{"rank": rank, "ip": ip, "node_id": node, "gpus": gpus}
                          for rank, (ip, _, node, gpus) in enumerate(addresses)]
            if placed is not None:
                placed(self.nodes)
            master = addresses[0][:2]
            self._on_ranks(lambda rank: setup(rank, master), "setup", timeout_s=max(self.timeout_s, 600.0))
        except BaseException:
            self.shutdown()
            raise

    @classmethod
    def for_policy(cls, config: RLConfig, placement_group, total_steps: int,
                   placed: Optional[Callable[[list[dict]], None]] = None) -> TrainingRanks:
        """The policy's ranks (``layout``): actor, and reference and critic when needed."""
        return cls(RankResources.of_policy(config), placement_group, config.cluster.timeout_s,
                   lambda rank, master: rank.setup.remote(master, config, total_steps), config.run_dir, placed)

    @classmethod
    def for_frozen_model(cls, config: RLConfig, settings, name: str, placement_group) -> TrainingRanks:
        """A frozen model's ranks (``settings``: ``reward_model`` or a teacher; ``settings.layout``), a world of their
        own; ``name`` calls a rank in errors ("reward-model rank 1")."""
        return cls(RankResources.of_frozen_model(settings, name), placement_group, config.cluster.timeout_s,
                   lambda rank, master: rank.setup_frozen_model.remote(master, config, settings), config.run_dir)

    def _on_ranks(self, call: Callable[[Any], Any], what: str, timeout_s: Optional[float] = None) -> list:
        return wait_all([call(rank) for rank in self.ranks], self.names, timeout_s or self.timeout_s, what)

    def shutdown(self) -> None:
        import ray

        try:
            self.each(RankProcess.shutdown, what="shutdown", timeout_s=30.0)
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
        for rank in self.ranks:
            ray.kill(rank)
