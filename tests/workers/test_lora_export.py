"""A LoRA actor's adapters as a PEFT adapter: under PEFT's names and shapes, whole from TP2 and PP2 shards, and the
HF base model with them applied as PEFT applies them (``W + lora_alpha / r * B @ A``) gives the actor's log-probs."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlmega.models import lora, model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.workers.config import WorkerConfig
from rlmega.workers.lora_export import peft_config, peft_tensors
from rlmega.workers.worker import MegatronWorker
from test_lora import ALPHA, RANK, _set_random_b
from worker_cases import hf_logprobs, make_batch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _export_body(rank, world_size, layout, hf_dir):
    initialize(layout)
    config = WorkerConfig(role="actor", lora=lora.LoraConfig(rank=RANK, alpha=ALPHA))
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, config, hf_dir=hf_dir)
    _set_random_b(worker, hf_dir)
    logprobs = worker.compute_logprobs(make_batch())[0]
    tensors = peft_tensors(worker.chunks, worker.spec)
    destroy()
    return logprobs, tensors


@pytest.mark.parametrize("layout_args", [dict(tp=2, world_size=2), dict(pp=2, world_size=2)], ids=["tp2", "pp2"])
def test_peft_adapter_applies_like_the_actor(checkpoints, tmp_path, layout_args):
    hf_dir = checkpoints["llama"]
    layout = ParallelLayout(**layout_args)
    results = run_on_ranks(_export_body, layout.world_size, timeout_s=240, args=(layout, str(hf_dir)))
    logprobs, tensors = results[0]
    assert all(result[1] is None for result in results[1:])  # rank 0 holds the adapter
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    modules = dict(model.named_modules())
    config = peft_config(lora.LoraConfig(rank=RANK, alpha=ALPHA), tensors, str(hf_dir))
    assert sorted(config["target_modules"]) == sorted(PROJECTIONS)
    expected_keys = {f"base_model.model.model.layers.{layer}.{part}.{projection}.lora_{ab}.weight"
                     for layer in range(model.config.num_hidden_layers) for ab in "AB"
                     for part, projections in (("self_attn", PROJECTIONS[:4]), ("mlp", PROJECTIONS[4:]))
                     for projection in projections}
    assert set(tensors) == expected_keys
    with torch.no_grad():
        for key in sorted(k for k in tensors if k.endswith(".lora_A.weight")):
            module = modules[key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")]
            a, b = tensors[key], tensors[key.replace("lora_A", "lora_B")]
            assert a.shape == (RANK, module.in_features) and b.shape == (module.out_features, RANK)
            module.weight += config["lora_alpha"] / config["r"] * b @ a
    model.save_pretrained(tmp_path / "applied")
    want, _ = hf_logprobs(tmp_path / "applied", make_batch())
    for got, expected in zip(logprobs, want):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
