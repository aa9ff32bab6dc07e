"""Fake parts for driving the ``Trainer`` without Ray or processes: engines that answer from a
script, and role groups that record what they were called with and answer with known tensors."""

from __future__ import annotations

import dataclasses
import re

import torch

from rlmega.rollout.protocol import Generation, SamplingParams
from rlmega.sync import SyncStats

ROLLOUT_LOGP = -0.5
"""Every response token's log-prob as the fake engine reports it."""
REF_SHIFT = -0.25
"""The fake reference's log-probs are the engine's plus this."""


class FakeEngines:
    """Answers an ``a+b=`` prompt right in even samples and off by one in odd ones (then the stop
    token); greedy answers are always right."""

    restarts = None  # they never die

    def __init__(self, tokenizer, stop_token_id: int):
        self.tokenizer, self.stop_token_id = tokenizer, stop_token_id
        self.served, self.asleep, self.sleeps = 0, False, 0
        """``served``: the weight version the engines hold (``FakeActor.push_weights`` sets it)."""
        self.calls: list[SamplingParams] = []
        self.shut_down = False

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        assert not self.asleep, "generate while asleep"
        self.calls.append(params)
        generations = []
        for i, prompt in enumerate(prompts):
            a, b = re.findall(r"(\d+)\+(\d+)=", self.tokenizer.decode(prompt))[-1]
            for j in range(params.n):
                answer = int(a) + int(b) + (0 if params.temperature == 0 else j % 2)
                tokens = self.tokenizer.encode(str(answer), add_special_tokens=False) + [self.stop_token_id]
                generations.append(Generation(prompt_index=i, response_token_ids=tokens,
                                              logprobs=[ROLLOUT_LOGP] * len(tokens), finish_reason="stop",
                                              weight_version=self.served))
        return generations

    def handles(self) -> list:
        return [self]

    def version(self) -> int:
        return self.served

    def weight_version(self) -> int:
        return self.served

    def sleep(self, level: int = 1) -> None:
        self.asleep = True
        self.sleeps += 1

    def wake(self) -> None:
        self.asleep = False

    def shutdown(self) -> None:
        self.shut_down = True


@dataclasses.dataclass
class FakeJob:
    offloads: list = dataclasses.field(default_factory=list)
    saved: list = dataclasses.field(default_factory=list)
    shut_down: bool = False

    def set_offloaded(self, offloaded: bool) -> None:
        self.offloads.append(offloaded)

    def release_training_state(self) -> None:
        self.offloads.append("training state")

    def save(self, root: str, extra: dict, keep=None) -> dict:
        self.saved.append((root, extra, keep))
        return {}

    def load(self, root: str, step: int) -> dict:
        raise AssertionError("nothing to resume from in these tests")

    def shutdown(self) -> None:
        self.shut_down = True


class FakeActor:
    """Old log-probs ``ROLLOUT_LOGP + shift`` for every token; ``update`` keeps the batches it got."""

    def __init__(self, shift: float = 0.0):
        self.shift = shift
        self.logprob_batches, self.updates, self.sft_batches, self.pushed, self.checked = [], [], [], [], []
        self.connected: list[list] = []
        """The engines of every ``connect`` (the weight sync's), in order."""

    def compute_logprobs(self, batch):
        self.logprob_batches.append(batch)
        logp = [torch.full((n,), ROLLOUT_LOGP + self.shift) for n in batch.response_lengths]
        return logp, [torch.ones(n) for n in batch.response_lengths]

    def update(self, batch) -> dict[str, float]:
        self.updates.append(batch)
        return {"actor/pg_loss": 0.0}

    def update_on_policy(self, batch):
        assert "old_logp" not in batch.fields
        self.updates.append(batch)
        logp, entropy = self.compute_logprobs(batch)
        self.logprob_batches.pop()  # scored inside the update, not by a pass of its own
        return {"actor/pg_loss": 0.0}, logp, entropy

    def sft_step(self, batch, lr: float) -> dict[str, float]:
        self.sft_batches.append((batch, lr))
        return {"sft_loss": 1.0}

    def connect(self, engines: list) -> None:
        self.connected.append(list(engines))

    def push_weights(self, version: int) -> SyncStats:
        for engine in self.connected[-1]:
            assert not engine.asleep, "weights pushed into a sleeping engine"
            engine.served = version
        self.pushed.append(version)
        return SyncStats(version=version, tensors=1, bytes=8, seconds=1.0)

    def check_weights(self, probes, version: int) -> float:
        assert all(engine.served == version for engine in self.connected[-1]) and probes
        self.checked.append(version)
        return 0.0

    def serve_replacement(self, engine, probes) -> float | None:
        version = self.pushed[-1]
        engine.served = version
        if probes is None:
            return None
        self.checked.append(version)
        return 0.0


class FakeReference:
    def __init__(self):
        self.batches, self.copied = [], 0

    def compute_logprobs(self, batch):
        self.batches.append(batch)
        return [torch.full((n,), ROLLOUT_LOGP + REF_SHIFT) for n in batch.response_lengths], None

    def copy_from_actor(self) -> None:
        self.copied += 1


class FakeCritic:
    """Values 0.5 at every token; ``update`` keeps its batches."""

    def __init__(self):
        self.value_batches, self.updates = [], []

    def compute_values(self, batch):
        self.value_batches.append(batch)
        return [torch.full((n,), 0.5) for n in batch.response_lengths]

    def update(self, batch) -> dict[str, float]:
        self.updates.append(batch)
        return {"critic/vf_loss": 0.0}


class FakeAsyncEngines(FakeEngines):
    """``FakeEngines`` with the asynchronous driver's interface (``submit``, ``pause_generation``,
    ``resume_generation``): each request runs in a thread, emitting one token at a time. The first token
    of a call is immediate; every later one waits ``tick_s`` on the pause event, so a pause interrupts the
    call after its first token (the unfinished responses come back as "abort"). A token's log-prob is
    ``ROLLOUT_LOGP - 0.1 * version``: the behaviour log-probs tell which weights produced each token."""

    def __init__(self, tokenizer, stop_token_id: int, *, num_engines: int = 1, tick_s: float = 0.5):
        super().__init__(tokenizer, stop_token_id)
        import threading

        self.num_engines, self.tick_s = num_engines, tick_s
        self._paused = threading.Event()
        self.mid_call = threading.Event()  # set once a running call has emitted its first tokens
        self.in_flight = 0
        self.aborted = 0
        self._count_lock = threading.Lock()

    def submit(self, engine: int, prompts: list[list[int]], params: list[SamplingParams]):
        import threading
        from concurrent.futures import Future

        assert 0 <= engine < self.num_engines
        future: Future = Future()
        with self._count_lock:
            self.in_flight += 1
        version = self.served

        def run():
            try:
                future.set_result(self._run(prompts, params, version))
            except BaseException as error:  # noqa: BLE001 - surfaces in the driver
                future.set_exception(error)
            finally:
                with self._count_lock:
                    self.in_flight -= 1
                    if not self.in_flight:
                        self.mid_call.clear()

        threading.Thread(target=run, daemon=True).start()
        return future

    def target(self, prompt: list[int], request: SamplingParams) -> list[int]:
        """The tokens still to come for a request: the answer, after what a continuation already holds."""
        a, b = re.findall(r"(\d+)\+(\d+)=", self.tokenizer.decode(prompt))[-1]
        text = self.tokenizer.decode(prompt, skip_special_tokens=True).rsplit("=", 1)[1]  # answered before
        right, wrong = str(int(a) + int(b)), str(int(a) + int(b) + 1)
        # A third of the responses (by seed) are off by one; a continuation carries on with what it began.
        answer = (right if right.startswith(text) else wrong) if text else (wrong if request.seed % 3 == 0 else right)
        tokens = self.tokenizer.encode(answer, add_special_tokens=False) + [self.stop_token_id]
        return tokens[len(self.tokenizer.encode(text, add_special_tokens=False)) if text else 0:]

    def _run(self, prompts, params, version) -> list[Generation]:
        targets = [self.target(prompt, request) for prompt, request in zip(prompts, params)]
        emitted = [[] for _ in prompts]
        finish = [None] * len(prompts)
        first = True
        while any(reason is None for reason in finish):
            if not first and self._paused.wait(self.tick_s):
                break
            if self._paused.is_set():
                break
            for row, target in enumerate(targets):
                if finish[row] is None:
                    emitted[row].append(target[len(emitted[row])])
                    if len(emitted[row]) == len(target):
                        finish[row] = "stop"
                    elif len(emitted[row]) == params[row].max_new_tokens:
                        finish[row] = "length"
            first = False
            self.mid_call.set()
        self.aborted += sum(reason is None for reason in finish)
        return [Generation(prompt_index=row, response_token_ids=tokens,
                           logprobs=[ROLLOUT_LOGP - 0.1 * version] * len(tokens),
                           finish_reason=finish[row] or "abort", weight_version=version)
                for row, tokens in enumerate(emitted)]

    def pause_generation(self) -> None:
        self._paused.set()

    def resume_generation(self) -> None:
        self._paused.clear()


class MidGenerationActor(FakeActor):
    """A ``FakeActor`` whose update lasts until the engines are in the middle of a call (when one is in
    flight), so the weight sync after it interrupts responses."""

    def __init__(self, engines: FakeAsyncEngines):
        super().__init__()
        self.engines = engines

    def update(self, batch) -> dict[str, float]:
        if self.engines.in_flight:
            assert self.engines.mid_call.wait(timeout=60), "the engines never started generating"
        return super().update(batch)


class RecordedTakes:
    """Wraps a trainer's rollout schedule and keeps every step's rollouts (``taken[step]``)."""

    def __init__(self, trainer):
        self.taken = {}
        take = trainer.schedule.take

        def recorded(step):
            self.taken[step] = rollouts = take(step)
            return rollouts

        trainer.schedule.take = recorded


class _RemoteMethod:
    def __init__(self, function):
        self.remote = function


class _InProcessHandle:
    """What the groups see of a rank: ``handle.method.remote(...)``, here answered at once."""

    def __init__(self, process):
        self._process = process

    def __getattr__(self, name):
        return _RemoteMethod(getattr(self._process, name))


def in_process_ranks(processes):
    """``RankCalls`` over ``RankProcess`` objects in this process (no Ray): the role groups' calls reach them at
    once; ``shutdown`` is recorded (``.shut``)."""
    from rlmega.trainer.training_group import RankCalls

    class InProcessRanks(RankCalls):
        def __init__(self):
            self.handles = [_InProcessHandle(process) for process in processes]
            self.shut = False

        def _on_ranks(self, call, what, timeout_s=None):
            return [call(handle) for handle in self.handles]

        def shutdown(self):
            self.shut = True

    return InProcessRanks()
