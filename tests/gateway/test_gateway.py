"""The OpenAI-compatible gateway (rlmega.gateway), driven by the real ``openai`` client.

The engine is scripted (tests/agent/helpers.py): it answers with token ids that are not what tokenising its text
again would give (``1`` ``2`` as two tokens, where the tokenizer merges them into ``12``), so a gateway that
re-tokenised the conversation would show. The trajectory the gateway keeps must be, id for id, the prompt the first
call read, then per call the tokens of what came back (masked) and the engine's reply (with its log-probs).
"""

import httpx
import openai
import pytest

from agent.helpers import ScriptedGenerator, bpe_tokenizer, logprob_of
from rlmega.errors import UserError
from rlmega.gateway import Gateway

CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "evaluate arithmetic",
                                               "parameters": {"type": "object",
                                                              "properties": {"expression": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def tokenizer():
    return bpe_tokenizer()


def _ids(tokenizer, text: str) -> list[int]:
    """``text`` as single characters (never merged): what a model may write, unlike the tokenizer."""
    vocab = tokenizer.get_vocab()
    return [vocab[character] for character in text]


@pytest.fixture
def gateway(tokenizer):
    eos = tokenizer.eos_token_id
    replies = [_ids(tokenizer, '<tool_call>{"name": "calculator", "arguments": {"expression": "12+3"}}</tool_call>')
               + [eos], _ids(tokenizer, "It is 15.") + [eos]]
    engine = ScriptedGenerator(lambda context, call: replies[call % 2], stop_token_ids=[eos])
    served = Gateway(engine.generate, tokenizer, stop_token_ids=(eos,), timeout_s=60).serve()
    served.engine = engine
    yield served
    served.close()


def test_a_tool_calling_chat_keeps_the_engines_own_ids(gateway, tokenizer):
    client = openai.OpenAI(base_url=gateway.session_url("s1"), api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is 12+3?"}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR], temperature=0,
                                           logprobs=True)
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    assert (call.function.name, call.function.arguments) == ("calculator", '{"expression": "12+3"}')
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "15"}]
    second = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR], temperature=0)
    assert second.choices[0].message.content == "It is 15." and second.choices[0].finish_reason == "stop"

    (first_context, _), (second_context, _) = gateway.engine.calls
    first_reply, second_reply = gateway.engine.outputs[0][0], gateway.engine.outputs[1][0]
    (segment,) = gateway.sessions.find("s1").segments
    # The second call read exactly the first call's context, the engine's reply, then only the new tokens.
    glue = second_context[0][len(first_context[0]) + len(first_reply):]
    assert second_context[0][:len(first_context[0]) + len(first_reply)] == first_context[0] + first_reply
    assert segment.prompt_ids == first_context[0]
    assert segment.response_ids == first_reply + glue + second_reply
    assert segment.response_mask == [1] * len(first_reply) + [0] * len(glue) + [1] * len(second_reply)
    expected = [logprob_of(len(first_context[0]) + t, token) for t, token in enumerate(first_reply)] + [
        logprob_of(len(second_context[0]) + t, token) for t, token in enumerate(second_reply)]
    assert [lp for lp, kept in zip(segment.rollout_logprobs, segment.response_mask) if kept] == expected
    assert [lp.logprob for lp in first.choices[0].logprobs.content] == expected[:len(first_reply)]
    # Re-tokenising the text would have merged "12" into one token: the trajectory kept the engine's two.
    assert tokenizer.encode("12+3", add_special_tokens=False) != _ids(tokenizer, "12+3")
    assert str(_ids(tokenizer, "12+3"))[1:-1] in str(segment.response_ids)
    assert "<tool_response>\n15\n</tool_response>" in tokenizer.decode(glue)
    assert gateway.sessions.new_segments == 0


def test_completions_extend_the_sessions_text_or_start_a_segment(gateway, tokenizer):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0,
                           default_headers={"X-Session-Id": "s2"})
    first = client.completions.create(model="policy", prompt="Q: 12+3?\nA:", max_tokens=64, temperature=0)
    prompt = "Q: 12+3?\nA:" + first.choices[0].text + "\nQ: and?\nA:"
    client.completions.create(model="policy", prompt=prompt, max_tokens=64, temperature=0)
    (segment,) = gateway.sessions.find("s2").segments
    first_reply = gateway.engine.outputs[0][0]
    assert segment.prompt_ids == tokenizer.encode("Q: 12+3?\nA:", add_special_tokens=False)
    assert segment.response_ids[:len(first_reply)] == first_reply  # not the text tokenised again
    assert gateway.engine.calls[1][0][0] == segment.context_ids[:len(gateway.engine.calls[1][0][0])]
    client.completions.create(model="policy", prompt="Something else", max_tokens=8, temperature=0)
    assert len(gateway.sessions.find("s2").segments) == 2 and gateway.sessions.new_segments == 1


def test_rewards_and_the_trajectory_are_served(gateway):
    client = openai.OpenAI(base_url=gateway.session_url("s3"), api_key="unused", max_retries=0)
    client.completions.create(model="policy", prompt="Q", max_tokens=4, temperature=0)
    assert httpx.post(f"{gateway.url}/v1/sessions/s3/reward", json={"reward": 1.5}).json()["reward"] == 1.5
    served = httpx.get(f"{gateway.url}/v1/sessions/s3").json()
    assert served["reward"] == 1.5 and served["segments"][0]["response_ids"] == gateway.engine.outputs[0][0][:4]
    assert httpx.post(f"{gateway.url}/v1/sessions/nope/reward", json={"reward": 1}).status_code == 404


def test_bad_requests_are_refused_in_one_sentence(gateway):
    client = openai.OpenAI(base_url=gateway.session_url("s4"), api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.completions.create(model="policy", prompt="Q", n=2)
    oversized = httpx.post(f"{gateway.url}/sessions/s4/v1/completions",
                           json={"prompt": "x" * (gateway.max_request_bytes + 1)})
    assert oversized.status_code == 413 and "larger than" in oversized.json()["error"]["message"]
    no_session = httpx.post(f"{gateway.url}/v1/completions", json={"prompt": "Q"})
    assert no_session.status_code == 400 and "no session" in no_session.json()["error"]["message"]
    assert gateway.engine.calls == []  # nothing reached the engine


def test_a_gateway_bound_beyond_this_machine_needs_a_token(tokenizer):
    engine = ScriptedGenerator(lambda context, call: [tokenizer.eos_token_id], [tokenizer.eos_token_id])
    with pytest.raises(UserError, match="give it a token"):
        Gateway(engine.generate, tokenizer, host="0.0.0.0")
    served = Gateway(engine.generate, tokenizer, token="sesame").serve()
    try:
        anonymous = openai.OpenAI(base_url=served.session_url("s5"), api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            anonymous.completions.create(model="policy", prompt="Q", max_tokens=2)
        assert httpx.get(f"{served.url}/v1/sessions/s5").status_code == 401
        allowed = openai.OpenAI(base_url=served.session_url("s5"), api_key="sesame", max_retries=0)
        assert allowed.completions.create(model="policy", prompt="Q", max_tokens=2).choices[0].finish_reason == "stop"
    finally:
        served.close()
