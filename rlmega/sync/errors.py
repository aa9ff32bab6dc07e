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
    later update completes. ``engine_error``: the engine's own error when its update call failed (a dead
    engine's shows who died, for the job's one-line failure)."""

    def __init__(self, message: str, engine_error: BaseException | None = None):
        super().__init__(message)
        self.engine_error = engine_error  # an attribute, so that it travels with the error when pickled
