"""On-policy distillation: the student's per-token reverse KL to a frozen teacher on the student's own samples.

The student (the policy) samples; a teacher scores the sampled responses. The objective at each response
position t is the reverse KL ``KL(pi_s || pi_t) = sum_v pi_s(v) (log pi_s(v) - log pi_t(v))`` (mode-seeking:
the student is pushed off what the teacher finds unlikely). Two ways to apply it:

- **Sampled-token estimators** (``k1``, ``k3``) from the log-probs of the sampled token under both models,
  ``logp`` (the student's, before the update) and ``teacher_logp``. The estimate enters the advantage as a
  detached per-token term (``apply_distill_advantage``):

      A_t <- reward_weight * A_t - coef * KL_t

  as slime's ``--opd-kl-coef`` (``A_t - coef * KL_t``) and Thinking Machines' on-policy distillation (per-token
  advantage ``-(log pi_s - log pi_t)``, no discounting). It mixes with any advantage estimator and any policy
  loss; ``reward_weight = 0`` is pure distillation.
- **Top-k** (``top_k_distill_loss``): a differentiable loss term over the teacher's k most likely tokens, from
  the student's log-probs at those ids in the training forward pass.

Shapes follow the package's conventions (``README.md``): ``[B, T]`` per token, masks nonzero on valid tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from rlmega.algos._utils import check_same_shape, masked_mean, zero_masked
from rlmega.algos.aggregation import LossDenominators, aggregate_loss
from rlmega.algos.kl import _masked_token_kl

SAMPLED_TOKEN_ESTIMATORS = ("k1", "k3")
"""The estimators from the sampled tokens' log-probs (names of ``rlmega.algos.KL_ESTIMATORS``)."""
DISTILL_ESTIMATORS = (*SAMPLED_TOKEN_ESTIMATORS, "top_k")


@dataclasses.dataclass
class DistillConfig:
    """On-policy distillation (``algorithm.distill``): the per-token reverse KL of the student to the teacher
    (``teacher``), in the advantages or as a loss term. See rlmega/algos/README.md (On-policy distillation)."""

    coef: float = 0.0
    """Weight of the distillation term; 0: off. The teacher scores every step's responses once, before the
    update."""
    estimator: str = dataclasses.field(default="k1", metadata={"choices": DISTILL_ESTIMATORS})
    """k1: ``logp - teacher_logp`` of the sampled token (unbiased, the usual choice); k3: ``exp(d) - d - 1``,
    ``d = teacher_logp - logp`` (unbiased, >= 0, lower variance, clamped as the KL loss's); both enter the
    advantages. top_k: a loss term over the teacher's ``top_k`` most likely tokens at every position (needs
    ``teacher.top_k >= top_k``)."""
    top_k: int = 32
    """k of the top_k estimator."""
    reward_weight: float = 1.0
    """How the RL reward mixes in: the advantages become ``reward_weight * A - coef * KL`` per token (A from
    ``algorithm.adv_estimator``); 0: pure distillation, the advantage is the distillation term alone (with
    top_k: the loss term alone)."""

    @property
    def enabled(self) -> bool:
        return self.coef > 0

    def problems(self, teacher_enabled: bool, teacher_top_k: int) -> list[tuple[str, str]]:
        """(field, what is wrong and how to fix it) for every setting that cannot work, given the teacher's."""
        problems = []
        if not self.coef >= 0:
            problems.append(("coef", f"must be >= 0 (0: off), got {self.coef}"))
        if not self.reward_weight >= 0:
            problems.append(("reward_weight", f"must be >= 0 (0: pure distillation), got {self.reward_weight}"))
        if not self.enabled:
            if self.reward_weight != 1.0:
                problems.append(("reward_weight", "applies only with algorithm.distill.coef > 0; set coef, or "
                                                  "leave reward_weight at 1"))
            return problems
        if not teacher_enabled:
            problems.append(("coef", f"{self.coef} distills from a teacher: set teacher.enable=true and "
                                     "teacher.path, or algorithm.distill.coef=0"))
        if self.estimator == "top_k":
            if self.top_k < 1:
                problems.append(("top_k", f"must be >= 1, got {self.top_k}"))
            elif teacher_top_k < self.top_k:
                problems.append(("top_k", f"{self.top_k} needs the teacher's {self.top_k} most likely tokens: set "
                                          f"teacher.top_k >= {self.top_k} (it is {teacher_top_k})"))
        return problems


def distill_token_kl(
    logp: torch.Tensor, teacher_logp: torch.Tensor, response_mask: torch.Tensor, estimator: str = "k1",
) -> torch.Tensor:
    """Per-token estimate of ``KL(pi_s || pi_t)`` from the sampled tokens' log-probs, ``[B, T]`` (0 where masked).

    ``k1``: ``logp - teacher_logp``; ``k3``: ``exp(d) - d - 1`` with ``d = teacher_logp - logp`` (``kl_low_var``).
    """
    if estimator not in SAMPLED_TOKEN_ESTIMATORS:
        raise ValueError(f"sampled-token distillation estimator {estimator!r} is not one of "
                         f"{', '.join(SAMPLED_TOKEN_ESTIMATORS)}")
    return _masked_token_kl(logp, teacher_logp, response_mask, estimator)[0]


@torch.no_grad()
def teacher_kl_metrics(logp: torch.Tensor, teacher_logp: torch.Tensor,
                       response_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Means over the valid tokens: ``teacher_kl`` (k1), ``teacher_kl_k3`` and ``teacher_logp``."""
    mask = response_mask.bool()
    return {
        "teacher_kl": masked_mean(distill_token_kl(logp, teacher_logp, mask, "k1"), mask),
        "teacher_kl_k3": masked_mean(distill_token_kl(logp, teacher_logp, mask, "k3"), mask),
        "teacher_logp": masked_mean(teacher_logp, mask),
    }


@torch.no_grad()
def apply_distill_advantage(
    advantages: torch.Tensor, logp: torch.Tensor, teacher_logp: torch.Tensor, response_mask: torch.Tensor,
    *, coef: float, estimator: str = "k1", reward_weight: float = 1.0,
) -> torch.Tensor:
    """``reward_weight * A_t - coef * KL_t`` on valid tokens, 0 elsewhere; ``[B, T]``, detached.

    Args:
        advantages: ``[B, T]`` from any advantage estimator.
        logp: ``[B, T]`` the student's log-probs of the sampled tokens (the policy that sampled them).
        teacher_logp: ``[B, T]`` the teacher's log-probs of the same tokens.
        response_mask: ``[B, T]``. coef: the distillation weight. estimator: ``k1`` or ``k3``.
        reward_weight: the RL advantage's weight (0: pure distillation).
    """
    check_same_shape(advantages=advantages, logp=logp)
    mask = response_mask.bool()
    token_kl = distill_token_kl(logp, teacher_logp, mask, estimator)
    mixed = reward_weight * zero_masked(advantages, mask) - coef * token_kl
    return zero_masked(mixed, mask)


def top_k_reverse_kl(student_topk_logp: torch.Tensor, teacher_topk_logp: torch.Tensor) -> torch.Tensor:
    """``sum_{v in K} q_s(v) (log q_s(v) - log q_t(v))`` over the last dimension (the teacher's top-k ids K).

    ``q_s`` and ``q_t`` are the student's and the teacher's distributions renormalised over K (NeMo-RL's
    ``DistillationLossFn`` with ``zero_outside_topk: false``), so the term is the exact reverse KL of two
    distributions on the k tokens: >= 0, 0 iff they agree there. Without the renormalisation (full-vocabulary
    ``p_s``, no term for the rest of the vocabulary) the sum is minimised by ``p_s(v) = p_t(v) / e``, pushing
    the student's mass out of the teacher's top-k; renormalised, the term moves mass only within K and leaves
    the mass outside K to the other terms. Inputs are log-probs (either normalisation; only their differences
    within K matter); ``[..., k] -> [...]``, differentiable in both.
    """
    check_same_shape(student_topk_logp=student_topk_logp, teacher_topk_logp=teacher_topk_logp)
    student = torch.log_softmax(student_topk_logp.float(), dim=-1)
    teacher = torch.log_softmax(teacher_topk_logp.float(), dim=-1)
    return (student.exp() * (student - teacher)).sum(dim=-1)


def top_k_distill_loss(
    student_topk_logp: torch.Tensor, teacher_topk_logp: torch.Tensor, response_mask: torch.Tensor, *, coef: float,
    loss_agg_mode: str = "token-mean", global_denominators: Optional[LossDenominators] = None,
    norm_horizon: Optional[float] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``coef * aggregate(top_k_reverse_kl)``: the top-k distillation loss term.

    Args:
        student_topk_logp: ``[B, T, k]`` the student's log-probs at the teacher's top-k ids (differentiable).
        teacher_topk_logp: ``[B, T, k]`` the teacher's log-probs of its top-k ids.
        response_mask: ``[B, T]``. coef: the distillation weight.
        loss_agg_mode, global_denominators, norm_horizon: passed to ``aggregate_loss``.

    Returns:
        ``(loss, metrics)``; metric ``top_k_kl`` is the mean per-token term over this call's valid tokens.
    """
    mask = response_mask.bool()
    if student_topk_logp.shape[:2] != mask.shape:
        raise ValueError(f"shape mismatch: student_topk_logp {list(student_topk_logp.shape)} must be "
                         f"response_mask {list(mask.shape)} + [k]")
    values_mask = mask.unsqueeze(-1)  # padding values never reach the log-softmax
    token_kl = zero_masked(top_k_reverse_kl(zero_masked(student_topk_logp, values_mask),
                                            zero_masked(teacher_topk_logp, values_mask)), mask)
    aggregated = aggregate_loss(token_kl, mask, loss_agg_mode, global_denominators=global_denominators,
                                norm_horizon=norm_horizon)
    return coef * aggregated, {"top_k_kl": masked_mean(token_kl, mask).detach()}
