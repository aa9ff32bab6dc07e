"""What the sync tests share: streams of buckets, an engine that records what it saw mid-update,
and the bit-for-bit comparison."""

from __future__ import annotations

import torch

from rlmega.rollout import HFEngine
from rlmega.sync.buckets import rebucket
from rollout.tiny_models import checkpoint_tensors

# Smaller than the largest tiny-model tensor (embedding 100 x 64 fp32 = 25.6 kB), so single tensors
# outgrow a bucket and the transports' buffers must grow.
BUCKET_BYTES = 16 * 1024


def buckets_of(directory, bucket_bytes: int = BUCKET_BYTES) -> list[list[tuple[str, torch.Tensor]]]:
    return list(rebucket(sorted(checkpoint_tensors(directory).items()), bucket_bytes))


def failing_after(buckets, num_good: int, error: BaseException):
    """Yield ``num_good`` buckets, then raise ``error`` (an export failing mid-stream)."""
    yield from buckets[:num_good]
    raise error


def assert_serves(state: dict[str, torch.Tensor], directory) -> None:
    """Every tensor of the checkpoint at ``directory`` is in ``state``, bit for bit."""
    expected = checkpoint_tensors(directory)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), f"{name} differs"


class RecordingEngine:
    """An HFEngine whose update records, after each tensor it wrote, the version it reported and
    whether it would generate: the commit must come only after the last bucket."""

    def __init__(self, directory):
        self.inner = HFEngine(directory, attn_implementation="eager")
        self.during: list[tuple[int, bool]] = []

    def update_weights(self, named_tensors, version: int) -> None:
        def recorded():
            for item in named_tensors:
                yield item
                self.during.append((self.inner.weight_version(), self.inner.health()["ready"]))

        self.inner.update_weights(recorded(), version)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def send_all(transport, buckets) -> None:
    """The sender's life over receivers started elsewhere (``transport.listen`` already called)."""
    try:
        for bucket in buckets:
            transport.send(bucket)
        transport.finish()
    except BaseException as error:
        transport.abort(str(error))
        raise
    finally:
        transport.close()
