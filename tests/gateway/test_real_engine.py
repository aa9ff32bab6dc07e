"""The gateway over the real hf engine and the tiny checkpoint: a session's trajectory replays on the engine to the
same ids and log-probs, bit for bit; ``rlmega gateway`` serves a checkpoint to a plain ``openai`` client and stops on
Ctrl-C."""

import os
import re
import signal
import subprocess
import sys
import time

import openai
import pytest
import torch

from rlmega.gateway import Gateway
from rlmega.rollout import HFEngine, SamplingParams


@pytest.fixture(scope="module")
def model(tiny_assets):
    return str(tiny_assets(num_train=8, num_val=4) / "model")


def test_a_session_replays_on_the_engine_id_for_id(model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = HFEngine(model)
    gateway = Gateway(engine.generate, tokenizer).serve()
    try:
        client = openai.OpenAI(base_url=gateway.session_url("replay"), api_key="unused", max_retries=0)
        first = client.completions.create(model="policy", prompt="3+4=", max_tokens=6, temperature=0)
        client.completions.create(model="policy", prompt="3+4=" + first.choices[0].text + "5+1=", max_tokens=6,
                                  temperature=1.0, seed=7, logprobs=1)
    finally:
        gateway.close()
    (segment,) = gateway.sessions.find("replay").segments
    # Replay: the first call from the segment's prompt, the second from everything before its reply.
    greedy = engine.generate([segment.prompt_ids], SamplingParams(temperature=0, max_new_tokens=6,
                                                                  stop_token_ids=(tokenizer.eos_token_id,)))[0]
    first_length = len(greedy.response_token_ids)
    assert segment.response_ids[:first_length] == greedy.response_token_ids
    second_start = segment.response_mask.index(1, first_length)
    sampled = engine.generate([segment.prompt_ids + segment.response_ids[:second_start]],
                              SamplingParams(temperature=1.0, max_new_tokens=6, seed=7,
                                             stop_token_ids=(tokenizer.eos_token_id,)))[0]
    assert segment.response_ids[second_start:] == sampled.response_token_ids
    assert torch.equal(torch.tensor(segment.rollout_logprobs[second_start:]), torch.tensor(sampled.logprobs))
    assert segment.response_mask == [1] * first_length + [0] * (second_start - first_length) + [1] * len(
        sampled.response_token_ids)


@pytest.mark.timeout(180)
def test_the_gateway_command_serves_a_checkpoint_until_interrupted(model):
    process = subprocess.Popen([sys.executable, "-m", "rlmega.cli.main", "gateway", model, "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = process.stdout.readline()  # the command prints its address once it listens
        url = re.search(r"at (http://\S+);", line)
        assert url, line + process.stderr.read()
        client = openai.OpenAI(base_url=url.group(1) + "/sessions/cli/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model="policy", prompt="3+4=", max_tokens=4, temperature=0)
        assert answer.choices[0].finish_reason in ("stop", "length")
    finally:
        os.killpg(process.pid, signal.SIGINT)
        deadline = time.monotonic() + 60
        while process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    assert process.returncode == 130
    assert process.stderr.read().strip().endswith("interrupted")
