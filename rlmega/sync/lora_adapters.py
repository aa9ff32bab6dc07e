"""``sync.lora=adapters``: a LoRA actor's weight sync that sends the adapters alone, in PEFT names, and lets the
engines (vLLM's or SGLang's LoRA, ``rlmega.rollout.lora_serving``) apply them; the base weights stay where the
engines loaded them.

The engines load the base from the start checkpoint. When the actor's base is no longer that checkpoint (a
supervised warm-start folded the adapters into it: ``MegatronWorker.base_folded``), the first sync into a set of
engines also carries the base weights (read with the adapters off), once; every later sync carries the adapters
alone: rank x (in + out) numbers per adapted layer instead of in x out.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Optional, Sequence

import torch.distributed as dist

from rlmega.bridge.export import export_hf_buckets
from rlmega.models import lora
from rlmega.models.spec import ModelSpec
from rlmega.rollout.lora_serving import ADAPTER_CONFIG, config_tensor
from rlmega.sync.buckets import NamedTensors, rebucket
from rlmega.sync.gathered import GatheredTransport
from rlmega.sync.stats import SyncStats
from rlmega.sync.transports import BucketTransport
from rlmega.workers.lora_export import peft_adapter


@dataclasses.dataclass(frozen=True)
class AdapterSource:
    """What an adapters-only sync needs of the actor besides its chunks."""

    config: lora.LoraConfig
    """The actor's adapters (rank, alpha): their ``adapter_config.json``."""
    base_model: str
    """The checkpoint the engines loaded (``model.path``): the adapters' base."""
    base_changed: Callable[[], bool] = lambda: False
    """Whether the actor's base weights differ from ``base_model`` now (the warm-start folded adapters into them)."""


class AdapterTransport(GatheredTransport):
    """The adapters, gathered to rank 0 (the engines' rank), streamed into its engines through its bucket transport
    (see ``GatheredTransport``); the base weights too on the first push after the base changed."""

    def __init__(self, chunks: list, spec: ModelSpec, engines: Optional[Sequence], buckets: Optional[BucketTransport],
                 source: AdapterSource, *, bucket_bytes: int):
        super().__init__(chunks, spec, engines, buckets, bucket_bytes=bucket_bytes)
        self.source = source
        self.base_sent = False
        """Rank 0: whether these engines committed the changed base (each set of engines gets its own transport)."""
        self._with_base = False

    def push(self, version: int) -> SyncStats:
        # Rank 0's record decides for every rank: the export is collective, and only rank 0 knows whether the
        # engines committed the base (a failed push sends it again).
        decision = [self.source.base_changed() and not self.base_sent]
        dist.broadcast_object_list(decision, src=0)
        self._with_base = decision[0]
        stats = super().push(version)
        self.base_sent = self.base_sent or self._with_base
        return stats

    def _buckets(self) -> Iterator[NamedTensors]:
        if self._with_base:
            with lora.adapters_disabled(self.chunks):  # the base weights, without the adapters merged in
                yield from export_hf_buckets(self.chunks, self.spec, bucket_bytes=self.bucket_bytes, destinations=[0])
        adapter = peft_adapter(self.chunks, self.spec, self.source.config, self.source.base_model)
        if adapter is not None:
            tensors, config = adapter
            yield from rebucket([*sorted(tensors.items()), (ADAPTER_CONFIG, config_tensor(config))], self.bucket_bytes)
