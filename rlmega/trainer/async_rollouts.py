"""Fully asynchronous rollout (``rollout.mode=async``): the engines never wait for the trainer.

A producer thread on the controller keeps every engine busy with the prompt stream, one request at a
time per engine (of one step's prompts, the oldest waiting), and collects whole groups (all n responses of a prompt, scored) into a buffer; the
trainer takes ``prompts_per_step`` groups as soon as the buffer has them. Around a weight sync the
producer is paused: in-flight requests are interrupted (``pause_generation``), the partial responses
are kept, and after the sync they are continued with the new weights (``rollout.partial_rollout``),
so every token records the weight version that produced it.

Staleness, with ``s = rollout.max_staleness`` and ``v`` the version being updated from:
- admission (AReaL's rule): no more than ``(v + s + 1) * prompts_per_step`` groups are handed to the
  engines (minus the dropped), so in the steady state a group is at most ``s`` versions old when taken;
- the hard bound, checked when the trainer takes a batch: a group whose oldest token is more than
  ``s`` versions behind ``v`` is generated again or dropped (``rollout.stale_groups``), and counted.

Through the gateway (``gateway.enabled``), each response is a harness session that runs on its own
(``HarnessLoop.start_session``): the engine calls it makes are the work handed to the engines, each
interrupted, continued or restarted as any response is, and its reply goes back to the harness; a group
is whole once all its sessions ended. Calls that arrive during a weight sync wait for it.

Prompts are numbered in the order drawn; the checkpoint records which were consumed (trained on, or
dropped by dynamic sampling or staleness), so a resumed run generates the others again: none is lost,
none trained twice.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent import futures
from typing import TYPE_CHECKING, Optional

import torch

from rlmega import algos
from rlmega.agent.loop import AgentState
from rlmega.data.schema import PromptRecord
from rlmega.errors import UserError
from rlmega.gateway.harness import HarnessLoop
from rlmega.gateway.live_sessions import LiveSession
from rlmega.rollout.protocol import Generation, SamplingParams
from rlmega.trainer.batch_assembly import BatchAssembler, Group, Rollouts
from rlmega.trainer.generation import ResponseGenerator
from rlmega.trainer.prompt_data import PromptData
from rlmega.trainer.remote import WorkerFailure, failure_of
from rlmega.trainer.scoring import Scorer, dynamic_sampling_values, generation_metrics

if TYPE_CHECKING:  # the schedules build this one: a type only, no import at run time
    from rlmega.trainer.schedules import ScheduleConfig

_POLL_S = 0.05
MAX_EMPTY_ABORTS = 32
"""Aborts in a row that brought a response no token before it is given up (the run stops, naming the engine): a
pause aborts each response in flight at most once per weight sync, so more means the engine keeps refusing it."""


@dataclasses.dataclass
class _Response:
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finish: Optional[str] = None
    segments: int = 0  # engine requests it took (more than one when interrupted)
    empty_aborts: int = 0  # its last requests in a row that came back "abort" without a token
    agent: Optional[AgentState | LiveSession] = None
    """A multi-turn trajectory (``agent.enabled``): ``tokens``, ``logprobs`` and ``versions`` then hold the turn
    being generated, ``agent.trajectory`` the turns, tool outputs and glue before it. Through the gateway, the
    harness's session: they hold the reply to its waiting call."""
    trajectory_versions: list[int] = dataclasses.field(default_factory=list)
    """With ``agent``: the weight version of each of the trajectory's tokens (glue: its turn's last)."""

    @property
    def all_versions(self) -> list[int]:
        return self.trajectory_versions if self.agent is not None else self.versions


@dataclasses.dataclass
class _Group:
    draw: int
    """Position in the prompt stream: ``batch * prompts_per_step + offset``."""
    record: PromptRecord
    responses: list[_Response]
    attempt: int = 0  # generated again after going stale

    def oldest_version(self) -> int:
        return min(min(r.all_versions) for r in self.responses if r.all_versions)


@dataclasses.dataclass
class _Done:
    group: _Group
    generations: list[Generation]
    scores: torch.Tensor


class AsyncRollouts:
    """``RolloutSchedule`` of the asynchronous mode: prompts from ``data``, responses from ``generator``, scores
    from ``scorer``, batches from ``assembler``; ``engines`` is a ``RolloutGroup`` (``submit``,
    ``pause_generation``, ``resume_generation``, ``num_engines``) or a fake with the same methods."""

    def __init__(self, config: ScheduleConfig, data: PromptData, generator: ResponseGenerator, scorer: Scorer,
                 assembler: BatchAssembler, engines):
        self.config, self.engines = config, engines
        self.data, self.generator, self.scorer, self.assembler = data, generator, scorer, assembler
        self.restarts = engines.restarts
        """``rollout.restart_dead_engines`` (``RolloutGroup.restarts``): None, a dead engine stops the run."""
        self.agent = generator.agent
        self.harness = self.agent if isinstance(self.agent, HarnessLoop) else None
        """Through the gateway: the sessions' calls are the responses' turns."""
        self.per_step = config.prompts_per_step
        self.staleness = config.max_staleness
        self.timeout_s = config.timeout_s
        self._lock = threading.Condition()
        self._version = 0
        self._paused = True  # until the first resume (after the first weight sync)
        self._stopping = False
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        # The prompt stream.
        self._next_batch = 0
        self._batch_states: dict[int, dict] = {}  # sampler state before each drawn batch not yet consumed
        self._drawn: list[tuple[int, int]] = []  # (draw id, dataset index) drawn, not yet admitted
        self._consumed: set[int] = set()
        self._trained_groups = 0
        self._live = 0  # groups handed to the engines and not dropped (trained ones included)
        # Work.
        self._pending: list[tuple[_Group, int]] = []  # responses waiting for an engine
        self._in_flight: dict[futures.Future, tuple[int, list[tuple[_Group, int]], float]] = {}
        self._buffer: list[_Done] = []
        self._equal_streak = 0  # groups in a row that dynamic sampling dropped
        self._window = _Window(engines.num_engines)

    # ---- the trainer's side ------------------------------------------------------------------

    def take(self, step: int) -> Rollouts:
        """``prompts_per_step`` whole groups within the staleness bound, oldest first; waits for them."""
        waited_since = time.perf_counter()
        with self._lock:
            while True:
                self._raise_error()
                usable = self._sort_out_stale()
                if len(usable) >= self.per_step:
                    break
                if self.restarts is not None and self.engines.unserved:
                    self._lock.release()  # the training ranks are idle: a restarted engine gets their weights now
                    try:
                        self.engines.rejoin()
                    finally:
                        self._lock.acquire()
                    continue
                if self._equal_streak > self.config.max_generation_rounds * self.per_step:
                    raise RuntimeError(
                        f"step {step}: {self._equal_streak} prompt groups in a row had an equal "
                        f"{self.config.dynamic_sampling_metric}, "
                        "nothing to train on; raise rollout.n or turn off algorithm.dynamic_sampling")
                if time.perf_counter() - waited_since > self.timeout_s:
                    raise RuntimeError(f"step {step}: the engines produced {len(usable)} of {self.per_step} groups "
                                       f"in cluster.timeout_s={self.timeout_s:g} s")
                self._lock.wait(timeout=1.0)
            taken = sorted(usable, key=lambda done: done.group.oldest_version())[:self.per_step]
            occupancy = len(self._buffer) / max(1, (self.staleness + 1) * self.per_step)
            for done in taken:
                self._buffer.remove(done)
                self._consumed.add(done.group.draw)
            self._trained_groups += len(taken)
            self._prune()
            metrics = self._window.metrics(self._version, taken, self._busy_engines())
            self._lock.notify_all()  # room for more prompts
        metrics["async/buffer_occupancy"] = occupancy
        metrics["async/trainer_wait_s"] = time.perf_counter() - waited_since
        groups = [Group(done.group.record, done.generations, done.scores,
                        token_versions=[torch.tensor(r.all_versions, dtype=torch.long) for r in done.group.responses])
                  for done in taken]
        return self.assembler.assemble(groups, metrics)

    def pause(self) -> None:
        """Stop handing out work, interrupt what is in flight and wait until the engines are idle."""
        if self._thread is None:
            return
        with self._lock:
            self._paused = True
            self._lock.notify_all()
        dead = self.engines.pause_generation() or {}  # engines that died: only with restarts
        try:
            with self._lock:
                deadline = time.perf_counter() + self.timeout_s
                while self._in_flight and self._error is None:
                    if time.perf_counter() > deadline:
                        raise RuntimeError(f"interrupted engine requests did not return in {self.timeout_s:g} s")
                    self._lock.wait(timeout=1.0)
                self._raise_error()
            for engine, failure in dead.items():  # replaced already if it died in a request; else it died idle
                self.engines.replace(engine, failure)
        finally:
            self.engines.resume_generation()  # the producer is paused: nothing new reaches them

    def resume(self, version: int) -> None:
        """The engines now serve ``version``: continue (or restart) the interrupted responses."""
        if self.restarts is not None:
            self.engines.rejoin()  # engines restarted since the last sync: checked before they get requests
        with self._lock:
            self._version = version
            self._paused = False
            self._lock.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rlmega-async-rollout", daemon=True)
            self._thread.start()

    def state_dict(self) -> dict:
        with self._lock:
            watermark = self._watermark()
            return {**self.data.state_dict(), "async": {
                "batch": watermark,
                "sampler": self._batch_states.get(watermark, self.data.sampler.state_dict()),
                "consumed": sorted(d for d in self._consumed if d >= watermark * self.per_step),
                "trained_groups": self._trained_groups,
            }}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("async")
        if saved is None:  # a checkpoint of a synchronous run: carry on from its prompt position
            self.data.load_state_dict(state)
            self._trained_groups = self._live = int(state.get("step", 0)) * self.per_step
            return
        self.data.sampler.load_state_dict(saved["sampler"])
        self._next_batch = saved["batch"]
        self._consumed = set(saved["consumed"])
        self._trained_groups = self._live = saved["trained_groups"]

    def close(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            try:
                self.engines.pause_generation()
            except Exception:  # noqa: BLE001 - closing after an engine failure
                pass
            self._thread.join(timeout=60)

    # ---- the producer thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._stopping:
                        return
                    if not self._paused:
                        self._admit()
                        self._dispatch()
                    if not self._in_flight:
                        self._lock.wait(timeout=1.0)  # take, resume and close notify
                        continue
                    waiting = dict(self._in_flight)
                done, _ = futures.wait(list(waiting), timeout=_POLL_S, return_when=futures.FIRST_COMPLETED)
                for future in done:
                    try:
                        generations = future.result()
                    except Exception as error:
                        if self.restarts is None:
                            raise RuntimeError(f"rollout engine {waiting[future][0]}: {error}") from error
                        self._resubmit(future, error)
                        continue
                    with self._lock:
                        turns = self._collect(future, generations)
                        self._lock.notify_all()
                    if turns:
                        (self._advance if self.harness is None else self._answer)(turns)
        except BaseException as error:  # noqa: BLE001 - handed to the trainer's thread
            with self._lock:
                self._error = error
                self._in_flight.clear()
                self._lock.notify_all()

    def _resubmit(self, future: futures.Future, error: Exception) -> None:
        """The engine of a request that failed died: a new one starts in its place (``RolloutGroup.replace``; the
        request stays in flight meanwhile, so a pause waits for it), and the request's responses wait for an engine
        again, with the seeds they had. Raises what the engine raised if it did not die, or when its restarts are
        spent."""
        if self._stopping:
            return  # the run is ending: nothing more will be asked of the engines
        engine = self._in_flight[future][0]
        failure = failure_of(error, self.engines.names[engine], "generate")
        if not self.engines.replace(engine, failure):
            raise failure from error
        with self._lock:
            _, work, started = self._in_flight.pop(future)
            self._window.engine_busy(engine, started, time.perf_counter())
            self._pending.extend(work)
            self.restarts.resubmitted(len(work))
            self._lock.notify_all()

    def _admit(self) -> None:
        """New groups while the staleness rule allows (the lock is held)."""
        limit = (self._version + self.staleness + 1) * self.per_step
        while self._live < limit:
            draw, index = self._draw()
            record = self.data.dataset.batch([index])[0]
            self._start(_Group(draw, record, self._responses(record, self.config.n)))
            self._live += 1

    def _draw(self) -> tuple[int, int]:
        while not self._drawn:
            batch = self._next_batch
            self._batch_states[batch] = self.data.sampler.state_dict()
            indices = self.data.sampler.next_batch()
            self._drawn = [(batch * self.per_step + offset, index) for offset, index in enumerate(indices)
                           if batch * self.per_step + offset not in self._consumed]
            self._next_batch += 1
        return self._drawn.pop(0)

    def _dispatch(self) -> None:
        """The pending responses of the oldest step's prompts to the idle engines, shared evenly (the lock
        is held). One step's at a time: a request returns when its slowest response is done, so responses of
        later steps in the same request would hold up the batch the trainer waits for (after a sync, the
        interrupted tails of the next batch would wait for the whole batch after it)."""
        busy = {engine for engine, _, _ in self._in_flight.values()}
        if self.restarts is not None:
            busy |= self.engines.unserved  # replacements, until they have the current weights
        idle = [engine for engine in range(self.engines.num_engines) if engine not in busy]
        if not idle or not self._pending:
            return
        self._pending.sort(key=lambda item: item[0].draw)  # stable: a group's responses stay in order
        for position, engine in enumerate(idle):
            if not self._pending:
                break
            step = self._pending[0][0].draw // self.per_step
            oldest = next((i for i, (group, _) in enumerate(self._pending) if group.draw // self.per_step != step),
                          len(self._pending))
            share = -(-oldest // (len(idle) - position))
            work, self._pending = self._pending[:share], self._pending[share:]
            prompts, params, images = [], [], []
            for group, sample in work:
                response = group.responses[sample]
                start = group.record.prompt_token_ids if response.agent is None else self.agent.context(response.agent)
                prompts.append(start + response.tokens)
                params.append(self._params(group, sample, response))
                images.append(group.record.images)
            extra = {"images": images} if any(item is not None for item in images) else {}
            future = _as_future(self.engines.submit(engine, prompts, params, **extra))
            self._in_flight[future] = (engine, work, time.perf_counter())

    def _params(self, group: _Group, sample: int, response: _Response) -> SamplingParams:
        params = self.generator.request_params(group.draw, sample, response.segments + 64 * group.attempt,
                                               len(response.tokens))
        if self.harness is None:
            return params
        asked = self.harness.max_new_tokens(response.agent) - len(response.tokens)
        return dataclasses.replace(params, max_new_tokens=max(1, min(params.max_new_tokens, asked)))

    def _responses(self, record: PromptRecord, count: int) -> list[_Response]:
        if self.agent is None or self.harness is not None:  # a harness's sessions start with ``_start``
            return [_Response() for _ in range(count)]
        return [_Response(agent=self.agent.start(0, record)) for _ in range(count)]

    def _start(self, group: _Group) -> None:
        """A new group's responses wait for an engine; through the gateway, its sessions start, and each call they
        make waits for one as it comes (the lock is held)."""
        if self.harness is None:
            self._pending.extend((group, sample) for sample in range(len(group.responses)))
            return
        for sample, response in enumerate(group.responses):
            response.agent = self.harness.start_session(group.record, sample,
                                                        lambda session, sample=sample: self._ready(group, sample))

    def _ready(self, group: _Group, sample: int) -> None:
        """A session's call waits for an engine, or the session ended (on the harness's thread)."""
        with self._lock:
            try:
                session = group.responses[sample].agent
                if not session.done:
                    self._pending.append((group, sample))
                else:
                    self._pending = [(g, s) for g, s in self._pending if g is not group or s != sample]
                    group.responses[sample].trajectory_versions = session.token_versions(self._version)
                    # Whole once every session's end was taken in here (two may end at once: one completes it).
                    if all(r.trajectory_versions for r in group.responses):
                        self._complete(group)
            except BaseException as error:  # noqa: BLE001 - handed to the trainer's thread
                self._error = error
            self._lock.notify_all()

    def _collect(self, future: futures.Future, generations: list[Generation]) -> list[tuple[_Group, int]]:
        """One engine request's answers (the lock is held); the agent trajectories whose turn ended, for
        ``_advance``."""
        engine, work, started = self._in_flight.pop(future)
        self._window.engine_busy(engine, started, time.perf_counter())
        completed, turns = [], []
        for generation in generations:
            group, sample = work[generation.prompt_index]
            response = group.responses[sample]
            response.segments += 1
            self._window.generated_tokens += len(generation.response_token_ids)
            if generation.finish_reason == "abort" and self.config.partial_rollout == "restart":
                self._window.restarted += 1
                # A trajectory restarts its turn: the turns before it are whole.
                group.responses[sample] = response = _Response(segments=response.segments, agent=response.agent,
                                                               trajectory_versions=response.trajectory_versions,
                                                               empty_aborts=response.empty_aborts)
            else:
                response.tokens += generation.response_token_ids
                response.logprobs += generation.logprobs
                response.versions += [generation.weight_version] * len(generation.response_token_ids)
            if generation.finish_reason == "abort":
                self._window.interrupted += 1
                response.empty_aborts = 0 if generation.response_token_ids else response.empty_aborts + 1
                if response.empty_aborts > MAX_EMPTY_ABORTS:
                    raise RuntimeError(f"rollout engine {engine} aborted a response {response.empty_aborts} times in a "
                                       "row without generating a token; it keeps refusing the request (see the "
                                       "engine's log)")
                self._pending.append((group, sample))
                continue
            if response.agent is not None:
                response.finish = generation.finish_reason
                turns.append((group, sample))
                continue
            response.finish = generation.finish_reason
            if all(r.finish is not None for r in group.responses) and group not in completed:
                completed.append(group)
        for group in completed:
            self._complete(group)
        return turns

    def _advance(self, turns: list[tuple[_Group, int]]) -> None:
        """The agent's side of the turns that ended: tool calls run (outside the lock, all together), their
        outputs appended; a trajectory that goes on waits for an engine again, one that ended may complete
        its group."""
        advanced = []
        for group, sample in turns:
            response = group.responses[sample]
            trajectory = response.agent.trajectory
            turn = Generation(prompt_index=0, response_token_ids=response.tokens, logprobs=response.logprobs,
                              finish_reason=response.finish, weight_version=min(response.versions, default=0))
            advanced.append((response, turn, len(trajectory.response_token_ids)))
        self.agent.advance([(response.agent, turn) for response, turn, _ in advanced])
        with self._lock:
            completed = []
            for (group, sample), (response, _, before) in zip(turns, advanced):
                added = len(response.agent.trajectory.response_token_ids) - before
                last = response.versions[-1] if response.versions else self._version
                response.trajectory_versions += (response.versions + [last] * added)[:added]
                response.tokens, response.logprobs, response.versions = [], [], []
                if response.agent.done:
                    if all(r.agent.done for r in group.responses) and group not in completed:
                        completed.append(group)
                else:
                    response.finish = None
                    self._pending.append((group, sample))
            for group in completed:
                self._complete(group)
            self._lock.notify_all()

    def _answer(self, turns: list[tuple[_Group, int]]) -> None:
        """The sessions' calls that ended: each reply goes back to its harness, with every token's weight version;
        the session's next call, or its end, comes through ``_ready``."""
        with self._lock:
            for group, sample in turns:
                response = group.responses[sample]
                reply = Generation(prompt_index=0, response_token_ids=response.tokens, logprobs=response.logprobs,
                                   finish_reason=response.finish, weight_version=min(response.versions, default=0))
                self.harness.answer(response.agent, reply, response.versions)
                response.tokens, response.logprobs, response.versions, response.finish = [], [], [], None

    def _complete(self, group: _Group) -> None:
        """Score a whole group; keep it, or drop it when dynamic sampling finds its scores all equal."""
        generations = [self._generation(r) for r in group.responses]
        scored = self.scorer.score_responses([group.record], generations)
        raw, reward_metrics = scored.raw, scored.metrics
        scores = self.scorer.shape_scores(raw, generations)
        self._window.scored(raw, generations, reward_metrics)
        if self.config.dynamic_sampling:
            metric = dynamic_sampling_values(self.config.dynamic_sampling_metric, scored, scores, [group.record],
                                             generations)
            kept = algos.dynamic_sampling_filter(torch.zeros(len(generations), dtype=torch.long), metric)
            if kept.num_dropped_groups:
                self._window.dropped_groups += 1
                self._equal_streak += 1
                self._drop(group)
                return
        self._equal_streak = 0
        self._buffer.append(_Done(group, generations, scores))

    @staticmethod
    def _generation(response: _Response) -> Generation:
        if response.agent is not None:  # the trajectory, its prompt the one rendered with the tools
            trajectory = response.agent.trajectory
            trajectory.weight_version = min(response.trajectory_versions, default=0)
            return trajectory
        return Generation(prompt_index=0, response_token_ids=response.tokens, logprobs=response.logprobs,
                          finish_reason=response.finish, weight_version=min(response.versions, default=0))

    def _sort_out_stale(self) -> list[_Done]:
        """Groups within the bound; the others regenerated or dropped (the lock is held)."""
        usable = []
        for done in list(self._buffer):
            if self._version - done.group.oldest_version() <= self.staleness:
                usable.append(done)
                continue
            self._buffer.remove(done)
            if self.config.stale_groups == "drop":
                self._window.stale_dropped += 1
                self._drop(done.group)
            else:
                self._window.stale_regenerated += 1
                self._start(_Group(done.group.draw, done.group.record,
                                   self._responses(done.group.record, len(done.group.responses)),
                                   attempt=done.group.attempt + 1))
        return usable

    def _drop(self, group: _Group) -> None:
        self._consumed.add(group.draw)
        self._live -= 1

    def _watermark(self) -> int:
        """The first drawn batch with a prompt not yet consumed."""
        batch = min(self._batch_states, default=self._next_batch)
        while batch < self._next_batch and all(batch * self.per_step + offset in self._consumed
                                               for offset in range(self.per_step)):
            batch += 1
        return batch

    def _prune(self) -> None:
        watermark = self._watermark()
        for batch in [b for b in self._batch_states if b < watermark]:
            del self._batch_states[batch]
        self._consumed = {d for d in self._consumed if d >= watermark * self.per_step}

    def _busy_engines(self) -> dict[int, float]:
        return {engine: started for engine, _, started in self._in_flight.values()}

    def _raise_error(self) -> None:
        if self._error is not None:
            if isinstance(self._error, UserError):  # bad input (a setting the rewards cannot serve): the user's to fix
                raise UserError(str(self._error)) from self._error
            kind = WorkerFailure if isinstance(self._error, WorkerFailure) else RuntimeError
            raise kind(f"asynchronous rollout stopped: {self._error}") from self._error


class _Window:
    """What happened between two batches: the step's generation metrics."""

    def __init__(self, num_engines: int):
        self.num_engines = num_engines
        self.since = time.perf_counter()
        self.busy_s: dict[int, float] = {}
        self._reset()

    def _reset(self) -> None:
        self.generated_tokens = 0
        self.interrupted = self.restarted = self.stale_dropped = self.stale_regenerated = self.dropped_groups = 0
        self.scores: list[torch.Tensor] = []
        self.generations: list[Generation] = []
        self.reward_metrics: dict[str, float] = {}

    def engine_busy(self, engine: int, started: float, ended: float) -> None:
        self.busy_s[engine] = self.busy_s.get(engine, 0.0) + ended - max(started, self.since)

    def scored(self, scores: torch.Tensor, generations: list[Generation], reward_metrics: dict) -> None:
        self.scores.append(scores)
        self.generations.extend(generations)
        self.reward_metrics = reward_metrics

    def metrics(self, version: int, taken: list[_Done], running: dict[int, float]) -> dict[str, float]:
        now = time.perf_counter()
        wall = max(now - self.since, 1e-9)
        busy = sum(self.busy_s.values()) + sum(now - max(started, self.since) for started in running.values())
        staleness = [version - min(r.all_versions) for done in taken for r in done.group.responses]
        token_staleness = [version - v for done in taken for r in done.group.responses for v in r.all_versions]
        mixed = [len(set(r.all_versions)) > 1 for done in taken for r in done.group.responses]
        scores = torch.cat(self.scores) if self.scores else torch.cat([done.scores for done in taken])
        generations = self.generations or [g for done in taken for g in done.generations]
        metrics = generation_metrics(scores, generations, self.reward_metrics)
        metrics.update({
            "async/staleness_mean": sum(staleness) / len(staleness),
            "async/staleness_max": float(max(staleness)),
            "async/token_staleness_mean": sum(token_staleness) / max(1, len(token_staleness)),
            "async/mixed_version_fraction": sum(mixed) / len(mixed),
            "async/interrupted_requests": float(self.interrupted),
            "async/restarted_responses": float(self.restarted),
            "async/stale_dropped": float(self.stale_dropped),
            "async/stale_regenerated": float(self.stale_regenerated),
            "async/engine_idle_fraction": min(1.0, max(0.0, 1.0 - busy / (wall * self.num_engines))),
            "perf/generation_tokens_per_s": self.generated_tokens / wall,
            "batch/dropped_groups": float(self.dropped_groups),
        })
        self.since, self.busy_s = now, {}
        self._reset()
        return metrics


def _as_future(submitted) -> futures.Future:
    """A Ray ObjectRef or a Future, as a Future."""
    return submitted if isinstance(submitted, futures.Future) else submitted.future()
