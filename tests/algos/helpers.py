"""Shared test utilities: seeded random batches, a loop-based reference aggregation, hypothesis settings."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import settings
from hypothesis import strategies as st

# database=None: the repo is shared, so hypothesis must not write a .hypothesis/ folder into it.
PROPERTY_SETTINGS = settings(max_examples=30, deadline=None, database=None)

AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
PPO_FAMILY = ["ppo", "vanilla", "clip_higher", "dual_clip", "gspo", "cispo"]
ALL_POLICY_LOSSES = [*PPO_FAMILY, "gpg", "reinforce", "sapo", "geo_mean", "clip_cov", "kl_cov"]
# Clip-Cov and KL-Cov pick tokens by a covariance over the tokens of each call (micro-batch), so
# their loss depends on how the batch is split: they are exempt from split-invariance.
PER_CALL_SELECTION = ["clip_cov", "kl_cov"]
# Losses that clip a ratio and report pg_clipfrac, pg_clipfrac_high and pg_clipfrac_low.
RATIO_CLIPPING_LOSSES = [*PPO_FAMILY, "geo_mean", "clip_cov"]

# (seed, batch size, number of token columns)
batch_shapes = st.tuples(st.integers(0, 2**31 - 1), st.integers(1, 6), st.integers(1, 7))


@dataclass
class Batch:
    logp: torch.Tensor
    old_logp: torch.Tensor
    ref_logp: torch.Tensor
    advantages: torch.Tensor
    values: torch.Tensor
    rewards: torch.Tensor
    scores: torch.Tensor
    mask: torch.Tensor  # float64 0/1, with holes and possibly empty rows


def make_batch(seed: int, batch_size: int, num_tokens: int, log_ratio_scale: float = 0.5) -> Batch:
    generator = torch.Generator().manual_seed(seed)

    def normal(scale: float = 1.0) -> torch.Tensor:
        return torch.randn(batch_size, num_tokens, generator=generator, dtype=torch.float64) * scale

    old_logp = -torch.rand(batch_size, num_tokens, generator=generator, dtype=torch.float64) * 3
    mask = (torch.rand(batch_size, num_tokens, generator=generator) < 0.7).to(torch.float64)
    return Batch(
        logp=old_logp + normal(log_ratio_scale),
        old_logp=old_logp,
        ref_logp=old_logp + normal(log_ratio_scale),
        advantages=normal(),
        values=normal(),
        rewards=normal(),
        scores=torch.randn(batch_size, generator=generator, dtype=torch.float64),
        mask=mask,
    )


def policy_loss_extras(loss_name: str, seed: int = 0) -> dict:
    """Keyword arguments a loss needs to be deterministic: Clip-Cov's random draw gets a seeded generator."""
    return {"generator": torch.Generator().manual_seed(seed)} if loss_name == "clip_cov" else {}


def garbage_like(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    """Large random values to write into padded positions."""
    generator = torch.Generator().manual_seed(seed + 1)
    return torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype) * 1e3


def with_padding(tensor: torch.Tensor, mask: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), tensor, padding)


def reference_aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, horizon: float) -> float:
    """Plain-Python restatement of the aggregation modes (independent of the code under test)."""
    rows = []
    for i in range(values.shape[0]):
        valid = [float(values[i, t]) for t in range(values.shape[1]) if mask[i, t] != 0]
        if valid:
            rows.append(valid)
    if not rows:
        return 0.0
    total = sum(sum(row) for row in rows)
    if mode == "token-mean":
        return total / sum(len(row) for row in rows)
    if mode == "seq-mean-token-sum":
        return total / len(rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(row) / len(row) for row in rows) / len(rows)
    if mode == "seq-mean-token-sum-norm":
        return total / (len(rows) * horizon)
    raise AssertionError(mode)


def split_rows(seed: int, batch_size: int, num_pieces: int) -> list[torch.Tensor]:
    """Randomly permute the rows and cut them into ``num_pieces`` (possibly empty) pieces."""
    generator = torch.Generator().manual_seed(seed + 2)
    order = torch.randperm(batch_size, generator=generator)
    cuts = sorted(torch.randint(0, batch_size + 1, (num_pieces - 1,), generator=generator).tolist())
    bounds = [0, *cuts, batch_size]
    return [order[start:end] for start, end in zip(bounds[:-1], bounds[1:])]


def trimmed_width(mask: torch.Tensor) -> int:
    """Columns a micro-batch would be padded to: up to its last valid token (at least 1)."""
    valid_columns = mask.bool().any(dim=0).nonzero()
    return int(valid_columns.max()) + 1 if valid_columns.numel() else 1
