"""The transformers engine on a vision-language model (Qwen2.5-VL): it generates from prompts with images of
different sizes (and from text-only prompts in the same batch), every sampled token's log-prob equals a full
forward pass of transformers' model over the prompt, its images and the response, and the checkpoint's on-disk
names (``model.*``, ``visual.*``) update the weights."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlmega.rollout.hf_engine import HFEngine
from rlmega.rollout.protocol import SamplingParams
from rlmega.data.schema import ImageInputs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bridge"))
from vl_models import hf_logits, save_tiny_vl, vl_cases  # noqa: E402

LOGPROB_ATOL = 1e-5  # fp32


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2_5_vl")
    return directory, save_tiny_vl(directory)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_of_image_prompts_equal_a_full_forward(vl_model, temperature):
    directory, reference = vl_model
    engine = HFEngine(directory)
    cases = vl_cases()
    prompts = [ids[0].tolist() for ids, _, _ in cases]
    images = [None if pixels is None else ImageInputs(pixels, grid) for _, pixels, grid in cases]
    params = SamplingParams(max_new_tokens=6, temperature=temperature, n=2, seed=11, stop_token_ids=(2,))
    generations = engine.generate(prompts, params, images=images)
    assert [g.prompt_index for g in generations] == [0, 0, 1, 1, 2, 2]
    assert len({tuple(g.response_token_ids) for g in generations}) > 1
    for generation in generations:
        ids, pixels, grid = cases[generation.prompt_index]
        response = torch.tensor(generation.response_token_ids)
        sequence = torch.cat([ids[0], response]).unsqueeze(0)
        logits = hf_logits(reference, sequence, pixels, grid)[ids.shape[1] - 1:-1] / temperature
        expected = torch.log_softmax(logits, dim=-1).gather(-1, response.unsqueeze(-1))[:, 0]
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=LOGPROB_ATOL, rtol=0)


def test_the_checkpoint_names_update_the_weights(vl_model):
    directory, _ = vl_model
    engine = HFEngine(directory)
    saved = load_file(str(directory / "model.safetensors"))
    assert any(name.startswith("visual.") for name in saved)
    engine.update_weights(((name, tensor * 0.5) for name, tensor in saved.items()), version=1)
    assert engine.weight_version() == 1
    merger = engine.model.model.visual.merger.mlp[0].weight
    torch.testing.assert_close(merger, saved["visual.merger.mlp.0.weight"] * 0.5)
    layer = engine.model.model.language_model.layers[0].self_attn.q_proj.weight
    torch.testing.assert_close(layer, saved["model.layers.0.self_attn.q_proj.weight"] * 0.5)


def test_images_for_a_text_model_are_refused(tmp_path):
    from tests.rollout.tiny_models import save_tiny_model

    engine = HFEngine(save_tiny_model("llama", tmp_path / "llama", seed=0))
    with pytest.raises(ValueError, match="images given, but this llama model takes text only"):
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2), images=[ImageInputs(torch.zeros(4, 96),
                                                                                          torch.tensor([[1, 2, 2]]))])
