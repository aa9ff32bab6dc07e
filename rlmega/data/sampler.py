"""A resumable sampler: a shuffled order per epoch from a seed, drawn in batches, with its exact position saved."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np


class StatefulSampler:
    """Batches of dataset indices, epoch after epoch, that a checkpointed run resumes exactly.

    Epoch ``e`` visits the indices in the order ``epoch_order(e)``: a permutation drawn from ``(seed, e)`` alone,
    so it does not depend on how many batches were drawn before. ``state_dict()`` holds the epoch and the number of
    indices of that epoch already handed out; ``load_state_dict`` puts a fresh sampler at that point, after which
    it yields the same batches as the uninterrupted one. With ``drop_last`` the tail of an epoch that does not fill a
    batch is skipped; without it the epoch ends with a shorter batch.
    """

    def __init__(self, num_items: int, batch_size: int, seed: int = 0, shuffle: bool = True, drop_last: bool = True):
        if num_items < 1:
            raise ValueError(f"StatefulSampler: num_items must be >= 1, got {num_items}")
        if batch_size < 1:
            raise ValueError(f"StatefulSampler: batch_size must be >= 1, got {batch_size}")
        if drop_last and batch_size > num_items:
            raise ValueError(
                f"StatefulSampler: batch_size {batch_size} is larger than the dataset ({num_items} items) "
                "and drop_last is set, so no batch could be drawn"
            )
        self.num_items = num_items
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order: list[int] = []

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.num_items, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def epoch_order(self, epoch: int) -> list[int]:
        """The order in which epoch ``epoch`` visits the indices."""
        if epoch != self._order_epoch:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_items).tolist()
            else:
                self._order = list(range(self.num_items))
            self._order_epoch = epoch
        return self._order

    def next_batch(self) -> list[int]:
        """The next batch of indices; moves on to the next epoch when this one is used up."""
        remaining = self.num_items - self.position
        if remaining == 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch += 1
            self.position = 0
        order = self.epoch_order(self.epoch)
        batch = order[self.position:self.position + self.batch_size]
        self.position += len(batch)
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        """Batches without end (the trainer decides when to stop)."""
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """The exact position, plus what must match for the order to be the same when resumed."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_items": self.num_items,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the seed, dataset size and shuffling must be the ones it was saved with."""
        for key in ("seed", "num_items", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"StatefulSampler.load_state_dict: saved {key}={state[key]!r} differs from this sampler's "
                    f"{getattr(self, key)!r}; the data order would not be the same"
                )
        if not 0 <= state["position"] <= self.num_items or state["epoch"] < 0:
            raise ValueError(f"StatefulSampler.load_state_dict: invalid position {state}")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
