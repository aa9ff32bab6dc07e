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

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Optional, Protocol

from rlmega.trainer.batch_assembly import Rollouts
from rlmega.trainer.generation import Generator
from rlmega.trainer.prompt_data import PromptData
from rlmega.trainer.step_rollouts import StepRollouts

if TYPE_CHECKING:
    from rlmega.trainer.prompt_side import PromptSide


@dataclasses.dataclass
class ScheduleConfig:
    mode: str
    """``rollout.mode``: ``sync``, ``one_step_off`` or ``async``."""
    prompts_per_step: int
    """``trainer.prompts_per_step``: the groups a step trains on."""
    n: int
    """``rollout.n``: responses per prompt."""
    max_staleness: int
    """``rollout.max_staleness`` (async): versions a trained group's oldest token may lag the policy."""
    stale_groups: str
    """``rollout.stale_groups`` (async): ``regenerate`` or ``drop`` a group past the bound."""
    partial_rollout: str
    """``rollout.partial_rollout`` (async): an interrupted response is continued, or restarted."""
    timeout_s: float
    """``cluster.timeout_s`` (async): the longest wait for a batch, or for interrupted requests."""
    dynamic_sampling: bool
    """``algorithm.dynamic_sampling``: groups whose metric is equal over the group are dropped."""
    dynamic_sampling_metric: str
    """``algorithm.dynamic_sampling_metric``: what is compared (``scoring.dynamic_sampling_values``)."""
    max_generation_rounds: int
    """``algorithm.max_generation_rounds`` (async: this many steps' worth of equal groups in a row stop the run)."""


class RolloutSchedule(Protocol):
    def take(self, step: int) -> Rollouts: ...
    def pause(self) -> None: ...
    def resume(self, version: int) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def close(self) -> None: ...


class SyncRollouts:
    """Generate, then train: the step's responses come from the weights being updated."""

    def __init__(self, step_rollouts: StepRollouts, data: PromptData, engines: Generator):
        self.step_rollouts, self.data, self.engines = step_rollouts, data, engines

    def take(self, step: int) -> Rollouts:
        return self.step_rollouts.take(self.engines, step)

    def pause(self) -> None:
        pass

    def resume(self, version: int) -> None:
        pass

    def state_dict(self) -> dict:
        return self.data.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.data.load_state_dict(state)

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

    def __init__(self, step_rollouts: StepRollouts, data: PromptData, engines: Generator, total_steps: int, *,
                 overlap: bool = True):
        self.step_rollouts, self.data, self.engines, self.total_steps = step_rollouts, data, engines, total_steps
        self.overlap = overlap
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlmega-prefetch")
        self._next: Optional[tuple[int, Future]] = None
        self._state: dict = data.state_dict()  # the prompt position before the prefetched step's prompts

    def take(self, step: int) -> Rollouts:
        if self._next is not None and self._next[0] == step:
            rollouts = self._next[1].result()
        else:
            rollouts = self.step_rollouts.take(self.engines, step)
        self._next = None
        self._state = self.data.state_dict()
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
        rollouts = self.step_rollouts.take(self.engines, step)
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
        self.data.load_state_dict(state)
        self._state = self.data.state_dict()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def rollout_schedule(prompts: PromptSide, engines) -> RolloutSchedule:
    """The schedule of ``rollout.mode`` (``prompts.schedule``), drawing on the prompt side's parts."""
    mode = prompts.schedule.mode
    if mode == "sync":
        return SyncRollouts(prompts.step_rollouts, prompts.data, engines)
    if mode == "one_step_off":
        return OneStepOffRollouts(prompts.step_rollouts, prompts.data, engines, prompts.data.total_steps)
    from rlmega.trainer.async_rollouts import AsyncRollouts

    return AsyncRollouts(prompts.schedule, prompts.data, prompts.generator, prompts.scorer, prompts.assembler,
                         engines)
