"""The steps of a rollout engine's weight update, the same for every engine (``HFEngine`` and the adapters over
vLLM and SGLang), and the record of the weights' state they keep.

An update is ``begin(version)``; then buckets of tensors, each checked before any of it reaches the engine and
written between ``WeightBook.sending`` (from there until the commit the weights may be mixed) and
``WeightBook.sent``; then ``commit()``. An engine says how a stream is checked and cut into buckets and how a
bucket is written; the versions, torn updates, re-sync after ``sleep(level=2)`` and the refusals are the same
for all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional

import torch

from rlmega.rollout.engine_lock import serialised
from rlmega.rollout.protocol import EngineNotReadyError

NamedTensors = Iterable[tuple[str, torch.Tensor]]


def check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    """Every engine's refusal of a tensor whose shape is not its weight's."""
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}")


class WeightBook:
    """Versions, torn updates and sleep levels of an engine's weights (``HFEngine`` and the adapters).

    A version commits only when its whole stream arrived; from the first tensor sent until then the
    weights are mixed and ``generate`` refuses; after ``sleep(level=2)`` every on-disk name must be re-sent.
    """

    def __init__(self, names: Iterable[str]):
        self.names = frozenset(names)
        self.version = 0
        self.sleep_level = 0
        self.missing: set[str] = set()
        self.torn_version: int | None = None
        self.pending: int | None = None

    def begin(self, version: int) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or version < self.version:
            raise ValueError(f"version must be an int >= the current weight version {self.version}, got {version!r}")
        self.pending = version

    def sending(self) -> None:
        """Called just before tensors leave for the engine: from here on the weights may be mixed."""
        if self.pending is None:
            raise RuntimeError("weights sent outside an update; call begin_update(version) first")
        self.torn_version = self.pending

    def sent(self, slots: Iterable[str]) -> None:
        self.missing.difference_update(slots)

    def commit(self) -> None:
        if self.pending is None:
            raise RuntimeError("commit_update called outside an update; call begin_update(version) first")
        self.version, self.pending, self.torn_version = self.pending, None, None

    def slept(self, level: int) -> None:
        if level == 2 and self.sleep_level < 2:
            self.missing = set(self.names)
        self.sleep_level = max(self.sleep_level, level)

    def check_ready(self) -> None:
        if self.sleep_level:
            resync = " and re-sync every weight with update_weights" if self.sleep_level == 2 else ""
            raise EngineNotReadyError(f"engine is asleep (level {self.sleep_level}): call wake(){resync} first")
        if self.missing:
            examples = ", ".join(sorted(self.missing)[:3])
            raise EngineNotReadyError(
                f"{len(self.missing)} weights dropped by sleep(level=2) have not been re-synced "
                f"(e.g. {examples}); send them with update_weights")
        if self.torn_version is not None:
            raise EngineNotReadyError(
                f"the update to weight version {self.torn_version} failed part way, leaving mixed "
                f"weights; complete an update_weights before generating")

    def health(self) -> dict:
        return {
            "ready": not (self.sleep_level or self.missing or self.torn_version is not None),
            "weight_version": self.version,
            "sleep_level": self.sleep_level,
            "missing_weights": len(self.missing),
            "torn_update_version": self.torn_version,
        }


class WeightUpdates:
    """An engine's weight updates, step by step, over its ``WeightBook``.

    ``checked_buckets(named_tensors)`` yields ``(bucket, on-disk names it fills)``, raising on a bad tensor before
    the bucket holding it is yielded; ``load(bucket)`` writes one into the engine; ``committed(version)``, if
    given, runs after a version commits (an adapter closes the engine's update session there).
    """

    def __init__(self, book: WeightBook, *, checked_buckets: Callable[[NamedTensors], Iterator[tuple[Any, set[str]]]],
                 load: Callable[[Any], None], committed: Optional[Callable[[int], None]] = None):
        self.book = book
        self._checked_buckets = checked_buckets
        self._load = load
        self._committed = committed

    def begin(self, version: int) -> None:
        self.book.begin(version)

    def write(self, named_tensors: NamedTensors) -> None:
        """Check and write the stream, bucket by bucket, as it arrives (a generator may stream buckets)."""
        if self.book.pending is None:
            raise RuntimeError("write_weights called outside an update; call begin_update(version) first")
        for bucket, slots in self._checked_buckets(named_tensors):
            with self.sending(slots):
                self._load(bucket)

    @contextlib.contextmanager
    def sending(self, slots: Iterable[str]):
        """Around one checked bucket on its way into the engine: from its start the weights may be mixed until
        the commit; its on-disk names count as re-sent once it has landed."""
        self.book.sending()
        yield
        self.book.sent(slots)

    def commit(self) -> None:
        version = self.book.pending
        self.book.commit()
        if self._committed is not None:
            self._committed(version)


class UpdateSteps:
    """An engine's weight-update methods (``RolloutEngine.update_weights`` and its three steps, callable one by one
    so a remote trainer can stream buckets), each under the engine's lock, over its ``WeightUpdates``
    (``self._updates``). ``HFEngine`` and ``EngineAdapter`` take them from here."""

    _updates: WeightUpdates

    @serialised
    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Begin, write the stream as it arrives (checked, bucketed, nothing of it held beyond the bucket being
        written), commit ``version``: see ``RolloutEngine.update_weights``."""
        self.begin_update(version)
        self.write_weights(named_tensors)
        self.commit_update()

    @serialised
    def begin_update(self, version: int) -> None:
        self._updates.begin(version)

    @serialised
    def write_weights(self, named_tensors: NamedTensors) -> None:
        self._updates.write(named_tensors)

    @serialised
    def commit_update(self) -> None:
        self._updates.commit()
