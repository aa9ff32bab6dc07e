"""Next-token selection with per-row sampling settings and a random generator per row.

Every row (one response being generated) has its own temperature, top-k, top-p and
``torch.Generator``, so a batch can mix greedy and sampled requests, and a seeded request draws the
same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rlmega.rollout.protocol import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """A bijective 64-bit mixer: nearby inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def request_generator(seed: int | None, prompt_index: int, sample_index: int,
                      device: torch.device) -> torch.Generator:
    """The generator of sample ``sample_index`` of prompt ``prompt_index``.

    Seeded from all three numbers, so the n samples of a prompt differ, a repeated prompt gets
    different samples, and the same call with the same seed repeats exactly. ``seed=None`` draws a
    non-deterministic seed.
    """
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        mixed = _splitmix64(_splitmix64(_splitmix64(seed) ^ prompt_index) ^ sample_index)
        generator.manual_seed(mixed >> 1)  # 63 bits: manual_seed's range
    return generator


UNIFORM_BLOCK = 32
"""Uniform numbers a row takes from its generator at once: the same numbers as drawn one per token (a generator's
stream does not depend on how many it is asked for at a time), in one call per row every 32 tokens instead of one
per row per token (on the tiny CPU job those calls took longer than the sampling itself)."""


@dataclass
class RowSampling:
    """Sampling settings of B rows as tensors on the logits' device, and each row's generator."""

    temperature: torch.Tensor  # [B] float32; 0 means greedy
    top_k: torch.Tensor  # [B] int64; the vocabulary size when disabled
    top_p: torch.Tensor  # [B] float32
    generators: list[torch.Generator]  # [B]
    _ahead: torch.Tensor | None = field(default=None, init=False, repr=False)
    """``[sampled rows, UNIFORM_BLOCK]`` float64: numbers drawn ahead, of which ``_used`` are used."""
    _used: int = field(default=UNIFORM_BLOCK, init=False, repr=False)

    @classmethod
    def build(cls, params: Sequence[SamplingParams], generators: list[torch.Generator], vocab_size: int,
              device: torch.device) -> RowSampling:
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([min(p.top_k or vocab_size, vocab_size) for p in params], device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            generators=generators,
        )

    def next_uniforms(self, rows: list[int]) -> torch.Tensor:
        """``[len(rows)]`` float64: the next uniform number of each of ``rows`` (the sampled rows, the same at every
        call) from its own generator."""
        if self._used == UNIFORM_BLOCK:
            device = self.temperature.device
            self._ahead = torch.stack([torch.rand(UNIFORM_BLOCK, generator=self.generators[row], device=device)
                                       for row in rows]).double()
            self._used = 0
        self._used += 1
        return self._ahead[:, self._used - 1]


def select_next_tokens(logits: torch.Tensor, rows: RowSampling) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row from raw next-token logits [B, V].

    Greedy rows (temperature 0) take the argmax. Sampled rows divide by their temperature, keep their
    top-k logits, then the smallest prefix of that renormalised distribution whose mass reaches
    top-p, and draw from the rest with one uniform number from their own generator (inverse transform
    sampling, in token id order). Ties keep the lowest token id first, so top_k=1 matches greedy.

    Returns ``(tokens [B] int64, logprobs [B] float32)``, where ``logprobs`` is the log-prob of each
    chosen token under ``log_softmax(logits / temperature)`` (the raw logits for greedy rows): the
    distribution the trainer scores the batch under. Top-k / top-p truncation is not in it, as in
    the trainer (and verl, OpenRLHF, slime): it only removes tokens that are rarely drawn anyway.
    """
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    sampled = (rows.temperature > 0).nonzero().flatten()
    if sampled.numel():
        scaled = logits[sampled] / rows.temperature[sampled, None]
        probs = torch.softmax(scaled, dim=-1)
        vocab = scaled.shape[-1]
        filtered = ((rows.top_k[sampled] < vocab) | (rows.top_p[sampled] < 1)).nonzero().flatten()
        if filtered.numel():  # only rows with a filter pay for the sort
            probs[filtered] *= _kept(scaled[filtered], rows.top_k[sampled[filtered]], rows.top_p[sampled[filtered]])
        # One uniform number per row from its own generator; the token is the first, in id order, whose
        # cumulative mass exceeds it (all rows at once). A token of probability 0 adds no mass, so it never is.
        # In float64, u * total stays below the total for every u < 1.
        uniform = rows.next_uniforms(sampled.tolist())
        cumulative = probs.double().cumsum(dim=-1)
        tokens[sampled] = (cumulative <= uniform[:, None] * cumulative[:, -1:]).sum(dim=-1)
    scale = torch.where(rows.temperature > 0, rows.temperature, torch.ones_like(rows.temperature))
    logprobs = torch.log_softmax(logits / scale[:, None], dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs


def _kept(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[R, V] 1 for the tokens each row keeps, else 0: its ``top_k`` largest logits (ties: lowest id first), then
    the smallest prefix of that renormalised distribution whose mass reaches ``top_p``."""
    ranked, order = scaled.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)
    ranked_probs = torch.softmax(ranked.masked_fill(ranks >= top_k[:, None], float("-inf")), dim=-1)
    # top_p == 1 disables the filter outright, so rounding in the cumulative sum cannot drop the tail.
    top_p = torch.where(top_p >= 1, float("inf"), top_p)
    mass_before = ranked_probs.cumsum(dim=-1) - ranked_probs  # exactly 0 at rank 0, which is therefore always kept
    kept = (ranks < top_k[:, None]) & (mass_before < top_p[:, None])
    return torch.zeros_like(scaled).scatter(-1, order, kept.to(scaled.dtype))
