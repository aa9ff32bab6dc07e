"""Token in, token out: on a byte-pair tokenizer where decoding the engine's tokens and encoding the text again
gives other tokens, the trained sequence is exactly what the engine consumed and produced, turn after turn."""

import pytest

from rlmega.agent.builtin import calculator
from rlmega.agent.config import AgentConfig
from rlmega.agent.loop import AgentLoop
from rlmega.agent.tools import ToolBox, schema_of
from rlmega.rollout.protocol import SamplingParams

from .helpers import ScriptedGenerator, bpe_tokenizer, logprob_of, record

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
ANSWER = "12*34 = 408, so the total is 408."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return bpe_tokenizer(str(tmp_path_factory.mktemp("bpe")))


def by_character(tokenizer, text: str) -> list[int]:
    """One token per character: what a sampling engine may well produce, and not what encoding the text gives."""
    return [tokenizer.convert_tokens_to_ids(character) for character in text]


@pytest.fixture(scope="module")
def run(tokenizer):
    eos = tokenizer.eos_token_id
    script = [by_character(tokenizer, CALL) + [eos], by_character(tokenizer, ANSWER) + [eos]]
    generator = ScriptedGenerator(lambda context, call: script[call], [eos])
    with ToolBox(["calculator"], num_workers=1, timeout_s=5.0, memory_mb=512, max_output_chars=100) as tools:
        agent = AgentLoop(AgentConfig(enabled=True, max_turns=3, max_response_tokens=500), tokenizer,
                          stop_token_ids=[eos], tools=tools)
        trajectory = agent.run(generator, [record("What is 12*34?")],
                               SamplingParams(max_new_tokens=200, stop_token_ids=(eos,)))[0]
    return generator, trajectory


def test_the_setting_differs_under_re_tokenisation(tokenizer):
    policy = by_character(tokenizer, CALL)
    assert tokenizer.encode(tokenizer.decode(policy), add_special_tokens=False) != policy


def test_trained_sequence_is_what_the_engine_saw(tokenizer, run):
    generator, trajectory = run
    sequence = trajectory.prompt_token_ids + trajectory.response_token_ids
    assert (trajectory.num_turns, trajectory.num_tool_calls, trajectory.stop_reason) == (2, 1, "answered")
    # Each turn's input is a prefix of the trained sequence, and each turn's output follows it there.
    for (contexts, _), outputs in zip(generator.calls, generator.outputs):
        context, output = contexts[0], outputs[0]
        assert sequence[:len(context)] == context
        assert sequence[len(context):len(context) + len(output)] == output
    assert sequence == generator.calls[-1][0][0] + generator.outputs[-1][0]
    # The policy's tokens, in order, are exactly the engine's outputs; everything else is masked.
    own = [token for token, mask in zip(trajectory.response_token_ids, trajectory.loss_mask) if mask]
    assert own == generator.outputs[0][0] + generator.outputs[1][0]
    prompt = len(trajectory.prompt_token_ids)
    assert trajectory.logprobs == [logprob_of(prompt + t, token) if mask else 0.0 for t, (token, mask) in
                                   enumerate(zip(trajectory.response_token_ids, trajectory.loss_mask))]
    # Re-tokenising the conversation's text, as a text-in pipeline would, gives another sequence.
    text = tokenizer.decode(sequence, skip_special_tokens=False)
    assert tokenizer.encode(text, add_special_tokens=False) != sequence


def test_prompt_lists_the_tools_and_glue_follows_the_template(tokenizer, run):
    _, trajectory = run
    prompt = tokenizer.decode(trajectory.prompt_token_ids, skip_special_tokens=False)
    assert prompt.startswith("<|im_start|>system\n# Tools\n<tools>") and '"name": "calculator"' in prompt
    assert prompt.endswith("<|im_start|>user\nWhat is 12*34?<|im_end|>\n<|im_start|>assistant\n")
    glue = [token for token, mask in zip(trajectory.response_token_ids, trajectory.loss_mask) if not mask]
    assert tokenizer.decode(glue, skip_special_tokens=False) == (
        "\n<|im_start|>user<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # The text of the whole trajectory is the template's rendering of its conversation.
    messages = [{"role": "user", "content": "What is 12*34?"}, {"role": "assistant", "content": CALL},
                {"role": "tool", "content": "408"}, {"role": "assistant", "content": ANSWER}]
    rendered = tokenizer.apply_chat_template(messages, tools=[schema_of(calculator)], tokenize=False)
    # (the template ends the last turn with a newline; the engine stopped at its end-of-turn token)
    assert tokenizer.decode(trajectory.prompt_token_ids + trajectory.response_token_ids,
                            skip_special_tokens=False) == rendered.removesuffix("\n")


def test_glue_when_the_template_re_renders_earlier_turns():
    """A template that hides an assistant turn's text once later messages follow (as Qwen3's drops earlier
    reasoning): the new messages are rendered after a stand-in turn instead."""
    from rlmega.agent.template import ChatTokens
    from rlmega.data import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = (
        "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>"
        "{% if message['role'] == 'assistant' and not loop.last %}...{% else %}{{ message['content'] }}{% endif %}"
        "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    chat = ChatTokens(tokenizer, tools=None, stop_token_ids=[tokenizer.eos_token_id])
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "thinking, then a call"}]
    glue = chat.glue_ids(history, [{"role": "tool", "content": "42"}])
    assert tokenizer.decode(glue, skip_special_tokens=False) == "<|tool|>42<eos><|assistant|>"
