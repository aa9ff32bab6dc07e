"""The ``reward_model`` component: a discriminative reward model's score of prompt + response.

The model itself (``SequenceScorer``) runs elsewhere: on Megatron ranks of its own in a run
(``rlmega.trainer.roles.RewardModelGroup``), or any object with the same two methods. This part builds
its input. When the reward model's tokenizer and chat template are the policy's, the token ids the
policy saw and produced are scored as they are. When they differ, the response is decoded and the
prompt's messages plus the response (as the assistant's message) are rendered with the reward model's
chat template and tokenised by its tokenizer, as verl does when ``reward_model.model.input_tokenizer``
differs. The score is read at the last token that is not a pad token (``MegatronWorker.compute_scores``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional, Protocol

from rlmega.rewards.pool import Outcome
from rlmega.rewards.scorer import ScoreItem

if TYPE_CHECKING:
    import torch

    from rlmega.workers.batching import SequenceBatch


class SequenceScorer(Protocol):
    """A reward model: one score per whole sequence."""

    def score(self, batch: SequenceBatch) -> torch.Tensor: ...
    def shutdown(self) -> None: ...


def same_tokenization(tokenizer: Any, other: Any) -> bool:
    """Whether two tokenizers turn the same chat into the same ids: equal vocabularies, special tokens and
    chat templates."""
    specials = ("bos_token_id", "eos_token_id", "pad_token_id")
    return (tokenizer.get_vocab() == other.get_vocab() and tokenizer.chat_template == other.chat_template
            and all(getattr(tokenizer, name) == getattr(other, name) for name in specials))


class RewardModelScorer:
    """Scores items with ``model``; ``retokenize`` picks the input (see the module). Items whose input
    cannot be built fail alone; a model call that raises fails the batch (the manager counts both)."""

    def __init__(self, model: SequenceScorer, tokenizer: Any, *, retokenize: bool,
                 chat_template_kwargs: Optional[dict] = None):
        self.model, self.tokenizer, self.retokenize = model, tokenizer, retokenize
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    def input_ids(self, item: ScoreItem) -> list[int]:
        """The reward model's token ids for one item."""
        if not self.retokenize:
            if item.prompt_token_ids is None or item.response_token_ids is None:
                raise ValueError("the item carries no token ids to score")
            return list(item.prompt_token_ids) + list(item.response_token_ids)
        if item.messages is None:
            raise ValueError("the item carries no prompt messages to render with the reward model's template")
        chat = [*item.messages, {"role": "assistant", "content": item.solution_str}]
        text = self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False,
                                                  **self.chat_template_kwargs)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def score_items(self, items: Sequence[ScoreItem]) -> list[Outcome]:
        import torch

        from rlmega.workers.batching import SequenceBatch

        outcomes: list[Optional[Outcome]] = [None] * len(items)
        sequences, scored = [], []
        for index, item in enumerate(items):
            try:
                ids = self.input_ids(item)
                if len(ids) < 2:
                    raise ValueError(f"{len(ids)} tokens to score; a sequence needs at least 2")
            except Exception as error:  # noqa: BLE001 - one item's input failing is that item's error
                outcomes[index] = Outcome("error", message=f"{type(error).__name__}: {error}")
                continue
            sequences.append(torch.tensor(ids, dtype=torch.long))
            scored.append(index)
        if sequences:
            # The score reads the whole sequence; the prompt length only has to be valid.
            scores = self.model.score(SequenceBatch(sequences, [len(s) - 1 for s in sequences]))
            for index, score in zip(scored, scores.tolist(), strict=True):
                outcomes[index] = (Outcome("ok", score=float(score)) if math.isfinite(score)
                                   else Outcome("error", message=f"the reward model scored {score}"))
        return outcomes

    def close(self) -> None:
        self.model.shutdown()
