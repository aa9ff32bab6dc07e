"""A harness for the quickstart's task, written as any ``openai`` client would be: what ``gateway.harness`` names."""

from __future__ import annotations

from typing import Optional


def single_turn(base_url: str, example: dict) -> Optional[float]:
    """Ask the policy the prompt's question in one chat call; the run's reward function scores the answer."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    client.chat.completions.create(model="policy", messages=example["messages"])
    return None
