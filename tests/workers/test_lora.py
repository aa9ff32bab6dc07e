"""LoRA adapters on the actor: a rank-r model equals the HF model with merged weights ``W + scale * B @ A`` (fp32,
1e-4) in every layout, exports those merged weights, and with its adapters off is the base model again."""

import zlib

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from rlmega.bridge.mapping import RuleBook, to_hf
from rlmega.bridge.params import geometry_of
from rlmega.models import lora, model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.workers.config import WorkerConfig
from rlmega.workers.worker import MegatronWorker
from worker_cases import hf_logprobs, make_batch

ATOL = 1e-4
TIMEOUT_S = 240
RANK, ALPHA = 4, 8.0


def adapted_shapes(hf_dir) -> dict[str, tuple[int, int]]:
    """Megatron's layout of each adapted layer (its suffix after ``decoder.layers.{n}.``): (output rows, input
    columns), whole. Experts are not adapted (a MoE model's MLP layers are experts)."""
    config = AutoConfig.from_pretrained(hf_dir)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, heads = config.hidden_size, config.num_attention_heads
    shapes = {"self_attention.linear_qkv": ((heads + 2 * config.num_key_value_heads) * head_dim, hidden),
              "self_attention.linear_proj": (hidden, heads * head_dim)}
    if not getattr(config, "num_experts", None):
        shapes.update({"mlp.linear_fc1": (2 * config.intermediate_size, hidden),
                       "mlp.linear_fc2": (hidden, config.intermediate_size)})
    return shapes


def whole_adapter(name: str, shapes: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A (as the model initialises it) and a random non-zero B of layer ``name`` (a global name), whole."""
    out_rows, in_columns = shapes[name.split(".", 3)[3]]
    seed = zlib.crc32(name.encode())
    bound = 1 / in_columns ** 0.5
    a = torch.empty(RANK, in_columns).uniform_(-bound, bound, generator=torch.Generator().manual_seed(seed))
    b = 0.3 * torch.randn(out_rows, RANK, generator=torch.Generator().manual_seed(seed + 1))
    return a, b


def merged_checkpoint(hf_dir, target, tp: int):
    """The HF model with every adapter of ``whole_adapter`` merged, saved in ``target``; its saved tensors."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    spec = model_spec_from_hf(hf_dir)
    book, geometry, state = RuleBook(spec.architecture), geometry_of(spec), model.state_dict()
    shapes = adapted_shapes(hf_dir)
    for layer in range(1, model.config.num_hidden_layers + 1):
        for module in shapes:
            a, b = whole_adapter(f"decoder.layers.{layer}.{module}", shapes)
            rule, names = book.resolve(f"decoder.layers.{layer - 1}.{module}.weight")
            for hf_name, delta in to_hf(rule, (ALPHA / RANK) * b @ a, names, geometry, tp).items():
                state[hf_name] += delta
    model.load_state_dict(state)
    model.save_pretrained(target)
    # As saved: the checkpoint format (experts one by one) is what the export streams.
    return {name: tensor for path in sorted(target.glob("*.safetensors")) for name, tensor in load_file(path).items()}


def _set_random_b(worker, hf_dir) -> None:
    shapes = adapted_shapes(hf_dir)
    with torch.no_grad():
        for name, adapter in lora.adapters(worker.chunks):
            _, b = whole_adapter(name, shapes)
            tp_rank, tp = adapter.tp_group.rank(), adapter.tp_group.size()
            adapter.lora_b.copy_(b if adapter.row_parallel else b.chunk(tp, dim=0)[tp_rank])


def _lora_body(rank, world_size, layout, hf_dir, sequence_parallel):
    initialize(layout)
    config = WorkerConfig(role="actor", lora=lora.LoraConfig(rank=RANK, alpha=ALPHA),
                          sequence_parallel=sequence_parallel)
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, config, hf_dir=hf_dir)
    trainable = sorted(name for chunk in worker.chunks for name, p in chunk.named_parameters() if p.requires_grad)
    starts_as_base = worker.compute_logprobs(make_batch())[0]
    _set_random_b(worker, hf_dir)
    adapted = worker.compute_logprobs(make_batch())[0]
    exported = {name: tensor.clone() for name, tensor in worker.export_hf_weights()}
    base = worker.compute_logprobs(make_batch(), adapters=False)[0]  # the reference: adapters off
    again = worker.compute_logprobs(make_batch())[0]  # and back on
    destroy()
    return trainable, starts_as_base, adapted, base, again, exported


CASES = {  # model, layout, sequence parallel
    "tp1": ("llama", dict(world_size=1), None),
    "tp2": ("llama", dict(tp=2, world_size=2), False),
    "tp2-sp": ("llama", dict(tp=2, world_size=2), True),
    "pp2": ("llama", dict(pp=2, world_size=2), None),
    "ep2-moe": ("qwen3-moe", dict(ep=2, world_size=2), None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_lora_model_equals_merged_hf_model(checkpoints, tmp_path, case):
    model, layout_args, sequence_parallel = CASES[case]
    layout = ParallelLayout(**layout_args)
    hf_dir = checkpoints[model]
    merged = merged_checkpoint(hf_dir, tmp_path / "merged", layout.tp)
    want_adapted, _ = hf_logprobs(tmp_path / "merged", make_batch())
    want_base, _ = hf_logprobs(hf_dir, make_batch())
    results = run_on_ranks(_lora_body, layout.world_size, timeout_s=TIMEOUT_S,
                           args=(layout, str(hf_dir), sequence_parallel))
    for trainable, starts_as_base, adapted, base, again, exported in results:
        assert trainable and all(name.endswith((".adapter.lora_a", ".adapter.lora_b")) for name in trainable)
        for got, want in zip(adapted + again, want_adapted + want_adapted):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        for logp in (starts_as_base, base):  # B starts at zero; adapters off is the base model
            for got, want in zip(logp, want_base):
                torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        assert exported.keys() == merged.keys()
        for name, tensor in exported.items():
            torch.testing.assert_close(tensor, merged[name], atol=1e-5, rtol=0, msg=name)
