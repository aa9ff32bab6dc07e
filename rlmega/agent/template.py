"""Token ids from the chat template, for a trajectory that is only ever extended, never re-tokenised.

The prompt is rendered once (with ``tools=`` so the template describes them). After a policy turn, the messages
that follow it (tool outputs, an environment's observation) are rendered as the template would render them after
that turn, and only that new text is tokenised and appended: the template's text of the whole conversation
before and after the new messages differ by a suffix, and what the template puts after the turn's end-of-turn
token (Qwen: a newline) is added in front of it. The policy's own tokens stay exactly as the engine produced them.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from rlmega.errors import UserError

Message = dict[str, Any]


class ChatTokens:
    def __init__(self, tokenizer: Any, *, tools: Optional[list[dict]], stop_token_ids: Sequence[int],
                 chat_template_kwargs: Optional[dict] = None):
        if getattr(tokenizer, "chat_template", None) is None:
            raise UserError("agent.enabled: the tokenizer has no chat template, and the agent loop renders tool "
                            "outputs with it; use a tokenizer with one (model.tokenizer_path)")
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.kwargs = dict(chat_template_kwargs or {})
        self.stop_texts = [tokenizer.decode([token], skip_special_tokens=False) for token in stop_token_ids]

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tools=self.tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **self.kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The conversation's start, with the generation prompt, as the engine's first input."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def glue_ids(self, history: Sequence[Message], new: Sequence[Message]) -> list[int]:
        """The tokens that follow the policy's last turn (``history[-1]``, which ended with a stop token) when
        ``new`` messages come after it, up to and including the next generation prompt."""
        before = self.render(history, add_generation_prompt=False)
        after = self.render([*history, *new], add_generation_prompt=True)
        if not after.startswith(before):  # the template re-renders earlier turns: render the new ones alone
            before, after = self._after_stand_in(new)
        return self.encode(self._after_turn_end(before) + after[len(before):])

    def _after_stand_in(self, new: Sequence[Message]) -> tuple[str, str]:
        """The text before and after ``new`` when they follow a stand-in turn (an empty assistant turn, else an
        empty user message) instead of the real conversation."""
        for stand_in in ([{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
                         [{"role": "user", "content": ""}]):
            before = self.render(stand_in, add_generation_prompt=False)
            after = self.render([*stand_in, *new], add_generation_prompt=True)
            if after.startswith(before):
                return before, after
        raise UserError("agent: the chat template renders a conversation's earlier messages differently once "
                        f"{[m['role'] for m in new]} messages follow, so their tokens cannot be appended")

    def _after_turn_end(self, rendered: str) -> str:
        """What the template writes after the last end-of-turn (stop) token: the engine stopped at that token."""
        ends = [(rendered.rfind(text), text) for text in self.stop_texts if text and text in rendered]
        if not ends:
            return ""
        position, text = max(ends)
        return rendered[position + len(text):]
