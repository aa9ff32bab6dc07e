"""The ``judge`` component: a generative judge, a rollout engine with a model of its own, asked to grade
each response; its answer is parsed into a score.

The judge's prompt is ``judge.prompt_template`` filled in with the item's ``{question}`` (the last user
message of the prompt), ``{response}``, ``{ground_truth}`` and ``{data_source}``, given as one user
message through the judge tokenizer's chat template (or as it is). The engine answers (greedily by
default); ``parser(text)`` turns the decoded answer into a score: a number, or a dict with a numeric
``score`` (as a reward function may return). A parser that raises, or returns no finite score, fails
that item alone (0, counted); an engine that fails fails the batch.

The engine is any ``generate(prompts, params)`` (a ``RolloutGroup`` of any backend in a run); on its
own resources it grades one batch while the policy's engines generate the next (asynchronous modes).
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from rlmega.rewards.pool import Outcome
from rlmega.rewards.scorer import ScoreItem
from rlmega.rewards.user_function import as_score

if TYPE_CHECKING:
    from rlmega.rollout.protocol import Generation, SamplingParams

TEMPLATE_FIELDS = ("question", "response", "ground_truth", "data_source")

DEFAULT_TEMPLATE = (
    "Grade the response to the question against the reference answer.\n"
    "Question: {question}\nReference answer: {ground_truth}\nResponse: {response}\n"
    "Reply with a single number from 0 (wrong) to 1 (right)."
)


class JudgeEngines(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]: ...
    def shutdown(self) -> None: ...


def first_number(text: str) -> float:
    """The default parser: the first number in the judge's answer (``"Score: 0.8"`` -> 0.8); ValueError
    when there is none."""
    found = re.search(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?", text)
    if found is None:
        raise ValueError(f"no number in the judge's answer {text[:80]!r}")
    return float(found.group())


def check_template(template: str) -> None:
    """ValueError naming a ``{field}`` of ``template`` that is not one of ``TEMPLATE_FIELDS`` (or a
    template that does not parse as a format string)."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as error:
        raise ValueError(f"not a format string ({error}); write literal braces as {{{{ and }}}}") from None
    unknown = [name for name in names if name not in TEMPLATE_FIELDS]
    if unknown:
        raise ValueError(f"unknown field {{{unknown[0]}}}; use any of "
                         + ", ".join(f"{{{name}}}" for name in TEMPLATE_FIELDS))


def question_of(item: ScoreItem) -> str:
    """The question a judge sees: the content of the prompt's last user message."""
    users = [message["content"] for message in item.messages or () if message.get("role") == "user"]
    return users[-1] if users else ""


class JudgeScorer:
    """Grades items with ``engines`` (see the module); ``parser`` maps the judge's text to a score."""

    def __init__(self, engines: JudgeEngines, tokenizer: Any, *, template: str = DEFAULT_TEMPLATE,
                 parser: Callable[[str], Any] = first_number, max_new_tokens: int = 16, temperature: float = 0.0,
                 use_chat_template: bool = True, seed: Optional[int] = None):
        check_template(template)
        self.engines, self.tokenizer, self.template, self.parser = engines, tokenizer, template, parser
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed
        self.use_chat_template = use_chat_template and getattr(tokenizer, "chat_template", None) is not None
        self.last_texts: list[str] = []
        """The judge's answers to the last batch (for inspection and tests)."""

    def prompt_ids(self, item: ScoreItem) -> list[int]:
        text = self.template.format(question=question_of(item), response=item.solution_str,
                                    ground_truth=item.ground_truth, data_source=item.data_source)
        if not self.use_chat_template:
            return list(self.tokenizer(text)["input_ids"])
        rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
        return list(self.tokenizer(rendered, add_special_tokens=False)["input_ids"])

    def score_items(self, items: Sequence[ScoreItem]) -> list[Outcome]:
        from rlmega.rollout.protocol import SamplingParams

        if not items:
            return []
        params = SamplingParams(temperature=self.temperature, max_new_tokens=self.max_new_tokens,
                                stop_token_ids=(self.tokenizer.eos_token_id,), n=1, seed=self.seed)
        generations = sorted(self.engines.generate([self.prompt_ids(item) for item in items], params),
                             key=lambda generation: generation.prompt_index)
        if [g.prompt_index for g in generations] != list(range(len(items))):
            raise RuntimeError(f"the judge answered {len(generations)} of {len(items)} prompts")
        self.last_texts = [self.tokenizer.decode(g.response_token_ids, skip_special_tokens=True)
                           for g in generations]
        return [self._parse(text) for text in self.last_texts]

    def _parse(self, text: str) -> Outcome:
        try:
            score, extras = as_score(self.parser(text))
        except Exception as error:  # noqa: BLE001 - a parser that raises fails this item alone
            return Outcome("error", message=f"parser: {type(error).__name__}: {error}")
        return Outcome("ok", score=score, extras=extras)

    def close(self) -> None:
        self.engines.shutdown()
