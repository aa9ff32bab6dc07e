"""What the last pipeline stage computes from a micro-batch's output: log-probs, values, and the
actor's and critic's losses built from ``rlmega.algos``.

Loss scaling: every loss term divides by the *global* denominators of the mini-batch (all its
tokens on all data-parallel ranks), so the sum over micro-batches and ranks is the mini-batch
loss. Megatron then divides each micro-batch loss by the number of micro-batches and averages
gradients over data-parallel ranks; ``backward_scale`` undoes both, so gradients are exactly
those of the whole mini-batch, whatever the split.
"""

from __future__ import annotations

import torch

from rlmega.algos import (LossDenominators, PolicyLossContext, RatioLossConfig, clipped_value_loss,
                          correct_against_current_policy, entropy_bonus, kl_loss, top_k_distill_loss)
from rlmega.algos._utils import masked_mean
from rlmega.models.spec import padded_vocab_size
from rlmega.workers.batching import MicroBatch, SequenceBatch, padded_field, padding_mask, split_padded
from rlmega.workers.config import CriticLossConfig, PolicyLossConfig
from rlmega.workers.context_parallel import gather_response_values, local_response_indices
from rlmega.workers.logprobs import vocab_parallel_logprobs
from rlmega.workers.passes import Head, HeadResult
from rlmega.workers.target_logprobs import vocab_parallel_target_logprobs


def response_rows(micro_batch: MicroBatch, output: torch.Tensor) -> torch.Tensor:
    """``[N, V_local]`` (or ``[N, 1]``): the output rows at the response-predicting positions (all of
    the output's rows when the LM head computed only those: ``response_positions`` is None)."""
    flat = output.flatten(0, -2)  # [B * S, V_local]; V_local may be 0 (a slice of padding only: lm_head)
    if micro_batch.response_positions is None:
        return flat
    return flat.index_select(0, micro_batch.response_positions.to(flat.device))


def _scaled_rows(micro_batch: MicroBatch, output: torch.Tensor, logit_scale: float) -> torch.Tensor:
    """``[N_local, V_local]`` response rows of the logits divided by ``logit_scale`` (the sampling temperature)."""
    rows = response_rows(micro_batch, output)
    return rows / logit_scale if logit_scale != 1.0 else rows


def _vocab_slice(vocab_size: int) -> dict:
    """This rank's slice of the vocabulary, as the vocabulary-parallel functions take it."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    return dict(vocab_size=vocab_size, group=ps.get_tensor_model_parallel_group(),
                vocab_start=ps.get_tensor_model_parallel_rank() * (padded_vocab_size(vocab_size, tp) // tp))


def _row_logprobs(micro_batch: MicroBatch, rows: torch.Tensor, vocab_size: int, chunk_tokens: int):
    """``[N]`` log-probs and entropies of the micro-batch's response tokens from its ``_scaled_rows``, gathered over
    CP ranks."""
    logp, entropy = vocab_parallel_logprobs(  # the output may hold this rank's real columns only (lm_head)
        rows, micro_batch.response_targets.to(rows.device), chunk_tokens=chunk_tokens, with_entropy=True,
        **_vocab_slice(vocab_size),
    )
    return gather_response_values(logp, micro_batch), gather_response_values(entropy, micro_batch)


def _logprobs(micro_batch: MicroBatch, output: torch.Tensor, vocab_size: int, chunk_tokens: int, logit_scale: float = 1.0):
    """``[N]`` log-probs and entropies of the micro-batch's response tokens under
    ``softmax(logits / logit_scale)`` (the sampling temperature), gathered over CP ranks."""
    return _row_logprobs(micro_batch, _scaled_rows(micro_batch, output, logit_scale), vocab_size, chunk_tokens)


def _field_rows(batch: SequenceBatch, name: str, micro_batch: MicroBatch) -> torch.Tensor:
    """``[N, ...]``: a field's rows for the micro-batch's response tokens, in its order."""
    values = batch.fields[name]
    return torch.cat([values[i] for i in micro_batch.indices]) if micro_batch.indices else values[0][:0]


def _top_k_distill(batch: SequenceBatch, micro_batch: MicroBatch, rows: torch.Tensor, mask: torch.Tensor,
                   vocab_size: int, chunk_tokens: int, aggregation: dict):
    """On-policy distillation's top-k loss term (``batch.distill``) and its metrics: the student's log-probs at the
    teacher's top-k ids of every response token (this rank's tokens, then gathered over CP ranks)."""
    ids = _field_rows(batch, "teacher_topk_ids", micro_batch)
    local = local_response_indices(micro_batch)
    student = gather_response_values(vocab_parallel_target_logprobs(
        rows, (ids if local is None else ids[local]).to(rows.device), chunk_tokens=chunk_tokens,
        **_vocab_slice(vocab_size)), micro_batch)
    teacher = _field_rows(batch, "teacher_topk_logp", micro_batch).to(student.device)
    padded = padding_mask(micro_batch.response_lengths).to(student.device)
    student_rows = student.new_zeros(padded.shape + student.shape[1:]).masked_scatter(padded.unsqueeze(-1), student)
    teacher_rows = teacher.new_zeros(padded.shape + teacher.shape[1:]).masked_scatter(padded.unsqueeze(-1), teacher)
    term, metrics = top_k_distill_loss(student_rows, teacher_rows, mask, coef=batch.distill.coef, **aggregation)
    return term, {f"distill/{name}": value for name, value in metrics.items()}


def _values(micro_batch: MicroBatch, output: torch.Tensor) -> torch.Tensor:
    """``[N]`` values at the micro-batch's response-predicting positions (gathered over CP ranks)."""
    return gather_response_values(response_rows(micro_batch, output)[:, 0].float(), micro_batch)


def attached_to_graph(output: torch.Tensor) -> torch.Tensor:
    """A zero that depends on ``output``: an empty micro-batch must still backpropagate through the pipeline."""
    return output.sum() * 0.0


def logprob_head(vocab_size: int, chunk_tokens: int, logit_scale: float = 1.0) -> Head:
    """Per-token log-probs and entropies of the response tokens under ``softmax(logits / logit_scale)`` (forward only)."""

    def head(micro_batch: MicroBatch, output: torch.Tensor) -> HeadResult:
        logp, entropy = _logprobs(micro_batch, output, vocab_size, chunk_tokens, logit_scale)
        return HeadResult(loss=attached_to_graph(output), outputs={"logprobs": logp, "entropy": entropy})

    return head


def value_head() -> Head:
    """Per-token values of the response positions (critic, forward only)."""

    def head(micro_batch: MicroBatch, output: torch.Tensor) -> HeadResult:
        return HeadResult(loss=attached_to_graph(output), outputs={"values": _values(micro_batch, output)})

    return head


def global_denominators(batch: SequenceBatch) -> LossDenominators:
    """Valid tokens and sequences of the whole mini-batch (every rank holds all of it)."""
    if "response_mask" not in batch.fields:  # every response has at least one token
        return LossDenominators(torch.tensor(sum(batch.response_lengths)), torch.tensor(len(batch)))
    masks, _ = padded_field(batch.fields["response_mask"])
    masks = masks.bool()
    return LossDenominators(masks.sum(), masks.any(dim=1).sum())


def _field(batch: SequenceBatch, name: str, micro_batch: MicroBatch, device) -> torch.Tensor:
    values, _ = padded_field([batch.fields[name][i] for i in micro_batch.indices],
                             lengths=micro_batch.response_lengths)
    return values.to(device)


def _mask(batch: SequenceBatch, micro_batch: MicroBatch, device) -> torch.Tensor:
    mask = padding_mask(micro_batch.response_lengths)
    if "response_mask" in batch.fields:
        mask &= _field(batch, "response_mask", micro_batch, "cpu").bool()
    return mask.to(device)


def policy_head(
    batch: SequenceBatch, config: PolicyLossConfig, *, vocab_size: int, chunk_tokens: int, backward_scale: float,
) -> Head:
    """The actor's loss on the micro-batches of ``batch`` (needs fields ``advantages``; ``ref_logp``
    with a KL loss; optional ``response_mask`` and ``rollout_is_weights``). Without ``old_logp`` the
    batch is on-policy (its only optimizer step, from the weights that scored it): the old log-probs
    are this forward pass's own, detached (ratio 1, the same gradient as a separate pass), and the
    head hands them back as outputs ``logprobs`` and ``entropy``. With ``batch.rollout_correction``
    (bypass mode) each micro-batch's policy loss is corrected for the current policy against
    ``old_logp``, the engine's log-probs (``correct_against_current_policy``): its rejection narrows the
    policy loss's mask (the entropy and KL terms and the denominators keep the batch's, as verl's do), its
    IS weights reach a loss without a ratio only, and its metrics join the head's. With ``batch.distill``
    (on-policy distillation's top-k estimator) the loss adds ``coef`` times the reverse KL to the teacher over its
    top-k ids (fields ``teacher_topk_ids``, ``teacher_topk_logp``; ``rlmega.algos.distill.top_k_distill_loss``),
    aggregated as the policy loss, on the batch's mask."""
    loss_config = config.loss_config()
    policy_loss = loss_config.build()
    bypass = batch.rollout_correction
    denominators = global_denominators(batch)
    aggregation = dict(loss_agg_mode=config.loss_agg_mode, global_denominators=denominators, norm_horizon=config.norm_horizon)

    def head(micro_batch: MicroBatch, output: torch.Tensor) -> HeadResult:
        rows = _scaled_rows(micro_batch, output, batch.logit_scale)
        logp_flat, entropy_flat = _row_logprobs(micro_batch, rows, vocab_size, chunk_tokens)
        device = logp_flat.device
        logp, entropy = split_padded(logp_flat, micro_batch.response_lengths), split_padded(entropy_flat, micro_batch.response_lengths)
        mask = _mask(batch, micro_batch, device)
        rollout_is_weights = (_field(batch, "rollout_is_weights", micro_batch, device)
                              if "rollout_is_weights" in batch.fields else None)
        on_policy = "old_logp" not in batch.fields
        old_logp = logp.detach() if on_policy else _field(batch, "old_logp", micro_batch, device)
        loss_mask, correction_metrics = mask, {}
        if bypass is not None:
            correction = correct_against_current_policy(
                logp, old_logp, mask, bypass, weights_apply=not isinstance(loss_config, RatioLossConfig))
            loss_mask, rollout_is_weights, correction_metrics = (
                correction.response_mask, correction.is_weights, correction.metrics)
        pg_loss, metrics = policy_loss(
            logp, old_logp, _field(batch, "advantages", micro_batch, device), loss_mask,
            PolicyLossContext(global_denominators=denominators, rollout_is_weights=rollout_is_weights),
        )
        metrics.update(correction_metrics)
        summed = {"pg_loss": pg_loss.detach()}
        loss = pg_loss
        if config.entropy_coeff:
            entropy_loss, _ = entropy_bonus(entropy, mask, coef=config.entropy_coeff, **aggregation)
            loss = loss + entropy_loss
        metrics["entropy"] = masked_mean(entropy.detach(), mask)
        if config.kl_loss_coef:
            kl_term, kl_metrics = kl_loss(
                logp, _field(batch, "ref_logp", micro_batch, device), mask, coef=config.kl_loss_coef,
                estimator=config.kl_estimator, **aggregation,
            )
            loss = loss + kl_term
            metrics.update(kl_metrics)
            summed["kl_loss_term"] = kl_term.detach()
        if batch.distill is not None:
            distill_term, distill_metrics = _top_k_distill(batch, micro_batch, rows, mask, vocab_size, chunk_tokens,
                                                           aggregation)
            loss = loss + distill_term
            metrics.update(distill_metrics)
            summed["distill/top_k_loss_term"] = distill_term.detach()
        summed["loss"] = loss.detach()
        outputs = {"logprobs": logp_flat.detach(), "entropy": entropy_flat.detach()} if on_policy else {}
        return HeadResult(loss=(loss + attached_to_graph(output)) * backward_scale, metrics=metrics, summed=summed,
                          outputs=outputs)

    return head


def critic_head(batch: SequenceBatch, config: CriticLossConfig, *, backward_scale: float) -> Head:
    """The critic's clipped value loss on ``batch`` (needs fields ``values`` (old) and ``returns``)."""
    denominators = global_denominators(batch)

    def head(micro_batch: MicroBatch, output: torch.Tensor) -> HeadResult:
        values = split_padded(_values(micro_batch, output), micro_batch.response_lengths)
        device = values.device
        loss, metrics = clipped_value_loss(
            values, _field(batch, "values", micro_batch, device), _field(batch, "returns", micro_batch, device),
            _mask(batch, micro_batch, device), cliprange_value=config.cliprange_value,
            loss_agg_mode=config.loss_agg_mode, global_denominators=denominators,
        )
        return HeadResult(
            loss=(loss + attached_to_graph(output)) * backward_scale, metrics=metrics, summed={"vf_loss": loss.detach()},
        )

    return head


def sft_head(batch: SequenceBatch, *, vocab_size: int, chunk_tokens: int, backward_scale: float) -> Head:
    """Supervised fine-tuning: mean negative log-likelihood of the response tokens over the mini-batch."""
    denominators = global_denominators(batch)

    def head(micro_batch: MicroBatch, output: torch.Tensor) -> HeadResult:
        logp_flat, _ = _logprobs(micro_batch, output, vocab_size, chunk_tokens)
        if "response_mask" in batch.fields:  # an agent's demonstration: tool output and glue are not trained on
            mask = torch.cat([batch.fields["response_mask"][i] for i in micro_batch.indices]).to(logp_flat)
            logp_flat = logp_flat * mask
        loss = -logp_flat.sum() / denominators.num_tokens.clamp(min=1)
        return HeadResult(loss=(loss + attached_to_graph(output)) * backward_scale, summed={"sft_loss": loss.detach()})

    return head
