"""One step's rollouts: prompts from the sampler, n responses each, scored; DAPO's dynamic sampling
(drop groups whose scores are all equal, generate more) and overlong shaping / filtering."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from rlmega import algos
from rlmega.workers.batching import SequenceBatch


@dataclasses.dataclass
class Rollouts:
    batch: SequenceBatch
    """prompt + response token sequences, grouped by prompt (n consecutive sequences per group)."""
    scores: torch.Tensor
    """``[B]`` scores after reward shaping."""
    group_ids: list[int]
    response_mask: Optional[list[torch.Tensor]]
    """Per-token loss mask when overlong filtering zeroes some responses; None when all tokens count."""
    metrics: dict[str, float]


def _seed(base: int, step: int, round_index: int) -> int:
    return (base * 1_000_003 + step * 7_919 + round_index * 104_729) % (2**31)


def generate_rollouts(trainer, step: int) -> Rollouts:
    """Generate and score responses until the step has ``prompts_per_step`` usable groups (DAPO's
    dynamic sampling may take several rounds), or the round limit is reached."""
    from rlmega.rewards import ScoreItem
    from rlmega.rollout.protocol import SamplingParams

    config = trainer.config
    rollout, algorithm = config.rollout, config.algorithm
    wanted = config.trainer.prompts_per_step
    kept: list[tuple] = []  # (record, generations, scores, reward metrics) per kept group
    rounds = algorithm.max_generation_rounds if algorithm.dynamic_sampling else 1
    all_scores, all_lengths, num_truncated, reward_metrics, dropped = [], [], 0, {}, 0
    for round_index in range(rounds):
        records = trainer.dataset.batch(trainer.sampler.next_batch())
        params = SamplingParams(
            temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
            max_new_tokens=rollout.max_new_tokens, stop_token_ids=trainer.stop_token_ids, n=rollout.n,
            seed=_seed(config.trainer.seed, step, round_index),
        )
        generations = trainer.rollout.generate([record.prompt_token_ids for record in records], params)
        texts = [trainer.tokenizer.decode(g.response_token_ids, skip_special_tokens=True) for g in generations]
        items = [ScoreItem.from_record(records[g.prompt_index], text) for g, text in zip(generations, texts)]
        scores, reward_metrics = trainer.scorer.score_batch(items)
        scores = torch.tensor(scores, dtype=torch.float32)
        lengths = torch.tensor([len(g.response_token_ids) for g in generations])
        all_scores.append(scores.clone())
        all_lengths.append(lengths)
        num_truncated += sum(g.finish_reason == "length" for g in generations)
        if algorithm.overlong_buffer_length:
            scores = scores + algos.overlong_reward_penalty(
                lengths, max_response_length=rollout.max_new_tokens,
                overlong_buffer_length=algorithm.overlong_buffer_length, penalty_factor=algorithm.overlong_penalty_factor)
        group_ids = [g.prompt_index for g in generations]
        keep = range(len(records))
        if algorithm.dynamic_sampling:
            result = algos.dynamic_sampling_filter(torch.tensor(group_ids), scores)
            keep = sorted({group_ids[i] for i in result.kept_indices.tolist()})
            dropped += result.num_dropped_groups
        for prompt_index in keep:
            members = [i for i, g in enumerate(group_ids) if g == prompt_index]
            kept.append((records[prompt_index], [generations[i] for i in members], scores[members]))
        if len(kept) >= wanted:
            break
    kept = kept[:wanted] if len(kept) >= wanted else kept
    if not kept:
        raise RuntimeError(
            f"step {step}: every prompt group had equal scores in {rounds} generation rounds, nothing to train on; "
            "raise algorithm.max_generation_rounds or rollout.n, or turn off algorithm.dynamic_sampling"
        )
    tokens, prompts, scores, group_ids, masks = [], [], [], [], []
    for group, (record, generations, group_scores) in enumerate(kept):
        for generation, score in zip(generations, group_scores):
            tokens.append(torch.tensor(record.prompt_token_ids + generation.response_token_ids))
            prompts.append(len(record.prompt_token_ids))
            scores.append(float(score))
            group_ids.append(group)
            truncated = algorithm.filter_truncated and generation.finish_reason == "length"
            masks.append(torch.full((len(generation.response_token_ids),), 0.0 if truncated else 1.0))
    raw_scores, lengths = torch.cat(all_scores), torch.cat(all_lengths).float()
    metrics = {
        "critic/score/mean": float(raw_scores.mean()), "critic/score/max": float(raw_scores.max()),
        "critic/score/min": float(raw_scores.min()),
        "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()), "response_length/clip_ratio": num_truncated / len(lengths),
        "batch/generation_rounds": float(round_index + 1), "batch/dropped_groups": float(dropped),
        "batch/num_sequences": float(len(tokens)),
    }
    metrics.update({name if "/" in name else f"reward/{name}": value for name, value in reward_metrics.items()})
    return Rollouts(
        batch=SequenceBatch(tokens, prompts), scores=torch.tensor(scores), group_ids=group_ids,
        response_mask=masks if algorithm.filter_truncated else None, metrics=metrics,
    )
