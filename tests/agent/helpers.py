"""Fakes for the agent loop: a generator that answers from a script, tools that answer without processes, and
a BPE tokenizer with a Qwen-style chat template on which decoding and encoding again changes the tokens."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

from rlmega.agent.parsers import ToolCall
from rlmega.agent.tools import ToolResult
from rlmega.data.schema import PromptRecord
from rlmega.rollout.protocol import Generation, SamplingParams


def logprob_of(position: int, token: int) -> float:
    """The fake engine's log-prob of a token: distinct per token so that misaligned copies show."""
    return -0.001 * (position + 1) - 0.01 * token


class ScriptedGenerator:
    """Answers each context with ``respond(context_ids, call_index) -> response ids`` (stop token included when
    the turn ends with one); records every call's contexts and parameters."""

    def __init__(self, respond: Callable[[list[int], int], list[int]], stop_token_ids: Sequence[int]):
        self.respond, self.stop_token_ids = respond, tuple(stop_token_ids)
        self.calls: list[tuple[list[list[int]], SamplingParams]] = []
        self.outputs: list[list[list[int]]] = []

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        assert params.n == 1
        self.calls.append(([list(p) for p in prompts], params))
        generations, outputs = [], []
        for index, prompt in enumerate(prompts):
            tokens = list(self.respond(prompt, len(self.calls) - 1))[:params.max_new_tokens]
            finish = "stop" if tokens and tokens[-1] in self.stop_token_ids else "length"
            logprobs = [logprob_of(len(prompt) + t, token) for t, token in enumerate(tokens)]
            generations.append(Generation(index, tokens, logprobs, finish, weight_version=3))
            outputs.append(tokens)
        self.outputs.append(outputs)
        return generations


@dataclasses.dataclass
class FakeTools:
    """Tools in the calling process: ``answers`` maps a tool name to a function of the arguments."""

    answers: dict[str, Callable[..., str]]
    schemas: list[dict] = dataclasses.field(default_factory=list)
    calls: list[ToolCall] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.schemas = [{"type": "function", "function": {"name": name, "description": name,
                                                          "parameters": {"type": "object", "properties": {}}}}
                        for name in self.answers]

    def run(self, calls):
        results = []
        for call in calls:
            self.calls.append(call)
            if call.error is not None:
                results.append(ToolResult(f"Error: {call.error}", "error"))
            elif call.name == "slow":
                results.append(ToolResult("Error: the tool call timed out after 1 s", "timeout"))
            else:
                try:
                    results.append(ToolResult(self.answers[call.name](**call.arguments)))
                except Exception as error:
                    results.append(ToolResult(f"Error: {error}", "error"))
        return results

    def close(self):
        pass


def record(text: str, index: int = 0, ground_truth="8") -> PromptRecord:
    return PromptRecord(index=index, prompt_token_ids=[], messages=[{"role": "user", "content": text}],
                        data_source="arithmetic", ground_truth=ground_truth)


QWEN_STYLE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    "\n</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

MERGES = [("1", "2"), ("3", "4"), ("a", "l"), ("c", "al"), ("t", "o"), ("to", "o"), ("too", "l"), ("<", "tool")]


def bpe_tokenizer(directory: Optional[str] = None):
    """A byte-pair tokenizer (printable ASCII and newline, a few merges such as ``1 2 -> 12``) with a Qwen-style
    template; saved and reloaded with ``AutoTokenizer`` when ``directory`` is given."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {"<unk>": 0}
    for character in ["\n"] + [chr(code) for code in range(32, 127)]:
        vocab[character] = len(vocab)
    for left, right in MERGES:
        vocab[left + right] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=MERGES, unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"],
                                        clean_up_tokenization_spaces=False)
    tokenizer.chat_template = QWEN_STYLE_TEMPLATE
    if directory is None:
        return tokenizer
    tokenizer.save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)
