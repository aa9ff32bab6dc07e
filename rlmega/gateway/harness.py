"""Rollouts made by an agent harness through the gateway: the run's ``gateway:`` section at work.

For each prompt record and each of its ``n`` samples the loop opens a session, calls the user's harness with the
session's ``base_url`` and the example (on a thread; at most ``max_concurrent_sessions`` at once), and turns what the
session recorded into a ``Trajectory`` as the agent loop makes them: the first segment's prompt, its response ids,
the mask over the policy's tokens, the engine's log-probs. The harness's own reward (returned, or posted to
``/v1/sessions/{id}/reward``) is added to the reward manager's score (``env_reward``).

The harness's engine calls run with the run's sampling parameters (its temperature and top-p; ``max_tokens`` at most
``rollout.max_new_tokens``), batched: calls that arrive together go to the engines as one request. The order in
which an external harness calls is its own, so a run through the gateway does not repeat sample for sample.

A session whose harness raised or ran past ``session_timeout_s`` is lost: its trajectory is the prompt and one masked
stop token, nothing to train on, and ``gateway/lost_sessions`` counts it; so is a session with no call. Segments
after a session's first (a harness that rewrote its history) are counted (``gateway/extra_segments``), not trained
on.

In ``rollout.mode=async`` the sessions run continuously instead (``start_session``, ``rlmega.gateway.live_sessions``):
each call waits for the run's asynchronous driver, which serves it with the engines' current weights, continues
or restarts it across a weight update, and takes a prompt's group once its sessions ended.

``demonstrate`` makes the supervised warm-start's trajectories (``gateway.demonstration``) the same way, with an
engine that answers with the demonstrated turns (``rlmega.gateway.demonstration``).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Optional, Sequence

from rlmega.agent.functions import load_callable
from rlmega.agent.loop import Trajectory
from rlmega.agent.parsers import load_parser
from rlmega.errors import UserError
from rlmega.gateway.config import GatewayConfig
from rlmega.gateway.demonstration import DemonstrationEngine
from rlmega.gateway.live_sessions import LiveSession
from rlmega.gateway.server import Gateway
from rlmega.gateway.sessions import SessionStore
from rlmega.rollout.protocol import Generation, SamplingParams


class _Batcher:
    """Engine calls from many sessions' threads, sent to the engines together: whatever is waiting when the engines
    are free goes as one request (per set of sampling parameters)."""

    def __init__(self):
        self.generator = None
        self._queue: "queue.Queue[tuple[list[int], SamplingParams, Future]]" = queue.Queue()
        self._requests = 0
        threading.Thread(target=self._serve, name="rlmega-gateway-batcher", daemon=True).start()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        futures = []
        for prompt in prompts:
            futures.append(Future())
            self._queue.put((prompt, params, futures[-1]))
        return [dataclasses.replace(future.result(), prompt_index=index) for index, future in enumerate(futures)]

    def _serve(self) -> None:
        while True:
            waiting = [self._queue.get()]
            while not self._queue.empty():
                waiting.append(self._queue.get_nowait())
            groups: dict = {}
            for item in waiting:
                groups.setdefault(item[1], []).append(item)
            for params, items in groups.items():
                self._requests += 1
                seeded = params if params.seed is None else dataclasses.replace(
                    params, seed=(params.seed + 104_729 * self._requests) % 2**31)  # no two requests alike
                try:
                    generations = self.generator.generate([prompt for prompt, _, _ in items], seeded)
                    for (_, _, future), generation in zip(items, sorted(generations, key=lambda g: g.prompt_index)):
                        future.set_result(generation)
                except BaseException as error:  # noqa: BLE001 - every waiting call gets the engines' error
                    for _, _, future in items:
                        future.set_exception(error)


def example_of(record, sample: int) -> dict[str, Any]:
    """What the harness gets of a prompt record, for its ``sample``-th trajectory of the record."""
    return {"messages": record.messages, "ground_truth": record.ground_truth, "data_source": record.data_source,
            "extra_info": getattr(record, "extra_info", None), "index": record.index, "sample": sample}


@dataclasses.dataclass
class SessionTrajectory(Trajectory):
    """A trajectory made through the gateway, with what its session lost."""

    lost: bool = False
    """The harness raised, ran past ``session_timeout_s`` or made no call: nothing to train on."""
    extra_segments: int = 0
    """Segments after the first (not trained on)."""


def gateway_metrics(trajectories: Sequence[SessionTrajectory]) -> dict[str, float]:
    """``gateway/...`` metrics of a step's trajectories."""
    count = max(len(trajectories), 1)
    return {"gateway/lost_sessions": float(sum(t.lost for t in trajectories)),
            "gateway/lost_session_fraction": sum(t.lost for t in trajectories) / count,
            "gateway/extra_segments": float(sum(t.extra_segments for t in trajectories)),
            "gateway/calls_mean": sum(t.num_turns for t in trajectories) / count}


class HarnessLoop:
    """``run(generator, records, params)`` like ``AgentLoop.run``: ``params.n`` trajectories per record;
    ``demonstrate(records, turns)`` like ``AgentLoop.demonstrate``; ``start_session`` for an asynchronous run."""

    def __init__(self, config: GatewayConfig, tokenizer: Any, *, stop_token_ids: Sequence[int]):
        self.config, self.tokenizer = config, tokenizer
        self.stop_token_ids = tuple(stop_token_ids)
        self.harness = load_callable(config.harness)
        self.store = SessionStore(opened_only=True)
        self._batcher = _Batcher()
        self._params: Optional[SamplingParams] = None
        self.gateway: Optional[Gateway] = None
        self._live: dict[str, LiveSession] = {}
        self._live_pool: Optional[ThreadPoolExecutor] = None
        self._ending = threading.Lock()  # a session ends once: by its harness or by its timeout

    def _params_for(self, session_id: str, asked: SamplingParams) -> SamplingParams:
        if session_id in self._live:
            return asked  # the asynchronous driver samples with the run's settings within the asked max_tokens
        run = self._params
        return dataclasses.replace(run, n=1, max_new_tokens=min(asked.max_new_tokens, run.max_new_tokens))

    def run(self, generator, records: Sequence, params: SamplingParams) -> list[Trajectory]:
        sessions, futures = self._play(generator, records, params)
        return [self._finished(index, session_id, record, future)
                for index, ((session_id, record, _), future) in enumerate(zip(sessions, futures))]

    def demonstrate(self, records: Sequence, turns: Sequence[Sequence[str]]) -> list[Trajectory]:
        """One trajectory per record, made by the harness through the gateway with an engine that answers with the
        given turn texts instead of sampling (``DemonstrationEngine``): a supervised warm-start's demonstrations,
        in exactly the format of the run's trajectories. UserError when the harness fails on one."""
        engine = DemonstrationEngine(self.tokenizer, self.stop_token_ids)
        for record, texts in zip(records, turns):
            engine.add(record.prompt_token_ids, texts)
        # The engine writes the turns whatever the token budget; the harness's own max_tokens stays as asked.
        params = SamplingParams(max_new_tokens=1 << 16, stop_token_ids=self.stop_token_ids, n=1)
        sessions, futures = self._play(engine, records, params)
        trajectories = [self._finished(index, session_id, record, future)
                        for index, ((session_id, record, _), future) in enumerate(zip(sessions, futures))]
        for (_, record, _), future in zip(sessions, futures):
            error = future.exception() if future.done() and not future.cancelled() else \
                f"it ran past gateway.session_timeout_s ({self.config.session_timeout_s:g} s)"
            if error is not None:
                raise UserError(f"gateway.demonstration: the harness failed on the demonstration of row "
                                f"{record.index}: {error}")
        return trajectories

    def _play(self, generator, records: Sequence, params: SamplingParams) -> tuple[list, list[Future]]:
        """The harness on ``params.n`` sessions per record, against ``generator``; the sessions and the harness
        calls' futures, once all are done or ``session_timeout_s`` has passed."""
        self._batcher.generator, self._params = generator, params
        self._serve()
        batch = uuid.uuid4().hex[:8]
        sessions = [(f"{batch}-{index}-{sample}", record, sample) for index, record in enumerate(records)
                    for sample in range(params.n)]
        for session_id, _, _ in sessions:
            self.store.open(session_id)
        pool = ThreadPoolExecutor(self.config.max_concurrent_sessions, thread_name_prefix="rlmega-harness")
        futures = [pool.submit(self.harness, self.gateway.session_url(session_id), example_of(record, sample))
                   for session_id, record, sample in sessions]
        wait(futures, timeout=self.config.session_timeout_s)
        pool.shutdown(wait=False, cancel_futures=True)
        return sessions, futures

    def _serve(self) -> Gateway:
        if self.gateway is None:
            config = self.config
            self.gateway = Gateway(self._batcher.generate, self.tokenizer, host=config.host, port=config.port,
                                   token=config.token, stop_token_ids=self.stop_token_ids, store=self.store,
                                   parser=load_parser(self.config.parser), params_for=self._params_for,
                                   session_generate=self._engine_call, timeout_s=config.session_timeout_s,
                                   # An asynchronous run's sessions may all hold a call waiting for a weight sync
                                   # while validation's sessions (as many again) call.
                                   max_concurrent_calls=2 * config.max_concurrent_sessions).serve()
        return self.gateway

    def _engine_call(self, session_id: str, prompt_ids: list[int], params: SamplingParams) -> Generation:
        live = self._live.get(session_id)
        if live is None:
            return self._batcher.generate([prompt_ids], params)[0]
        return live.ask(prompt_ids, params, self.config.session_timeout_s)

    # ---- an asynchronous run's sessions -----------------------------------------------------------------------

    def start_session(self, record, sample: int, ready) -> LiveSession:
        """Open a session for ``record``'s ``sample``-th trajectory and run the harness on it (at most
        ``max_concurrent_sessions`` at once; the others wait their turn). ``ready(session)`` is called, on the
        harness's thread, when a call waits for the engines (``context``, ``answer``) and when the session ended
        (``session.trajectory``)."""
        self._serve()
        if self._live_pool is None:
            self._live_pool = ThreadPoolExecutor(self.config.max_concurrent_sessions,
                                                 thread_name_prefix="rlmega-harness")
        session = LiveSession(f"live-{uuid.uuid4().hex[:12]}", record, sample, ready)
        self.store.open(session.id)
        self._live[session.id] = session
        self._live_pool.submit(self._run_session, session)
        return session

    def _run_session(self, session: LiveSession) -> None:
        # A harness past session_timeout_s is lost (its thread cannot be stopped: what it does later is ignored).
        overtime = threading.Timer(self.config.session_timeout_s, self._end_session, (session, True, None))
        overtime.daemon = True
        overtime.start()
        try:
            returned, failed = self.harness(self.gateway.session_url(session.id),
                                            example_of(session.record, session.sample)), False
        except Exception:  # noqa: BLE001 - a failing harness loses its session, not the run
            returned, failed = None, True
        finally:
            overtime.cancel()
        self._end_session(session, failed, returned)

    def _end_session(self, session: LiveSession, failed: bool, returned: Optional[float]) -> None:
        with self._ending:
            if self._live.pop(session.id, None) is None:
                return  # ended already
            trajectory = self._trajectory(0, session.id, session.record, failed, returned)
        session.end(trajectory)

    @staticmethod
    def context(session: LiveSession) -> list[int]:
        """What the session's waiting call generates from."""
        return session.call.prompt_ids

    @staticmethod
    def max_new_tokens(session: LiveSession) -> int:
        """The reply's token budget, as the harness asked."""
        return session.call.params.max_new_tokens

    @staticmethod
    def answer(session: LiveSession, reply: Generation, versions: Sequence[int]) -> None:
        """The reply to the session's waiting call, with the weight version of each of its tokens."""
        session.answer(reply, versions)

    # ---- trajectories -----------------------------------------------------------------------------------------

    def _finished(self, index: int, session_id: str, record, future: Future) -> SessionTrajectory:
        failed = not future.done() or future.cancelled() or future.exception() is not None
        return self._trajectory(index // self._params.n, session_id, record, failed,
                                None if failed else future.result())

    def _trajectory(self, prompt_index: int, session_id: str, record, failed: bool,
                    returned: Optional[float]) -> SessionTrajectory:
        session = self.store.pop(session_id)
        if failed or session is None or not session.segments:
            # Nothing to train on: the prompt and one masked stop token (a response is never empty).
            return SessionTrajectory(prompt_index, [self.stop_token_ids[0]], [0.0], "abort", -1,
                                     prompt_token_ids=list(record.prompt_token_ids), loss_mask=[0], lost=True)
        segment = session.segments[0]
        reward = session.reward if session.reward is not None else returned
        last_policy = max((i for i, kept in enumerate(segment.response_mask) if kept), default=-1)
        ended = last_policy >= 0 and segment.response_ids[last_policy] in self.stop_token_ids
        # Text in every message, as in the agent loop's (a reply with tool calls only has content None here).
        messages = [{**message, "content": message.get("content") or ""} for message in segment.messages or []]
        return SessionTrajectory(prompt_index, list(segment.response_ids), list(segment.rollout_logprobs),
                                 "stop" if ended else "length", min(segment.weight_versions),
                                 prompt_token_ids=list(segment.prompt_ids), loss_mask=list(segment.response_mask),
                                 messages=messages, num_turns=len(segment.weight_versions),
                                 env_reward=float(reward or 0.0), extra_segments=len(session.segments) - 1)

    def close(self) -> None:
        for session in list(self._live.values()):
            session.fail_call(RuntimeError("the run is ending"))
        if self._live_pool is not None:
            self._live_pool.shutdown(wait=False, cancel_futures=True)
            self._live_pool = None
        if self.gateway is not None:
            self.gateway.close()
            self.gateway = None
