"""Responses from the engines: one generation per response, or the agent loop's multi-turn trajectories, with
the sampling parameters of each use (a step's rounds, an asynchronous request, ReMax's greedy baseline,
validation) and the seeds that make a run repeat exactly.

    generator = GeneratorConfig(...).build(tokenizer)
    generations = generator.generate(engines, records, generator.step_params(step, round_index=0))
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Protocol, Sequence

from rlmega.agent.config import AgentConfig
from rlmega.gateway.config import GatewayConfig
from rlmega.data.schema import PromptRecord
from rlmega.errors import UserError
from rlmega.rollout.protocol import Generation, SamplingParams


class Generator(Protocol):
    """What the prompt side needs from the engines (``RolloutGroup`` or a fake)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]: ...


@dataclasses.dataclass
class GeneratorConfig:
    temperature: float
    """``rollout.temperature``: the training rollouts' sampling temperature."""
    top_p: float
    """``rollout.top_p`` (sampled responses only)."""
    top_k: Optional[int]
    """``rollout.top_k`` (sampled responses only)."""
    max_new_tokens: int
    """``rollout.max_new_tokens``: tokens per engine request."""
    n: int
    """``rollout.n``: responses per prompt."""
    seed: int
    """``trainer.seed``: every request's seed derives from it."""
    agent: Optional[AgentConfig]
    """``agent`` when ``agent.enabled``, else None: one generation per response."""
    use_chat_template: bool
    """``data.use_chat_template`` (the agent loop requires it)."""
    chat_template_kwargs: dict
    """``data.chat_template_kwargs``, for the agent loop's turns."""
    gateway: Optional[GatewayConfig] = None
    """``gateway`` when ``gateway.enabled``: every response made by the agent harness through the gateway."""

    def build(self, tokenizer: Any) -> ResponseGenerator:
        agent = None
        stop_token_ids = (tokenizer.eos_token_id,)
        if self.gateway is not None:
            from rlmega.gateway.harness import HarnessLoop

            agent = HarnessLoop(self.gateway, tokenizer, stop_token_ids=stop_token_ids)
        elif self.agent is not None:
            from rlmega.agent.loop import AgentLoop

            if not self.use_chat_template:
                raise UserError("agent.enabled: needs data.use_chat_template=true (tool outputs follow the chat "
                                "template)")
            agent = AgentLoop(self.agent, tokenizer, stop_token_ids=stop_token_ids,
                              chat_template_kwargs=self.chat_template_kwargs)
        return ResponseGenerator(self, stop_token_ids, agent)


class ResponseGenerator:
    """Generates responses to prompt records, through the agent loop when there is one."""

    def __init__(self, config: GeneratorConfig, stop_token_ids: tuple[int, ...], agent=None):
        self.config = config
        self.stop_token_ids = stop_token_ids
        self.agent = agent
        """With ``agent.enabled``, the multi-turn loop (``rlmega.agent``) that produces every response; with
        ``gateway.enabled``, the agent harness through the gateway (``rlmega.gateway.harness``)."""

    def generate(self, engines: Generator, records: Sequence[PromptRecord], params: SamplingParams) -> list[Generation]:
        """``params.n`` responses per record, prompt-major: one generation each, or the agent loop's trajectories."""
        if self.agent is not None:
            return self.agent.run(engines, records, params)
        prompts = [record.prompt_token_ids for record in records]
        if any(record.images is not None for record in records):
            return engines.generate(prompts, params, images=[record.images for record in records])
        return engines.generate(prompts, params)

    def sampling_params(self, *, temperature: float, n: int, seed: Optional[int]) -> SamplingParams:
        """``n`` responses per prompt at ``temperature``, with the training rollouts' top-p and top-k."""
        return self.filtered_params(temperature=temperature, top_p=self.config.top_p, top_k=self.config.top_k, n=n,
                                    seed=seed)

    def filtered_params(self, *, temperature: float, top_p: float, top_k: Optional[int], n: int,
                        seed: Optional[int]) -> SamplingParams:
        """``n`` responses per prompt at ``temperature`` with this ``top_p`` and ``top_k`` (None: no top-k); a
        greedy request (temperature 0) filters nothing."""
        sampled = temperature > 0
        return SamplingParams(temperature=temperature, top_p=top_p if sampled else 1.0,
                              top_k=top_k if sampled else None, max_new_tokens=self.config.max_new_tokens,
                              stop_token_ids=self.stop_token_ids, n=n, seed=seed)

    def step_params(self, step: int, round_index: int) -> SamplingParams:
        """``rollout.n`` responses per prompt of a step's generation round, seeded by the step and the round."""
        seed = (self.config.seed * 1_000_003 + step * 7_919 + round_index * 104_729) % (2**31)
        return self.sampling_params(temperature=self.config.temperature, n=self.config.n, seed=seed)

    def greedy_params(self) -> SamplingParams:
        """One greedy response per prompt (ReMax's baseline)."""
        return self.sampling_params(temperature=0.0, n=1, seed=None)

    def request_params(self, draw: int, sample: int, segment: int, generated: int) -> SamplingParams:
        """One response of an asynchronous run: the ``sample``-th response to the ``draw``-th prompt drawn, in its
        ``segment``-th engine request, continuing after the ``generated`` tokens it already has."""
        base = self.sampling_params(temperature=self.config.temperature, n=1, seed=None)
        seed = (self.config.seed * 1_000_003 + draw * 7_919 + sample * 104_729 + segment * 15_485_863) % (2**31)
        return dataclasses.replace(base, max_new_tokens=base.max_new_tokens - generated, seed=seed)

    def close(self) -> None:
        """End the agent loop's tool workers, if any."""
        if self.agent is not None:
            self.agent.close()
