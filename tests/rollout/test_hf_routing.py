"""The hf engine records the experts every token went to while it generates (MoE routing replay, R3)."""

import pytest
import torch

from rlmega.rollout.hf_engine import HFEngine
from rlmega.rollout.hf_routing import moe_gates
from rlmega.rollout.protocol import SamplingParams

PROMPTS = [[3, 17, 5], [8, 1, 22, 40, 9, 2], [11]]


def _teacher_forced_routing(engine: HFEngine, tokens: list[int]) -> torch.Tensor:
    """``[T, M, k]``: one forward pass over the whole sequence, the gates' indices read by hooks."""
    seen = []
    handles = [gate.register_forward_hook(lambda module, inputs, output: seen.append(output[2]))
               for gate in moe_gates(engine.model)]
    try:
        with torch.inference_mode():
            engine.model(input_ids=torch.tensor([tokens]))
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(seen, dim=1).to(torch.int16)


@pytest.mark.parametrize("which", ["qwen3_moe_dirs", "mixtral_dirs"])
def test_generated_routing_is_the_routing_of_the_whole_sequence(which, request):
    engine = HFEngine(request.getfixturevalue(which)[0], record_routing=True)
    params = SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=3)
    generations = engine.generate(PROMPTS, params)
    layers, topk = len(moe_gates(engine.model)), engine.model.config.num_experts_per_tok
    for generation in generations:
        tokens = PROMPTS[generation.prompt_index] + generation.response_token_ids
        routing = generation.routing
        assert routing.dtype == torch.int16 and tuple(routing.shape) == (len(tokens), layers, topk)
        # Every token the engine fed through the model routes as in one pass over the sequence (the
        # prefill's left padding and the KV cache change nothing); the last token is never fed back
        # and repeats the one before.
        expected = _teacher_forced_routing(engine, tokens)
        assert torch.equal(routing[:-1], expected[:-1])
        assert torch.equal(routing[-1], routing[-2])


def test_dense_models_cannot_record_routing(llama_dir):
    with pytest.raises(ValueError, match="this model has no MoE layers"):
        HFEngine(llama_dir, record_routing=True)


def test_without_recording_there_is_no_routing(qwen3_moe_dirs):
    generations = HFEngine(qwen3_moe_dirs[0]).generate(PROMPTS[:1], SamplingParams(max_new_tokens=3, seed=1))
    assert generations[0].routing is None
