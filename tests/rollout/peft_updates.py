"""Weight updates that carry a PEFT adapter (``sync.lora=adapters``), and the merged weights they stand for: shared by
the engines' LoRA tests, which compare an engine served the adapter with one served the merged weights."""

import pytest
import torch

from rlmega.rollout.lora_serving import ADAPTER_CONFIG, PEFT_PREFIX, config_tensor
from rlmega.rollout.protocol import EngineNotReadyError

from .fakes import contract
from .tiny_models import PROMPTS, checkpoint_tensors

RANK, ALPHA = 4, 16.0
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def adapter(directory, seed: int, rank: int = RANK) -> dict:
    """A random adapter of ``rank`` on every linear layer of the tiny checkpoint, in PEFT's names."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, weight in checkpoint_tensors(directory).items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in MODULES:
            out_features, in_features = weight.shape
            tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.2
            tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.2
    return tensors


def config(**changes) -> dict:
    return {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": list(MODULES), "bias": "none",
            **changes}


def stream(tensors: dict, adapter_config: dict = None) -> list:
    """The adapter as a sync streams it: its tensors, then its config as one tensor."""
    return [*tensors.items(), (ADAPTER_CONFIG, config_tensor(adapter_config or config()))]


def merged(base: dict, tensors: dict) -> dict:
    """``base`` with ``W + alpha / r * B @ A`` for every adapted weight."""
    result = dict(base)
    for name, a in tensors.items():
        if name.endswith(".lora_A.weight"):
            module = name.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
            b = tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"]
            result[f"{module}.weight"] = base[f"{module}.weight"] + ALPHA / RANK * b @ a
    return result


def greedy(engine) -> list:
    return [(g.response_token_ids, g.logprobs) for g in engine.generate(PROMPTS, contract.GREEDY)]


def assert_same(first, second) -> None:
    for (tokens, logprobs), (other_tokens, other_logprobs) in zip(first, second, strict=True):
        assert tokens == other_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(other_logprobs), atol=1e-5, rtol=0)


# The checks of what both engines share (``rlmega.rollout.lora_serving``), each run on an engine of each backend by
# ``make_engine(path, **kwargs)``.

def check_base_weights_and_adapter_in_one_update(make_engine, base_dir, folded_dir):
    """After a warm-start folded the adapters into the base, the first sync carries that base with the adapter; then
    adapters alone, over the folded base: both serve as the merged weights do. Returns the adapted engine."""
    folded = checkpoint_tensors(folded_dir)
    engine = make_engine(base_dir, lora_rank=RANK)
    merged_engine = make_engine(base_dir)
    tensors = adapter(base_dir, 2)
    engine.update_weights([*folded.items(), *stream(tensors)], 1)
    merged_engine.update_weights(list(merged(folded, tensors).items()), 1)
    assert_same(greedy(engine), greedy(merged_engine))
    tensors = adapter(base_dir, 3)
    engine.update_weights(stream(tensors), 2)
    merged_engine.update_weights(list(merged(folded, tensors).items()), 2)
    assert_same(greedy(engine), greedy(merged_engine))
    return engine


def check_an_adapter_without_its_config_is_refused_and_left_torn(make_engine, base_dir):
    engine = make_engine(base_dir, lora_rank=RANK)
    with pytest.raises(ValueError, match="the update's adapter is incomplete: it carried 28 adapter tensors and no "
                                         "adapter_config.json"):
        engine.update_weights(list(adapter(base_dir, 0).items()), 1)
    with pytest.raises(EngineNotReadyError, match="the update to weight version 1 failed part way"):
        engine.generate(PROMPTS, contract.GREEDY)
