"""LoRA on a MoE model's routed experts (``experts.linear_fc1`` / ``experts.linear_fc2``) as well as attention: with
random non-zero B the model equals the HF model with merged weights (fp32, 1e-4) at TP1, EP2 and TP2 (experts split
over expert-TP ranks), exports those merged weights and a PEFT adapter with a pair per expert, and two updates at EP2
give the same merged weights as on one rank."""

import dataclasses
import shutil
import zlib

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from rlmega.bridge.mapping import RuleBook, to_hf
from rlmega.bridge.params import geometry_of
from rlmega.models import lora, model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.workers.config import WorkerConfig
from rlmega.workers.lora_export import peft_tensors
from rlmega.workers.worker import MegatronWorker
from test_worker_update import _config, _spec, _training_batch
from worker_cases import hf_logprobs, make_batch, saved_model_keys

RANK, ALPHA = 4, 8.0
TIMEOUT_S = 300
TARGETS = ["linear_qkv", "linear_proj", "experts.linear_fc1", "experts.linear_fc2"]


def _lora(**fields) -> lora.LoraConfig:
    return lora.LoraConfig(rank=RANK, alpha=ALPHA, target_modules=list(TARGETS), **fields)


def _whole_shape(name: str, config) -> tuple[int, int]:
    """(output rows, input columns) of the adapted layer ``name`` (a global name), whole."""
    head_dim = config.head_dim
    leaf = name.rsplit(".", 1)[-1]
    if ".experts." in name:
        inner = config.moe_intermediate_size
        return (2 * inner, config.hidden_size) if leaf == "linear_fc1" else (config.hidden_size, inner)
    heads, groups = config.num_attention_heads, config.num_key_value_heads
    if leaf == "linear_qkv":
        return (heads + 2 * groups) * head_dim, config.hidden_size
    return config.hidden_size, heads * head_dim


def _whole_adapter(name: str, config) -> tuple[torch.Tensor, torch.Tensor]:
    """A as the model draws it from the layer's global name (global expert index included) and a random B, whole."""
    out_rows, in_columns = _whole_shape(name, config)
    seed = zlib.crc32(name.encode())
    bound = 1 / in_columns ** 0.5
    a = torch.empty(RANK, in_columns).uniform_(-bound, bound, generator=torch.Generator().manual_seed(seed))
    b = 0.3 * torch.randn(out_rows, RANK, generator=torch.Generator().manual_seed(seed + 1))
    return a, b


def _adapted_names(config) -> list[str]:
    names = []
    for layer in range(1, config.num_hidden_layers + 1):
        names += [f"decoder.layers.{layer}.self_attention.{leaf}" for leaf in ("linear_qkv", "linear_proj")]
        names += [f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{leaf}"
                  for expert in range(config.num_experts) for leaf in ("linear_fc1", "linear_fc2")]
    return names


def _merged_checkpoint(hf_dir, target, tp: int) -> dict[str, torch.Tensor]:
    """The HF checkpoint (experts one by one, as saved) with every adapter merged, written to ``target``."""
    config, spec = AutoConfig.from_pretrained(hf_dir), model_spec_from_hf(hf_dir)
    book, geometry = RuleBook(spec.architecture), geometry_of(spec)
    state = load_file(hf_dir / "model.safetensors")
    for name in _adapted_names(config):
        a, b = _whole_adapter(name, config)
        _, _, number, rest = name.split(".", 3)
        rule, names = book.resolve(f"decoder.layers.{int(number) - 1}.{rest}.weight")
        for hf_name, delta in to_hf(rule, (ALPHA / RANK) * b @ a, names, geometry, tp).items():
            state[hf_name] = state[hf_name] + delta
    shutil.copytree(hf_dir, target)
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    return state


def _set_random_b(worker, config) -> None:
    with torch.no_grad():
        for name, adapter in lora.adapters(worker.chunks):
            _, b = _whole_adapter(name, config)
            tp_rank, tp = adapter.tp_group.rank(), adapter.tp_group.size()
            adapter.lora_b.copy_(b if adapter.row_parallel else b.chunk(tp, dim=0)[tp_rank])


def _logprob_body(rank, world_size, layout, hf_dir):
    initialize(layout)
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, WorkerConfig(role="actor", lora=_lora()),
                            hf_dir=hf_dir)
    adapted = {name for name, _ in lora.adapters(worker.chunks)}
    _set_random_b(worker, AutoConfig.from_pretrained(hf_dir))
    logprobs = worker.compute_logprobs(make_batch())[0]
    exported = {name: tensor.clone() for name, tensor in worker.export_hf_weights()}
    peft = peft_tensors(worker.chunks, worker.spec)
    destroy()
    return adapted, logprobs, exported, peft


CASES = {
    "tp1": dict(world_size=1),
    "ep2": dict(ep=2, world_size=2),
    "tp2": dict(tp=2, world_size=2),  # experts split over two expert-TP ranks
}


@pytest.mark.parametrize("case", list(CASES))
def test_expert_adapters_equal_the_merged_hf_model(checkpoints, tmp_path, case):
    hf_dir, layout = checkpoints["qwen3-moe"], ParallelLayout(**CASES[case])
    config = AutoConfig.from_pretrained(hf_dir)
    merged = _merged_checkpoint(hf_dir, tmp_path / "merged", layout.expert_tp)
    want, _ = hf_logprobs(tmp_path / "merged", make_batch())
    results = run_on_ranks(_logprob_body, layout.world_size, timeout_s=TIMEOUT_S, args=(layout, str(hf_dir)))
    adapted = set().union(*(result[0] for result in results))
    assert adapted == set(_adapted_names(config))  # every expert's pair, named by its global index
    for _, logprobs, exported, _ in results:
        for got, expected in zip(logprobs, want):
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        assert exported.keys() == merged.keys()
        for name, tensor in exported.items():
            torch.testing.assert_close(tensor, merged[name], atol=1e-5, rtol=0, msg=name)
    peft = results[0][3]
    assert all(result[3] is None for result in results[1:])
    base = load_file(hf_dir / "model.safetensors")
    modules = {key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
               for key in peft if key.endswith(".lora_A.weight")}
    assert {f"model.layers.{layer}.mlp.experts.{expert}.{projection}" for layer in range(config.num_hidden_layers)
            for expert in range(config.num_experts)
            for projection in ("gate_proj", "up_proj", "down_proj")} <= modules
    for module in modules:  # PEFT's W + lora_alpha / r * B @ A is the merged weight
        a, b = peft[f"base_model.model.{module}.lora_A.weight"], peft[f"base_model.model.{module}.lora_B.weight"]
        torch.testing.assert_close(base[f"{module}.weight"] + ALPHA / RANK * b @ a, merged[f"{module}.weight"],
                                   atol=1e-5, rtol=0, msg=module)


def _update_body(rank, world_size, layout, hf_dir):
    initialize(layout)
    worker = MegatronWorker(_spec(hf_dir), layout, dataclasses.replace(_config(), lora=_lora()), hf_dir=hf_dir)
    optimized = [p for group in worker.optimizer.param_groups for p in group["params"]]
    adapter_elements = sum(p.numel() for _, a in lora.adapters(worker.chunks) for p in (a.lora_a, a.lora_b))
    metrics = []
    for _ in range(2):  # the second step also moves A (its gradient is zero while B is)
        batch = make_batch()
        old_logp, _ = worker.compute_logprobs(batch)
        metrics.append(worker.update(_training_batch(batch, old_logp)))
    merged = {name: tensor.clone() for name, tensor in worker.export_hf_weights(destinations=[0])}
    destroy()
    return dict(metrics=metrics, merged=merged, adapters_only=all(p.is_lora_adapter for p in optimized),
                optimized_elements=sum(p.numel() for p in optimized), adapter_elements=adapter_elements)


def _update(checkpoints, layout_args):
    layout = ParallelLayout(**layout_args)
    return run_on_ranks(_update_body, layout.world_size, timeout_s=TIMEOUT_S,
                        args=(layout, str(checkpoints["qwen3-moe"])))[0]


def test_expert_adapters_update_alike_at_ep2_and_on_one_rank(checkpoints):
    reference, ep2 = _update(checkpoints, dict(world_size=1)), _update(checkpoints, dict(ep=2, world_size=2))
    original = load_file(checkpoints["qwen3-moe"] / "model.safetensors")
    assert reference["adapters_only"] and reference["optimized_elements"] == reference["adapter_elements"]
    changed = {name for name, tensor in reference["merged"].items() if not torch.equal(tensor, original[name])}
    assert any(".experts." in name for name in changed) and any(".self_attn." in name for name in changed)
    for step, want in zip(ep2["metrics"], reference["metrics"]):
        assert step["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=1e-5)
    for name, tensor in reference["merged"].items():
        torch.testing.assert_close(ep2["merged"][name], tensor, rtol=0, atol=1e-5, msg=name)


def _expert_layer(kind: str, shape: tuple[int, int], group, seed: int):
    """An expert's linear layer as the adapter sees it: Megatron's class name, this expert-TP rank's weight shard
    (marked as an expert-parallel weight), its expert-TP group."""
    layer = type(kind, (torch.nn.Module,), {})()
    layer.weight = torch.nn.Parameter(torch.zeros(shape), requires_grad=False)
    layer.weight.allreduce = False
    layer.tp_group, layer.sequence_parallel = group, False
    return lora.Adapter(layer, _lora(), seed=seed, expert=True)


def _expert_gradient_body(rank, world_size, layout, b_fc1, b_fc2, x, weights):
    """An expert's two adapters over two expert-TP ranks, between the dispatcher's collectives: the tokens reach
    every rank (their gradient summed), the ranks' outputs are summed."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import mappings

    initialize(layout)
    group = ps.get_expert_tensor_parallel_group()
    inner, hidden = b_fc1.shape[0] // world_size, x.shape[-1]
    fc1 = _expert_layer("ColumnParallelLinear", (inner, hidden), group, seed=1)
    fc2 = _expert_layer("RowParallelLinear", (hidden, inner), group, seed=2)
    with torch.no_grad():
        fc1.lora_b.copy_(b_fc1.chunk(world_size, dim=0)[rank])
        fc2.lora_b.copy_(b_fc2)
    tokens = x.clone().requires_grad_()
    out = fc2.delta(fc1.delta(mappings.copy_to_tensor_model_parallel_region(tokens, group=group)))
    out = mappings.reduce_from_tensor_model_parallel_region(out, group=group)
    (out * weights).sum().backward()
    result = dict(out=out.detach(), tokens=tokens.grad, a1=fc1.lora_a.grad, b1=fc1.lora_b.grad,
                  a2=fc2.lora_a.grad, b2=fc2.lora_b.grad, allreduce=fc1.lora_a.allreduce or fc2.lora_b.allreduce)
    destroy()
    return result


def test_expert_adapter_gradients_over_expert_tp_ranks():
    """Each expert-TP rank adds its share and the whole factors' gradients are summed: the outputs and gradients
    of one expert's pair of adapters equal the whole adapters' on one rank."""
    hidden, inner, tokens = 8, 6, 5
    generator = torch.Generator().manual_seed(3)
    b_fc1, b_fc2 = torch.randn(inner, RANK, generator=generator), torch.randn(hidden, RANK, generator=generator)
    x, weights = torch.randn(tokens, hidden, generator=generator), torch.randn(tokens, hidden, generator=generator)
    layout = ParallelLayout(tp=2, world_size=2)
    results = run_on_ranks(_expert_gradient_body, 2, timeout_s=TIMEOUT_S, args=(layout, b_fc1, b_fc2, x, weights))

    bound1, bound2 = 1 / hidden ** 0.5, 1 / inner ** 0.5
    a1 = torch.empty(RANK, hidden).uniform_(-bound1, bound1, generator=torch.Generator().manual_seed(1))
    a2 = torch.empty(RANK, inner).uniform_(-bound2, bound2, generator=torch.Generator().manual_seed(2))
    whole = {name: tensor.clone().requires_grad_() for name, tensor in
             dict(a1=a1, b1=b_fc1, a2=a2, b2=b_fc2, tokens=x).items()}
    scale = ALPHA / RANK
    hidden_states = scale * whole["tokens"] @ whole["a1"].t() @ whole["b1"].t()
    out = scale * hidden_states @ whole["a2"].t() @ whole["b2"].t()
    (out * weights).sum().backward()
    for rank, result in enumerate(results):
        assert not result["allreduce"]  # reduced over the expert-data-parallel group, as expert weights are
        torch.testing.assert_close(result["out"], out.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(result["tokens"], whole["tokens"].grad, atol=1e-5, rtol=0)
        torch.testing.assert_close(result["a1"], whole["a1"].grad, atol=1e-5, rtol=0)
        torch.testing.assert_close(result["b2"], whole["b2"].grad, atol=1e-5, rtol=0)
        torch.testing.assert_close(result["b1"], whole["b1"].grad.chunk(2, dim=0)[rank], atol=1e-5, rtol=0)
        torch.testing.assert_close(result["a2"], whole["a2"].grad.chunk(2, dim=1)[rank], atol=1e-5, rtol=0)


def _step(worker, seed):
    batch = make_batch(seed)
    old_logp, _ = worker.compute_logprobs(batch)
    return worker.update(_training_batch(batch, old_logp))


def _checkpoint_body(rank, world_size, layout, hf_dir, root, save):
    initialize(layout)
    worker = MegatronWorker(_spec(hf_dir), layout, dataclasses.replace(_config(), lora=_lora()), hf_dir=hf_dir)
    if save:
        _step(worker, 5)
        worker.save_checkpoint(root)
    else:
        worker.load_checkpoint(root)
    _step(worker, 6)
    merged = {name: tensor.clone() for name, tensor in worker.export_hf_weights(destinations=[0])}
    destroy()
    return merged


def test_expert_adapter_checkpoint_resumes_on_one_rank(checkpoints, tmp_path):
    hf_dir, root = str(checkpoints["qwen3-moe"]), tmp_path / "ckpt"
    want = run_on_ranks(_checkpoint_body, 2, timeout_s=TIMEOUT_S,
                        args=(ParallelLayout(ep=2, world_size=2), hf_dir, root, True))[0]
    model_keys = saved_model_keys(root / "iter_0000001")
    assert model_keys and all(lora.is_adapter_key(key) for key in model_keys)
    assert any(".experts." in key for key in model_keys)
    got = run_on_ranks(_checkpoint_body, 1, timeout_s=TIMEOUT_S,
                       args=(ParallelLayout(world_size=1), hf_dir, root, False))[0]
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-5, msg=name)
