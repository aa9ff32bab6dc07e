"""The ``sync`` section of a run's config: how trained weights reach the engines, and how they are checked.

``WeightSync.build`` makes the run's weight sync on a training rank from it; ``problems`` says what in the section
contradicts the rest of the run; ``engine_arguments`` what the engines must be built with for its transport. Every
rule that depends on which transport was chosen lives here, so nothing above ``rlmega.sync`` names a transport.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

SHARDED_RDT = "sharded_rdt"
"""vLLM's own weight transfer (``rlmega.sync.vllm_sharded``): every training rank serves its slices."""
SLICED = "sliced"
"""The transfer plan carried out (``rlmega.sync.sliced``): every training rank sends its blocks to the engine ranks."""
LORA_SYNCS = ("merged", "adapters")
"""``sync.lora``: what a LoRA actor's sync sends."""
# The transports that stream a gather of rank 0 into the engines' update_weights, which takes the adapters.
ADAPTER_TRANSPORTS = ("auto", "in_process", "shared_memory", "object_store")


def transport_names() -> tuple[str, ...]:
    """Every value ``sync.transport`` takes but ``auto``."""
    from rlmega.sync.registry import TRANSPORTS

    return (*TRANSPORTS, SHARDED_RDT, SLICED)


@dataclasses.dataclass
class SyncConfig:
    """The weight sync after every update: trained weights into the engines (see rlmega/sync/README.md)."""

    bucket_bytes: int = 64 * 1024**2
    """Bucket size: the export gathers and sends this many bytes at a time."""
    transport: str = "auto"
    """in_process | object_store | shared_memory | broadcast | auto (by where the engines run); sliced: the transfer
    plan carried out, every training rank sending its own blocks straight to the engines, no gather to rank 0
    (engines of one GPU each); or sharded_rdt: vLLM's own transfer, each engine worker pulling only its slices from
    every training rank (vLLM engines; needs Ray's NIXL transport; rlmega/sync/README.md)."""
    timeout_s: float = 600.0
    """Longest wait for one bucket (or the whole sync) before the run stops naming the engine."""
    post_sync_check: bool = True
    """Score greedy probes with the engine and the trainer after a sync; stop if they disagree."""
    post_sync_atol: Optional[float] = None
    """Largest log-prob difference (nats) the post-sync check lets through. None: by precision (see
    ``RLConfig.post_sync_atol``): 1e-3 when trainer and engines both compute in fp32, 0.5 when either
    computes in bf16, where two sets of kernels differ by tenths of a nat on a greedy token and a wrong
    weight mapping by several nats."""
    check_every: int = 1
    """Run the post-sync check after every k-th sync (always after the run's first one): its cost is
    one greedy generation and one forward pass of a few probe prompts."""
    lora: str = "merged"
    """A LoRA actor's sync (``actor.lora.rank > 0``). merged: every weight, with the adapters merged in
    (``W + scale * B @ A``), into any engine. adapters: the adapters alone, in PEFT names, which vLLM or SGLang applies
    with its LoRA kernels over the base it loaded once (``rollout.backend=vllm`` or ``sglang``;
    rlmega/sync/README.md)."""

    def checks(self, version: int, first_version: int) -> bool:
        """Whether the sync of ``version`` runs the post-sync check (the run's first sync, ``first_version``, always)."""
        return self.post_sync_check and (version == first_version or version % self.check_every == 0)

    def problems(self, rollout_backend: str, restarts_engines: bool, engine_gpus: int = 1, lora_rank: int = 0,
                 weight_dtype: str = "auto", lora_modules: Sequence[str] = ()) -> list[tuple[str, str]]:
        """What in this section contradicts the rest of the run, as (key, what to do) pairs: ``rollout_backend`` is
        ``rollout.backend``, ``restarts_engines`` whether ``rollout.restart_dead_engines`` is on, ``engine_gpus``
        the GPUs of one engine, ``lora_rank`` and ``lora_modules`` ``actor.lora.rank`` and ``target_modules``,
        ``weight_dtype`` ``rollout.weight_dtype``."""
        found = self._lora_problems(rollout_backend, lora_rank, weight_dtype, lora_modules)
        if self.transport != "auto" and self.transport not in transport_names():
            found.append(("sync.transport", f"{self.transport!r} is not one of auto, "
                                            f"{', '.join(sorted(transport_names()))}"))
        if self.transport == SHARDED_RDT and rollout_backend != "vllm":
            found.append(("sync.transport", f"{SHARDED_RDT} is vLLM's own weight transfer, but rollout.backend is "
                                            f"{rollout_backend!r}: set rollout.backend=vllm, or choose another transport"))
        if self.transport == SHARDED_RDT and restarts_engines:
            found.append(("rollout.restart_dead_engines",
                          f"sync.transport={SHARDED_RDT} plans its transfers for the engines of the first sync, so a "
                          "restarted engine would get no weights; choose another transport, or set it to 0"))
        if self.transport == SLICED and engine_gpus > 1:
            found.append(("sync.transport", f"{SLICED} feeds engines of one GPU each (an engine's own workers do not "
                                            f"take blocks yet), but one engine has {engine_gpus}: use "
                                            f"{SHARDED_RDT} for vLLM, or broadcast"))
        if self.bucket_bytes <= 0 or self.timeout_s <= 0:
            found.append(("sync.bucket_bytes / sync.timeout_s", "must be > 0"))
        if self.check_every < 1:
            found.append(("sync.check_every", "must be >= 1"))
        if self.post_sync_atol is not None and self.post_sync_atol <= 0:
            found.append(("sync.post_sync_atol", "must be > 0 (null: chosen by the run's precision)"))
        return found

    def _lora_problems(self, rollout_backend: str, lora_rank: int, weight_dtype: str,
                       lora_modules: Sequence[str]) -> list[tuple[str, str]]:
        if self.lora not in LORA_SYNCS:
            return [("sync.lora", f"{self.lora!r} is not one of {', '.join(LORA_SYNCS)}")]
        if self.lora != "adapters":
            return []
        if not lora_rank:
            return [("sync.lora", "adapters sends a LoRA actor's adapters, but actor.lora.rank is 0: set "
                                  "actor.lora.rank > 0, or sync.lora=merged")]
        if rollout_backend == "hf":
            return [("sync.lora", "adapters needs vLLM's or SGLang's LoRA kernels, but rollout.backend is hf: set "
                                  "sync.lora=merged (the hf engine takes the merged weights), or rollout.backend=vllm "
                                  "or sglang")]
        if weight_dtype != "auto":
            return [("sync.lora", f"adapters keeps the base weights the engines loaded, but rollout.weight_dtype="
                                  f"{weight_dtype} quantizes the weights a sync sends: set sync.lora=merged, or "
                                  "rollout.weight_dtype=auto")]
        experts = sorted(module for module in lora_modules if module.startswith("experts."))
        if experts:
            return [("sync.lora", f"adapters sends attention and dense-MLP adapters to the engines; their loading of "
                                  f"per-expert adapters ({', '.join(experts)} in actor.lora.target_modules) is not "
                                  "checked yet: set sync.lora=merged, or adapt no experts")]
        if self.transport not in ADAPTER_TRANSPORTS:
            return [("sync.transport", f"{self.transport} moves base weights straight into the engines' layers, and "
                                       "sync.lora=adapters sends adapters: use one of "
                                       f"{', '.join(ADAPTER_TRANSPORTS)}")]
        return []

    def engine_arguments(self, lora_rank: int = 0) -> dict:
        """What a vLLM or SGLang engine must be built with for this sync: vLLM runs the weight-transfer backend it
        was built with (``sharded_rdt`` is vLLM's alone), and both serve adapters of up to ``lora_rank``
        (``actor.lora.rank``) with ``sync.lora=adapters``."""
        transfer = {"weight_transfer": SHARDED_RDT} if self.transport == SHARDED_RDT else {}
        return {**transfer, **({"lora_rank": lora_rank} if self.lora == "adapters" and lora_rank else {})}
