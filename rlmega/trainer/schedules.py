"""When a step's trajectories are generated, relative to training (``rollout.mode``).

Each schedule hands the trainer one step's ``Rollouts`` (``take``) and is told when the engines'
weights change (``pause`` before a weight sync or a validation, ``resume`` after it), so no response
is ever generated from half-updated weights:

- ``SyncRollouts``: generate this step's responses, then train on them (on-policy).
- ``OneStepOffRollouts``: while the workers train step k, the engines generate step k+1's responses
  from the weights step k trains from; the sync waits for them. Exactly one version stale.
- ``AsyncRollouts`` (``rlmega.trainer.async_rollouts``): engines generate continuously into a bounded
  buffer of whole groups, ``rollout.max_staleness`` versions at most behind the policy being updated.

The checkpointed prompt position (``state_dict``) never includes responses that were generated but not
trained on: after a resume, those prompts are generated again.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Protocol

from rlmega.config.schema import RLConfig
from rlmega.trainer.prompts import Generator, PromptSource, Rollouts


class RolloutSchedule(Protocol):
    def take(self, step: int) -> Rollouts: ...
    def pause(self) -> None: ...
    def resume(self, version: int) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def close(self) -> None: ...


class SyncRollouts:
    """Generate, then train: the step's responses come from the weights being updated."""

    def __init__(self, prompts: PromptSource, engines: Generator):
        self.prompts, self.engines = prompts, engines

    def take(self, step: int) -> Rollouts:
        return self.prompts.rollouts(self.engines, step)

    def pause(self) -> None:
        pass

    def resume(self, version: int) -> None:
        pass

    def state_dict(self) -> dict:
        return self.prompts.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state)

    def close(self) -> None:
        pass


class OneStepOffRollouts:
    """Step k+1's responses are generated while step k trains, from the weights step k trains from.

    ``take(k)`` returns the responses prefetched during step k-1 (step 1's, and a resumed run's first,
    are generated on the spot) and starts step k+1's generation in a background thread; ``pause``
    waits for it, so the weight sync after step k never overlaps a generation. Seeds and prompts are
    those of a synchronous run, so the run equals a synchronous run whose rollouts are delayed by one
    step (``overlap=False`` is that run: the prefetch runs in ``take`` itself).
    """

    def __init__(self, prompts: PromptSource, engines: Generator, total_steps: int, *, overlap: bool = True):
        self.prompts, self.engines, self.total_steps = prompts, engines, total_steps
        self.overlap = overlap
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlmega-prefetch")
        self._next: Optional[tuple[int, Future]] = None
        self._state: dict = prompts.state_dict()  # the prompt position before the prefetched step's prompts

    def take(self, step: int) -> Rollouts:
        if self._next is not None and self._next[0] == step:
            rollouts = self._next[1].result()
        else:
            rollouts = self.prompts.rollouts(self.engines, step)
        self._next = None
        self._state = self.prompts.state_dict()
        if step < self.total_steps:
            if self.overlap:
                self._next = (step + 1, self._executor.submit(self._generate, step + 1))
            else:
                done: Future = Future()
                done.set_result(self._generate(step + 1))
                self._next = (step + 1, done)
        return rollouts

    def _generate(self, step: int) -> Rollouts:
        started = time.perf_counter()
        rollouts = self.prompts.rollouts(self.engines, step)
        rollouts.metrics["timing_s/prefetch"] = time.perf_counter() - started  # the engines' busy time
        return rollouts

    def pause(self) -> None:
        """Wait for the prefetch (its exception, if any, is raised here)."""
        if self._next is not None:
            self._next[1].result()

    def resume(self, version: int) -> None:
        pass

    def state_dict(self) -> dict:
        return self._state

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state)
        self._state = self.prompts.state_dict()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def rollout_schedule(config: RLConfig, prompts: PromptSource, engines) -> RolloutSchedule:
    """The schedule of ``rollout.mode``."""
    mode = config.rollout.mode
    if mode == "sync":
        return SyncRollouts(prompts, engines)
    if mode == "one_step_off":
        return OneStepOffRollouts(prompts, engines, prompts.total_steps)
    from rlmega.trainer.async_rollouts import AsyncRollouts

    return AsyncRollouts(config, prompts, engines)
