"""An engine that plays demonstrations instead of sampling, for the supervised warm-start of a run through the
gateway (``gateway.demonstration``): the harness runs as in a rollout, and where the policy would answer, the
engine answers with the demonstrated turn, so the warm-start's sequences are the gateway's own trajectories
(the harness's tool results and the template's glue included), token for token.

A call is answered from what it reads, as an engine would: the first call on a prompt gets the prompt's first turn,
a call that continues a context this engine answered gets the next turn, and a call past the last turn the stop
token alone.
"""

from __future__ import annotations

from typing import Any, Sequence

from rlmega.rollout.protocol import Generation, SamplingParams


class DemonstrationEngine:
    """``generate(prompts, params)`` like an engine's; ``add(prompt_ids, texts)`` before the harness runs."""

    def __init__(self, tokenizer: Any, stop_token_ids: Sequence[int]):
        self.tokenizer, self.stop_token_ids = tokenizer, tuple(stop_token_ids)
        self._scripts: dict[tuple[int, ...], tuple[list[list[int]], int]] = {}
        """A context this engine expects (a prompt, or a context it answered followed by its answer) -> the
        demonstration's turns as ids and the turn that comes next."""

    def add(self, prompt_ids: Sequence[int], texts: Sequence[str]) -> None:
        """The demonstrated assistant turns for a prompt: each tokenised and ended with the stop token."""
        turns = [self.tokenizer.encode(text, add_special_tokens=False) + [self.stop_token_ids[0]] for text in texts]
        self._scripts[tuple(prompt_ids)] = (turns, 0)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        generations = []
        for index, context in enumerate(prompts):
            turns, turn = self._script_of(context)
            tokens = turns[turn] if turn < len(turns) else [self.stop_token_ids[0]]
            self._scripts[tuple(context) + tuple(tokens)] = (turns, turn + 1)
            generations.append(Generation(index, list(tokens), [0.0] * len(tokens), "stop", weight_version=0))
        return generations

    def _script_of(self, context: list[int]) -> tuple[list[list[int]], int]:
        for length in range(len(context), 0, -1):  # the longest expected context the call continues
            script = self._scripts.get(tuple(context[:length]))
            if script is not None:
                return script
        raise ValueError("the harness's call does not start with a prompt being demonstrated (does it change the "
                         "dataset's messages, e.g. add a system prompt?); the demonstration answers the dataset's "
                         "prompts")
