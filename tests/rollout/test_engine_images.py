"""The vLLM and SGLang adapters take a vision-language prompt's images (``generate(..., images=)``) and send them the
way the pinned releases accept images with token-id prompts, checked by the fakes against what was recorded from
the wheels (fakes/api/*_multimodal.json): vLLM 0.33 gets raw images (``multi_modal_data``) and one pad token per
image, which it expands itself; SGLang 0.5.23 gets the trainer's pixel values as a ``processor_output`` and the
expanded ids. A batch mixes prompts with and without images; text-only prompts carry no multi-modal data."""

import io
import json
import sys

import numpy as np
import pytest
import torch

from rlmega.data.images import ImagePrompts
from rlmega.rollout import SamplingParams
from rlmega.data.schema import ImageInputs

from .fakes import fake_sglang, fake_vllm, one_thread

PATCH, MERGE, TEMPORAL = 4, 2, 2
SIZES = [[(37, 51)], [(20, 70), (60, 30)]]  # (height, width) of the images of prompts 1 and 2; prompt 0 has none


def _image(height: int, width: int, seed: int):
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def image_prompts(tmp_path_factory):
    from rlmega.trainer.vlm_assets import save_tokenizer_and_image_processor

    directory = tmp_path_factory.mktemp("vl_processor")
    tokenizer = save_tokenizer_and_image_processor(directory, min_pixels=8 * 8, max_pixels=64 * 64)
    return ImagePrompts(str(directory), tokenizer)


@pytest.fixture(scope="module")
def batch(image_prompts):
    """Prompt ids (expanded pad runs) and per prompt its ImageInputs or None: text only, one image, two images."""
    markup = image_prompts.markup
    ids = [image_prompts.tokenizer("no image here")["input_ids"]]
    images = [None]
    for index, sizes in enumerate(SIZES):
        text = f"look {markup} here" if len(sizes) == 1 else f"a {markup} b {markup} c"
        prompt, inputs = image_prompts(text, [_image(h, w, index * 10 + j) for j, (h, w) in enumerate(sizes)],
                                       min_pixels=None, max_pixels=None, add_special_tokens=True)
        ids.append(prompt)
        images.append(inputs)
    return ids, images


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory, image_prompts):
    """A tiny text model whose config.json also names an image pad token and a vision tower's geometry (the
    adapters and the fakes read only those; the fakes decode with the text model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("vl_text")
    LlamaForCausalLM(LlamaConfig(vocab_size=len(image_prompts.tokenizer), hidden_size=32, intermediate_size=48,
                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                 max_position_embeddings=512, bos_token_id=1, eos_token_id=2)).save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    tokens = image_prompts.tokenizer.convert_tokens_to_ids
    config.update(image_token_id=tokens(image_prompts.image_token),
                  vision_config={"patch_size": PATCH, "spatial_merge_size": MERGE, "temporal_patch_size": TEMPORAL})
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture
def vllm_engine(monkeypatch, vl_dir):
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    from rlmega.rollout.vllm_engine import VLLMEngine

    with one_thread():
        yield VLLMEngine(vl_dir)


@pytest.fixture
def sglang_engine(monkeypatch, vl_dir):
    monkeypatch.setitem(sys.modules, "sglang", fake_sglang)
    monkeypatch.delenv(fake_sglang.RAW_LOGPROB_ENV, raising=False)
    from rlmega.rollout.sglang_engine import SGLangEngine

    with one_thread():
        engine = SGLangEngine(vl_dir, mem_fraction_static=0.5)
        yield engine
        engine.shutdown()


PARAMS = SamplingParams(max_new_tokens=3, temperature=1.0, n=2, seed=5)


def _pad(engine) -> int:
    return engine.facts.image_token_id


def _collapsed(ids: list[int], pad: int) -> list[int]:
    """Each run of ``pad`` as one ``pad``."""
    return [t for i, t in enumerate(ids) if t != pad or i == 0 or ids[i - 1] != pad]


def test_the_prompts_carry_expanded_pad_runs_and_resized_images(batch, image_prompts):
    ids, images = batch
    pad = image_prompts.tokenizer.convert_tokens_to_ids(image_prompts.image_token)
    for prompt, inputs in zip(ids[1:], images[1:]):
        counts = [int(g.prod()) // MERGE**2 for g in inputs.grid_thw]
        assert prompt.count(pad) == sum(counts)
        from PIL import Image

        sizes = [Image.open(io.BytesIO(png)).size for png in inputs.images]
        assert sizes == [(w * PATCH, h * PATCH) for _, h, w in inputs.grid_thw.tolist()]


# ---------------------------------------------------------------------------------------------- vLLM 0.33

def test_vllm_gets_images_and_one_pad_per_image(vllm_engine, batch):
    ids, images = batch
    generations = vllm_engine.generate(ids, PARAMS, images=images)
    assert [g.prompt_index for g in generations] == [0, 0, 1, 1, 2, 2]
    (_, sent, _), = [c for c in vllm_engine.llm.calls if c[0] == "generate"]
    (processed,) = vllm_engine.llm.mm_requests
    pad = _pad(vllm_engine)
    # The request dicts, as they reached LLM.generate (fake_vllm checked every key against TokensPrompt's).
    assert sent[0] == sent[1] == ids[0] and processed[0] is processed[1] is None
    for request in range(2, 6):
        prompt = request // 2
        assert sent[request] == _collapsed(ids[prompt], pad)  # one pad per image, every other id unchanged
        assert sent[request].count(pad) == len(images[prompt].grid_thw)
        seen = processed[request]
        assert seen["prompt_token_ids"] == ids[prompt]  # vLLM's expansion gives back the trainer's ids
        assert torch.equal(seen["image_grid_thw"], images[prompt].grid_thw)  # images in prompt order
        assert torch.equal(seen["pixel_values"], images[prompt].pixel_values)  # the trainer's patches, exactly


def test_vllm_text_only_requests_stay_plain(vllm_engine, batch, monkeypatch):
    ids, images = batch
    requests = []
    original = vllm_engine.llm.generate

    def recording(prompts, *args, **kwargs):
        requests.extend(prompts)
        return original(prompts, *args, **kwargs)

    monkeypatch.setattr(vllm_engine.llm, "generate", recording)
    vllm_engine.generate(ids, SamplingParams(max_new_tokens=2), images=images)
    assert requests[0] == {"prompt_token_ids": ids[0]}  # no multi_modal_data key at all
    assert set(requests[1]) == {"prompt_token_ids", "multi_modal_data", "mm_processor_kwargs"}
    areas = [w * h * PATCH**2 for _, h, w in images[2].grid_thw.tolist()]
    assert requests[2]["mm_processor_kwargs"] == {"min_pixels": min(areas), "max_pixels": max(areas)}
    vllm_engine.generate(ids[:1], SamplingParams(max_new_tokens=2))
    assert requests[-1] == {"prompt_token_ids": ids[0]}


def test_vllm_needs_the_images_not_pixel_values(vllm_engine, batch):
    ids, images = batch
    bare = ImageInputs(images[1].pixel_values, images[1].grid_thw)
    with pytest.raises(ValueError, match="ImageInputs.images is missing"):
        vllm_engine.generate(ids[1:2], SamplingParams(max_new_tokens=2), images=[bare])


def test_the_vllm_fake_refuses_what_vllm_refuses(vllm_engine, batch):
    ids, images = batch
    llm, params = vllm_engine.llm, fake_vllm.SamplingParams(max_tokens=2)
    from PIL import Image

    picture = Image.open(io.BytesIO(images[1].images[0]))
    collapsed = _collapsed(ids[1], _pad(vllm_engine))
    with pytest.raises(TypeError, match="TokensPrompt"):  # a wrong key
        llm.generate([{"prompt_token_ids": collapsed, "multi_modal_inputs": {"image": [picture]}}], params)
    with pytest.raises(ValueError, match="image_embeds"):  # pixel values are not an accepted image item
        llm.generate([{"prompt_token_ids": collapsed, "multi_modal_data": {
            "image": {"pixel_values": images[1].pixel_values, "image_grid_thw": images[1].grid_thw}}}], params)
    with pytest.raises(TypeError, match="PIL"):
        llm.generate([{"prompt_token_ids": collapsed, "multi_modal_data": {"image": [images[1].images[0]]}}], params)
    with pytest.raises(TypeError, match="size kwargs"):
        llm.generate([{"prompt_token_ids": collapsed, "multi_modal_data": {"image": [picture]},
                       "mm_processor_kwargs": {"resized_height": 8}}], params)
    # An expanded run is expanded again: the model would see other ids than the trainer's.
    (output,) = llm.generate([{"prompt_token_ids": ids[1], "multi_modal_data": {"image": [picture]},
                               "mm_processor_kwargs": {"min_pixels": 1, "max_pixels": 10**6}}], params)
    assert output.prompt_token_ids != ids[1]
    (output,) = llm.generate([{"prompt_token_ids": collapsed, "multi_modal_data": {"image": [picture]},
                               "mm_processor_kwargs": {"min_pixels": 1, "max_pixels": 10**6}}], params)
    assert output.prompt_token_ids == ids[1]


# ---------------------------------------------------------------------------------------------- SGLang 0.5.23

def test_sglang_gets_the_processor_output_and_the_expanded_ids(sglang_engine, batch):
    ids, images = batch
    generations = sglang_engine.generate(ids, PARAMS, images=images)
    assert [g.prompt_index for g in generations] == [0, 0, 1, 1, 2, 2]
    (_, input_ids, *_), = [c for c in sglang_engine.engine.calls if c[0] == "generate"]
    assert input_ids == [ids[i // 2] for i in range(6)]  # token ids unchanged
    (processed,) = sglang_engine.engine.mm_requests
    assert processed[:2] == [None, None]
    for request in range(2, 6):
        prompt, seen = request // 2, processed[request]
        assert torch.equal(seen["image_grid_thw"], images[prompt].grid_thw)
        assert torch.equal(torch.cat(seen["pixel_values"]), images[prompt].pixel_values)
        assert len(seen["offsets"]) == len(images[prompt].grid_thw)  # one pad run per image, in order


def test_sglang_image_data_per_request(sglang_engine, batch, monkeypatch):
    ids, images = batch
    calls = []
    original = sglang_engine.engine.generate

    def recording(**kwargs):
        calls.append(kwargs)
        return original(**kwargs)

    monkeypatch.setattr(sglang_engine.engine, "generate", recording)
    sglang_engine.generate(ids, SamplingParams(max_new_tokens=2), images=images)
    image_data = calls[0]["image_data"]
    assert image_data[0] == []  # a text-only request: an empty list (None first would not be a list of lists)
    for prompt in (1, 2):
        (item,) = image_data[prompt]
        assert set(item) == {"format", "pixel_values", "image_grid_thw"} and item["format"] == "processor_output"
        assert item["pixel_values"] is images[prompt].pixel_values  # the trainer's own tensors
        assert item["image_grid_thw"] is images[prompt].grid_thw
    sglang_engine.generate(ids[:1], SamplingParams(max_new_tokens=2))
    assert "image_data" not in calls[-1]  # text-only calls are unchanged


def test_the_sglang_fake_refuses_what_sglang_refuses(sglang_engine, batch):
    ids, images = batch
    engine, sampling = sglang_engine.engine, [{"max_new_tokens": 2}]
    output = {"format": "processor_output", "pixel_values": images[1].pixel_values,
              "image_grid_thw": images[1].grid_thw}
    with pytest.raises(TypeError):  # a keyword Engine.generate does not have
        engine.generate(input_ids=[ids[1]], sampling_params=sampling, images=[[output]])
    with pytest.raises(TypeError, match="no image key"):
        engine.generate(input_ids=[ids[1]], sampling_params=sampling, image_data=[[{**output, "grid_thw": 1}]])
    with pytest.raises(ValueError, match="exactly one item"):
        engine.generate(input_ids=[ids[1]], sampling_params=sampling, image_data=[[output, output]])
    with pytest.raises(RuntimeError, match="Error while loading"):  # None first: every entry is wrapped again
        engine.generate(input_ids=[ids[0], ids[1]], sampling_params=sampling * 2, image_data=[None, [output]])
    with pytest.raises(RuntimeError, match="misplace"):  # pad runs that do not fit the grid
        engine.generate(input_ids=[ids[1][:-3] + [_pad(sglang_engine)] + ids[1][-3:]], sampling_params=sampling,
                        image_data=[[output]])


# ---------------------------------------------------------------------------------------------- shared checks

@pytest.mark.parametrize("adapter", ["vllm_engine", "sglang_engine"])
def test_bad_image_batches_are_refused_before_the_engine(adapter, request, batch):
    engine = request.getfixturevalue(adapter)
    ids, images = batch
    short = ids[1][:ids[1].index(_pad(engine))] + ids[1][ids[1].index(_pad(engine)) + 1:]
    with pytest.raises(ValueError, match="image pad runs"):
        engine.generate([short], SamplingParams(max_new_tokens=2), images=[images[1]])
    with pytest.raises(ValueError, match="image entries for"):
        engine.generate(ids, SamplingParams(max_new_tokens=2), images=images[:2])
    with pytest.raises(ValueError, match="no images"):
        engine.generate([ids[1], ids[1]], SamplingParams(max_new_tokens=2), images=[None, images[1]])
    assert not [c for c in getattr(engine, "llm", getattr(engine, "engine", None)).calls if c[0] == "generate"]


def test_images_for_a_text_model_are_refused(monkeypatch, llama_dir, batch):
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    from rlmega.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(llama_dir)
    with pytest.raises(ValueError, match="images given, but this llama model takes text only"):
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2), images=[batch[1][1]])


def test_a_vllm_multimodal_engine_is_built_with_its_tokenizer(vllm_engine, vl_dir, batch):
    """vLLM builds a multimodal model's processor at construction, and it refuses to start without the tokenizer
    (the fake, as vllm/multimodal/processing/processor.py); the requests stay token ids in and out."""
    with pytest.raises(ValueError, match="requires a tokenizer and cannot be initialized when `skip_tokenizer_init"):
        fake_vllm.LLM(str(vl_dir), skip_tokenizer_init=True)
    assert vllm_engine.llm.calls[0][2]["skip_tokenizer_init"] is False
    ids, images = batch
    generations = vllm_engine.generate(ids[:2], PARAMS, images=images[:2])
    (_, sent, params), = [c for c in vllm_engine.llm.calls if c[0] == "generate"]
    assert all(p.detokenize is False for p in params) and all(isinstance(t, int) for t in sent[0])
    assert all(g.response_token_ids for g in generations)
