"""What each role of the Megatron worker is: what its output layer computes, which batch methods it
serves (and so whether it trains), whether it records MoE routing. ``MegatronWorker`` and its model
builder ask a ``Role`` instead of comparing role names; ``WorkerConfig.role`` names one of ``ROLES``.

No imports from the rest of the worker: ``rlmega.workers.config`` validates role names against it.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional


class Output(enum.Enum):
    """What the last pipeline stage's output layer computes."""

    LOGITS = "logits"
    """The checkpoint's LM head: log-probs of the response tokens."""
    VALUES = "values"
    """A scalar value head in the LM head's place, zero at the start and trained (HF checkpoints have none, so
    their LM head is not loaded and tied embeddings are untied)."""
    SCORES = "scores"
    """The checkpoint's own one-label score head (``*ForSequenceClassification``): one score per sequence."""


# Why a worker refuses a batch method its role does not serve ({role}: the worker's role).
REFUSALS = {
    "compute_logprobs": "compute_logprobs needs an actor, ref or teacher worker; this one is the {role}",
    "compute_top_k": "compute_top_k needs a teacher worker; this one is the {role}",
    "compute_values": "compute_values needs a critic worker; this one is the {role}",
    "compute_scores": "compute_scores needs a reward worker; this one is the {role}",
    "update": "the {role} worker does not train; use role actor or critic",
    "sft_step": "sft_step needs the actor worker; this one is the {role}",
}


@dataclasses.dataclass(frozen=True)
class Role:
    name: str
    """Also the prefix of the metrics of its updates (``actor/loss``, ``critic/vf_loss``)."""
    output: Output
    methods: frozenset[str]
    """The batch methods of ``MegatronWorker`` this role serves."""
    loss_metric: Optional[str] = None
    """Trained roles: the metric whose non-finite value skips an optimizer step."""
    records_routing: bool = False
    """With ``router_replay=r2`` its log-prob pass records the MoE routing that its update replays."""

    def serves(self, method: str) -> bool:
        return method in self.methods

    def require(self, method: str) -> None:
        """Refuse ``method`` (one of ``REFUSALS``) unless this role serves it; the message names the role."""
        if method not in self.methods:
            raise RuntimeError(REFUSALS[method].format(role=self.name))

    @property
    def trains(self) -> bool:
        """An optimizer, gradient buffers (Megatron's DDP) and ``update``."""
        return "update" in self.methods

    @property
    def loads_lm_head(self) -> bool:
        """Whether HF weights load with the checkpoint's output layer (a value head is not in the checkpoint)."""
        return self.output is not Output.VALUES

    @property
    def replays_routing(self) -> bool:
        """Whether MoE routing replay applies: the log-prob roles; the critic and reward model route by themselves."""
        return self.output is Output.LOGITS


ROLES: dict[str, Role] = {
    "actor": Role("actor", Output.LOGITS, frozenset({"compute_logprobs", "update", "update_on_policy", "sft_step"}),
                  loss_metric="loss", records_routing=True),
    "ref": Role("ref", Output.LOGITS, frozenset({"compute_logprobs"})),
    "critic": Role("critic", Output.VALUES, frozenset({"compute_values", "update"}), loss_metric="vf_loss"),
    "reward": Role("reward", Output.SCORES, frozenset({"compute_scores"})),
    # On-policy distillation's frozen teacher: its log-probs of the student's tokens and its most likely tokens.
    "teacher": Role("teacher", Output.LOGITS, frozenset({"compute_logprobs", "compute_top_k"})),
}
