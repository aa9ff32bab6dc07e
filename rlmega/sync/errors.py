"""What weight sync raises."""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """The engine does not serve the weights the trainer holds."""


class StaleWeightsError(WeightSyncError):
    """An engine serves another weight version than the one the trainer expects."""

    def __init__(self, served: int, expected: int, what: str = "engine"):
        super().__init__(f"{what} serves weight version {served}, expected version {expected}")
        self.served = served
        self.expected = expected


class TransportError(WeightSyncError):
    """A weight update failed in transit: a receiver failed or died, the sender gave up, or a wait
    ran past its timeout. The engine either never saw the update or refuses to generate until a
    later update completes."""
