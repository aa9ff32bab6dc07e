"""A run in one process (``cluster.in_process``): training rank 0 and the rollout engine live in the driver's
process, without Ray, as a single-process trainer does; ranks 1..N-1 of a tensor- (or otherwise) parallel layout
are the driver's child processes (``rlmega.trainer.local_ranks``).

A run on one machine with a colocated transformers engine has nothing to place, yet on Ray every step pays for
process boundaries: the generate call and its answers, the batch sent to each rank and the log-probs sent back,
the weight sync from rank 0's process into the engine's, the version check. On a small model those cost more
than the arithmetic (``benchmarks/peer_trl.py``). Here the same parts are called directly: ``InProcessRanks`` has
``TrainingRanks``' interface over rank 0's ``RankProcess`` object and the child ranks, so the role groups of
``rlmega.trainer.roles`` work unchanged, and ``InProcessEngines`` has ``RolloutGroup``'s over one engine object,
into which rank 0 syncs weights by the ``in_process`` transport.

Every call runs on the driver's own thread. A thread of their own would cost more than it keeps apart: torch's
OpenMP keeps a team of worker threads per calling thread, and once the teams hold more threads than the
machine has cores, every parallel region wakes its sleeping workers (measured: the step took 1.5-2x as long).
Rank 0 computes with ``rank_threads`` threads, the engine with ``in_process_threads`` (the child ranks are idle
while it generates). On a machine without CUDA rank 0's calls hold the CPU platform's redirect for Megatron
(``rlmega.parallel.cpu_platform.redirected``) and nothing else does: the engine's and the trainer's own torch
calls never need it and would pay for it on every op. What rank 0 and the engine print goes to the run's
``logs/workers/in-process.log``, as a worker process's would go to its log; an exception they raise becomes the
``WorkerFailure`` a worker's would.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from rlmega.config.schema import RLConfig
from rlmega.rollout.protocol import Generation, SamplingParams
from rlmega.trainer.remote import WorkerFailure
from rlmega.trainer.training_group import RankCalls, RankProcess
from rlmega.trainer.worker_logs import LOG_ENV, log_path, output_to

RANK_NAME = "training rank 0"
ENGINE_NAME = "rollout engine 0"


def runs_in_process(config: RLConfig) -> bool:
    """Whether the run's parts start in this process (``cluster.in_process``; ``always`` is checked at load)."""
    return config.cluster.in_process == "always" or (
        config.cluster.in_process == "auto" and not config.in_process_obstacles())


def rank_threads(config: RLConfig) -> int:
    """torch's threads for each training rank of a run in one process: alone, the rank computes only while the
    engine does not, and takes what both would hold on Ray (``in_process_threads``); with others, its own
    ``cluster.cpus_per_rank``, as they all compute at once."""
    if config.layout.world_size == 1:
        return in_process_threads(config)
    return max(1, int(config.cluster.cpus_per_rank))


def in_process_threads(config: RLConfig) -> int:
    """torch's threads in a run in one process: what the colocated rank and engine would hold together on Ray
    (``cluster.cpus_per_rank + rollout.cpus_per_engine``), since only one of them computes at a time, and no
    more than the machine has."""
    wanted = math.floor(config.cluster.cpus_per_rank + config.rollout.cpus_per_engine)
    return max(1, min(wanted, os.cpu_count() or 1))


@contextlib.contextmanager
def torch_threads(threads: int):
    """torch's thread count ``threads`` for the block (the engine generates with the cores the other ranks, idle
    meanwhile, hold while training), as it was afterwards."""
    import torch

    before = torch.get_num_threads()
    if before != threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if before != threads:
            torch.set_num_threads(before)


class WorkerOutput:
    """Where what the in-process rank and engine print goes: the run's ``logs/workers/in-process.log``."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(path, "a", buffering=1)  # line-buffered: current if the process dies

    @contextlib.contextmanager
    def of(self, name: str, what: str):
        """The block is ``name`` doing ``what``: its output into the log, its exception a ``WorkerFailure`` naming
        both (``rlmega train`` keeps the traceback in the run's logs)."""
        try:
            with output_to(self._log):
                yield
        except Exception as error:
            raise WorkerFailure(f"{what}: {name} raised {type(error).__name__}: {error}") from error

    def close(self) -> None:
        self._log.close()


class _Call:
    """A method called the way a Ray actor's is (``.remote(...)``); its result is the answer itself."""

    def __init__(self, method: Callable):
        self.remote = method


class _RankHandle:
    """The in-process ``RankProcess`` seen through an actor handle's interface (``rank.update.remote(...)``), which
    is how the role groups call every rank."""

    def __init__(self, process):
        self._process = process

    def __getattr__(self, name: str) -> _Call:
        return _Call(getattr(self._process, name))


class InProcessRanks(RankCalls):
    """``TrainingRanks``' interface over the training ranks of a run in one process: rank 0 in this process,
    ranks 1..N-1 (if any) as its child processes (``rlmega.trainer.local_ranks``)."""

    def __init__(self, config: RLConfig, output: WorkerOutput, total_steps: int):
        from rlmega.trainer.local_ranks import RankChild
        from rlmega.trainer.worker_logs import actor_env

        world = config.layout.world_size
        self.timeout_s = config.cluster.timeout_s
        self.names = [RANK_NAME] + [f"training rank {rank}" for rank in range(1, world)]
        self.nodes = [{"rank": rank, "ip": "127.0.0.1", "node_id": "in_process"} for rank in range(world)]
        self._output = output
        self._failed = False
        threads = rank_threads(config)
        self._children = [RankChild(rank, world, self.names[rank], actor_env(config.run_dir, self.names[rank])[LOG_ENV],
                                    threads, stays_here=(InProcessEngine,)) for rank in range(1, world)]
        try:
            self._process = RankProcess(0, world)
            self._handle = _RankHandle(self._process)
            master = ("127.0.0.1", self._process.listen("127.0.0.1"))
            self.each(RankProcess.setup, master, config, total_steps, threads, what="setup",
                      timeout_s=max(self.timeout_s, 600.0))
        except BaseException:
            self._stop_children(grace_s=0.0)
            raise

    def _on_ranks(self, call: Callable[[Any], Any], what: str, timeout_s: Optional[float] = None) -> list:
        """``call(rank_handle)`` on every rank: sent to the children first, then made on rank 0 here; the answers
        in rank order (``TrainingRanks.each``). A child's failure is reported before rank 0's, as its cause."""
        from rlmega.parallel.cpu_platform import redirected

        for child in self._children:
            call(child.handle)
        try:
            try:
                with self._output.of(RANK_NAME, what), redirected():
                    mine = call(self._handle)
            except WorkerFailure as failure:
                for child in self._children:
                    cause = child.failed(what)
                    if cause is not None:
                        raise cause from failure
                raise
            return [mine, *(child.answer(what, timeout_s or self.timeout_s) for child in self._children)]
        except WorkerFailure:
            self._failed = True  # a child may be left in a collective: shutdown does not wait long for it
            raise

    def shutdown(self) -> None:
        """Leave the process group; the children exit after it (one that fails to, or has died with the run's
        error, is stopped without a word: the error was reported); the log closes with it (the engines are shut
        down before)."""
        from rlmega.parallel.cpu_platform import redirected
        from rlmega.trainer.local_ranks import SHUTDOWN_GRACE_S

        try:
            for child in self._children:
                child.handle.shutdown.remote()
            with self._output.of(RANK_NAME, "shutdown"), redirected():
                self._handle.shutdown.remote()
        finally:
            self._stop_children(grace_s=1.0 if self._failed else SHUTDOWN_GRACE_S)
            self._output.close()

    def _stop_children(self, grace_s: float) -> None:
        for child in self._children:
            child.stop(grace_s)


class InProcessEngine:
    """``RolloutEngine`` over an engine object of this process whose calls never hold the CPU platform's redirect,
    also when a rank's call makes them (the weight sync's post-sync check)."""

    def __init__(self, engine, threads: int):
        self.engine = engine
        self.threads = threads

    def generate(self, prompts: list[list[int]], params: SamplingParams | Sequence[SamplingParams],
                 images=None) -> list[Generation]:
        from rlmega.parallel.cpu_platform import suspended

        extra = {} if images is None else {"images": images}
        with suspended(), torch_threads(self.threads):
            return self.engine.generate(prompts, params, **extra)

    def update_weights(self, named_tensors, version: int) -> None:
        # The in_process transport calls this on a receiving thread of its own (to copy a bucket in while the
        # rank exports the next), which never holds the redirect.
        self.engine.update_weights(named_tensors, version)

    def weight_version(self) -> int:
        return self.engine.weight_version()

    def sleep(self, level: int = 1) -> None:
        self.engine.sleep(level)

    def wake(self) -> None:
        self.engine.wake()

    def pause_generation(self) -> None:
        self.engine.pause_generation()

    def resume_generation(self) -> None:
        self.engine.resume_generation()

    def health(self) -> dict:
        return self.engine.health()


class InProcessEngines:
    """``RolloutGroup``'s interface over the one engine of a run in one process (``engines``: what the rank
    syncs weights into)."""

    restarts = None  # an engine in this process that dies takes the driver with it: nothing is left to restart it

    def __init__(self, config: RLConfig, output: WorkerOutput):
        from rlmega.trainer.rollout_group import _engine

        engine_class, arguments = _engine(config)
        if config.actor.router_replay == "r3":  # MoE routing replay: the engine records its experts
            arguments["record_routing"] = True
        self.names = [ENGINE_NAME]
        self.nodes = [{"engine": 0, "node_id": "in_process", "ip": "127.0.0.1"}]
        self._output = output
        with output.of(ENGINE_NAME, "starting engines"):
            self.engines = [InProcessEngine(engine_class(config.model.path, **arguments), in_process_threads(config))]

    @property
    def num_engines(self) -> int:
        return 1

    def generate(self, prompts: list[list[int]], params: SamplingParams, images=None) -> list[Generation]:
        with self._output.of(ENGINE_NAME, "generate"):
            return self.engines[0].generate(prompts, params, images)

    def handles(self) -> list:
        return list(self.engines)

    def version(self) -> int:
        return self.engines[0].weight_version()

    def sleep(self, level: int = 1) -> None:
        with self._output.of(ENGINE_NAME, "sleep"):
            self.engines[0].sleep(level)

    def wake(self) -> None:
        with self._output.of(ENGINE_NAME, "wake"):
            self.engines[0].wake()

    def check_alive(self) -> None:
        pass  # it lives as long as this process

    def shutdown(self) -> None:
        self.engines = []  # the model goes with its last reference


def start_in_process(config: RLConfig, *, with_rollout: bool = True):
    """(InProcessRanks, InProcessEngines or None, placement description) for a run in one process."""
    output = WorkerOutput(log_path(config.run_dir, "in-process"))
    try:
        ranks = InProcessRanks(config, output, total_steps=config.trainer.total_steps)
    except BaseException:
        output.close()
        raise
    try:
        engines = InProcessEngines(config, output) if with_rollout else None
    except BaseException:
        ranks.shutdown()
        raise
    placement = {"placement": "in_process", "training_ranks": ranks.nodes,
                 "engines": engines.nodes if engines is not None else []}
    return ranks, engines, placement
