"""SGLangEngine serving LoRA adapters (``lora_rank``, ``sync.lora=adapters``) against the fake sglang 0.5.23, whose
LoRA calls and server arguments are bound to the wheel's (fakes/api/sglang.json) and which applies the PEFT adapter it
loads: an update of adapter tensors equals, in what the engine generates, an update of the merged weights."""

import json
import sys

import pytest
import torch

from rlmega.rollout.lora_serving import ADAPTER_CONFIG

from . import peft_updates as peft
from .fakes import contract, fake_sglang, one_thread
from .tiny_models import PROMPTS, checkpoint_tensors


@pytest.fixture
def make_engine(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", fake_sglang)
    monkeypatch.delenv(fake_sglang.RAW_LOGPROB_ENV, raising=False)
    from rlmega.rollout.sglang_engine import SGLangEngine

    with one_thread():
        yield lambda path, **kwargs: SGLangEngine(path, mem_fraction_static=0.5, **kwargs)


def _calls(engine, *names):
    return [call for call in engine.engine.calls if call[0] in names]


def test_sglang_is_built_for_adapters_of_the_actor_rank_on_every_projection(make_engine, llama_dir):
    engine = make_engine(llama_dir, lora_rank=peft.RANK)
    (_, kwargs), = _calls(engine, "__init__")
    assert (kwargs["enable_lora"], kwargs["max_lora_rank"], kwargs["max_loras_per_batch"]) == (True, peft.RANK, 2)
    assert kwargs["lora_target_modules"] == list(peft.MODULES)
    assert "enable_lora" not in _calls(make_engine(llama_dir), "__init__")[0][1]  # merged syncs: no LoRA
    with pytest.raises(ValueError, match="lora_rank=4 .* weight_dtype='fp8' must be 'auto'"):
        make_engine(llama_dir, lora_rank=peft.RANK, weight_dtype="fp8")
    with pytest.raises(ValueError, match=r"sets \['enable_lora'\] itself"):
        make_engine(llama_dir, lora_rank=peft.RANK, enable_lora=False)


def test_an_adapter_update_generates_as_the_merged_weights_do(make_engine, llama_dir, tmp_path):
    base = checkpoint_tensors(llama_dir)
    engine = make_engine(llama_dir, lora_rank=peft.RANK, lora_dir=str(tmp_path / "adapters"))
    merged_engine = make_engine(llama_dir)
    before = peft.greedy(engine)
    for version, seed in ((1, 0), (2, 1)):
        adapter = peft.adapter(llama_dir, seed)
        engine.update_weights(peft.stream(adapter), version)
        merged_engine.update_weights(list(peft.merged(base, adapter).items()), version)
        served = peft.greedy(engine)
        peft.assert_same(served, peft.greedy(merged_engine))
        assert engine.weight_version() == version
    assert served != before  # the adapter changes what the engine generates
    # Adapters alone: SGLang's weight-update session never opened, the base never moved.
    assert not _calls(engine, "begin_weight_update", "update_weights_from_tensor")
    # Each version loaded under a new name from its own directory; the one before unloaded and removed from disk.
    loads, unloads = _calls(engine, "load_lora_adapter"), _calls(engine, "unload_lora_adapter")
    assert [name for _, name, _, _ in loads] == ["rlmega-1-v1", "rlmega-2-v2"]
    assert unloads == [("unload_lora_adapter", "rlmega-1-v1")] and list(engine.engine.lora.adapters) == ["rlmega-2-v2"]
    second = loads[-1][2]
    assert [p.name for p in (tmp_path / "adapters").iterdir()] == ["rlmega-2-v2"]
    assert json.loads((tmp_path / "adapters" / "rlmega-2-v2" / ADAPTER_CONFIG).read_text())["r"] == peft.RANK
    assert engine.engine.lora.loads[-1] == second
    requests = engine.engine.lora.requests  # every request names the adapter of its version (none before)
    assert requests[:len(PROMPTS)] == [None] * len(PROMPTS) and requests[-1] == "rlmega-2-v2"


def test_base_weights_and_adapter_in_one_update(make_engine, llama_dir, llama_other_dir):
    engine = peft.check_base_weights_and_adapter_in_one_update(make_engine, llama_dir, llama_other_dir)
    assert _calls(engine, "begin_weight_update")  # the base went through SGLang's update session


def test_an_update_without_its_adapter_config_is_refused_and_left_torn(make_engine, llama_dir):
    peft.check_an_adapter_without_its_config_is_refused_and_left_torn(make_engine, llama_dir)


def test_sglang_refuses_an_adapter_above_its_max_rank(make_engine, llama_dir):
    engine = make_engine(llama_dir, lora_rank=peft.RANK)
    adapter = peft.adapter(llama_dir, 0, rank=8)
    with pytest.raises(RuntimeError, match="SGLang load_lora_adapter of .* failed: LoRA adapter rlmega-1-v1 with rank "
                                           "8 is incompatible with the current LoRA memory pool configuration"):
        engine.update_weights(peft.stream(adapter, peft.config(r=8)), 1)
    assert not engine.health()["ready"]


def test_the_adapter_of_a_failed_update_never_loads(make_engine, llama_dir):
    engine = make_engine(llama_dir, lora_rank=peft.RANK)

    def failing():
        yield from peft.stream(peft.adapter(llama_dir, 0))
        raise RuntimeError("the sender failed")

    with pytest.raises(RuntimeError, match="the sender failed"):
        engine.update_weights(failing(), 1)
    engine.update_weights(list(checkpoint_tensors(llama_dir).items()), 2)  # base weights alone
    assert not _calls(engine, "load_lora_adapter") and engine.health()["ready"]
    assert engine.engine.lora.requests == []  # nothing generated yet
    engine.generate(PROMPTS[:1], contract.GREEDY)
    assert engine.engine.lora.requests == [None]


def test_the_fake_applies_nothing_to_a_request_that_names_no_adapter(make_engine, llama_dir):
    engine = make_engine(llama_dir, lora_rank=peft.RANK)
    plain = peft.greedy(make_engine(llama_dir))
    peft.assert_same(peft.greedy(engine), plain)
    with pytest.raises(ValueError, match="Got LoRA adapter that has never been loaded: elsewhere"):
        engine.engine.generate(input_ids=[PROMPTS[0]], sampling_params=[{"max_new_tokens": 2}], lora_path="elsewhere")
    assert torch.equal(engine.engine.model.parameters()[0], make_engine(llama_dir).engine.model.parameters()[0])
