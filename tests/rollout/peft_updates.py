"""Weight updates that carry a PEFT adapter (``sync.lora=adapters``), and the merged weights they stand for: shared by
the engines' LoRA tests, which compare an engine served the adapter with one served the merged weights."""

import torch

from rlmega.rollout.lora_serving import ADAPTER_CONFIG, PEFT_PREFIX, config_tensor

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
