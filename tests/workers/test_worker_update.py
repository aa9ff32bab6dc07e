"""One policy update from the same weights and data gives the same weights in every layout and
micro-batch split; a non-finite loss skips the step without touching the weights."""

import dataclasses
import math

import pytest
import torch

from rlmega.models import model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.workers.config import BatchingConfig, OptimizerConfig, PolicyLossConfig, WorkerConfig
from rlmega.workers.worker import MegatronWorker
from worker_cases import make_batch

# fp32 sums in a different order per layout differ by ~1e-7 relative; Adam's first step divides by
# |g| + eps, so eps=1e-3 (stated here, not a default) keeps that difference from being amplified.
ATOL = 1e-5
TIMEOUT_S = 300


def _config(min_microbatches=1, packing=True):
    return WorkerConfig(
        role="actor",
        optimizer=OptimizerConfig(lr=1e-2, adam_eps=1e-3, clip_grad=1.0, lr_schedule="constant"),
        batching=BatchingConfig(max_tokens_per_microbatch=1000, min_microbatches=min_microbatches, packing=packing),
        policy_loss=PolicyLossConfig(name="ppo", clip_ratio_high=0.28, entropy_coeff=0.01, kl_loss_coef=0.05),
    )


def _training_batch(batch, old_logp, poison=False):
    generator = torch.Generator().manual_seed(9)
    advantages = [torch.randn(n, generator=generator) for n in batch.response_lengths]
    if poison:
        advantages[2][1] = float("nan")
    # Old log-probs slightly off the current policy, so ratios and clipping are exercised.
    old = [logp + 0.3 * torch.randn(logp.shape, generator=generator) for logp in old_logp]
    ref = [logp - 0.05 for logp in old_logp]
    return batch.with_fields(old_logp=old, advantages=advantages, ref_logp=ref)


def _spec(hf_dir):
    spec = model_spec_from_hf(hf_dir)
    if spec.num_experts:
        # The router's load-balancing loss is computed per micro-batch on its local tokens (as in
        # Megatron), so it depends on how the batch is split; switch it off to compare layouts.
        spec = dataclasses.replace(spec, config={**spec.config, "moe_aux_loss_coeff": 0.0})
    return spec


def _update_body(rank, world_size, layout, hf_dir, config, poison):
    initialize(layout)
    worker = MegatronWorker(_spec(hf_dir), layout, config, hf_dir=hf_dir)
    batch = make_batch()
    old_logp, _ = worker.compute_logprobs(batch)
    metrics = worker.update(_training_batch(batch, old_logp, poison))
    weights = {name: tensor.clone() for name, tensor in worker.export_hf_weights(destinations=[0])}
    destroy()
    return metrics, weights


def _run(checkpoints, model, layout_args, config=None, poison=False):
    layout = ParallelLayout(**layout_args)
    results = run_on_ranks(_update_body, layout.world_size, timeout_s=TIMEOUT_S,
                           args=(layout, str(checkpoints[model]), config or _config(), poison))
    return results[0]


@pytest.fixture(scope="module")
def references(checkpoints):
    return {model: _run(checkpoints, model, dict(world_size=1)) for model in ("llama", "qwen3-moe")}


CASES = {
    "tp2": ("llama", dict(tp=2, world_size=2), None),
    "pp2": ("llama", dict(pp=2, world_size=2), None),
    "tp2-pp2": ("llama", dict(tp=2, pp=2, world_size=4), None),
    "dp2": ("llama", dict(world_size=2), None),
    "4-microbatches": ("llama", dict(world_size=1), _config(min_microbatches=4)),
    "padded": ("llama", dict(world_size=1), _config(packing=False)),
    "ep2-moe": ("qwen3-moe", dict(ep=2, world_size=2), None),
    "cp2": ("llama", dict(cp=2, world_size=2), None),
    "cp2-padded": ("llama", dict(cp=2, world_size=2), _config(packing=False)),
    "cp2-4-microbatches": ("llama", dict(cp=2, world_size=2), _config(min_microbatches=4)),
    "tp2-cp2": ("llama", dict(tp=2, cp=2, world_size=4), None),
    "pp2-cp2": ("llama", dict(pp=2, cp=2, world_size=4), None),  # stages exchange CP-split activations
    "cp2-ep2-moe": ("qwen3-moe", dict(cp=2, ep=2, world_size=2), None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_update_equals_single_rank(checkpoints, references, case):
    model, layout_args, config = CASES[case]
    metrics, weights = _run(checkpoints, model, layout_args, config)
    reference_metrics, reference_weights = references[model]
    assert weights.keys() == reference_weights.keys()
    moved = 0.0
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, reference_weights[name], atol=ATOL, rtol=0, msg=name)
        moved = max(moved, float((tensor - reference_weights[name]).abs().max()))
    for name in ("actor/pg_loss", "actor/loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm", "actor/pg_clipfrac"):
        assert metrics[name] == pytest.approx(reference_metrics[name], rel=1e-4, abs=1e-6), name


def test_update_moves_the_weights_and_reports_metrics(checkpoints, references, tmp_path):
    metrics, weights = references["llama"]
    from safetensors.torch import load_file

    original = load_file(str(checkpoints["llama"] / "model.safetensors"))
    changed = [name for name, tensor in weights.items() if not torch.equal(tensor, original[name])]
    assert len(changed) == len(weights)  # every tensor gets a gradient
    assert metrics["actor/lr"] == pytest.approx(1e-2)
    assert metrics["actor/skipped_steps"] == 0
    assert 0 < metrics["actor/pg_clipfrac"] < 1
    assert math.isfinite(metrics["actor/grad_norm"]) and metrics["actor/grad_norm"] > 0
    assert metrics["perf/tokens_per_s"] > 0


def test_non_finite_loss_skips_the_step(checkpoints):
    from safetensors.torch import load_file

    metrics, weights = _run(checkpoints, "llama", dict(tp=2, world_size=2), poison=True)
    original = load_file(str(checkpoints["llama"] / "model.safetensors"))
    for name, tensor in weights.items():
        assert torch.equal(tensor, original[name]), name
    assert metrics["actor/skipped_steps"] == 1


def _every_loss_body(rank, world_size, layout, hf_dir, names):
    from rlmega.workers.config import PolicyLossConfig

    initialize(layout)
    batch = make_batch()
    results = {}
    for name in names:
        worker = MegatronWorker(_spec(hf_dir), layout, dataclasses.replace(_config(), policy_loss=PolicyLossConfig(
            name=name, kl_loss_coef=0.05)), hf_dir=hf_dir)
        before = {n: t.clone() for n, t in worker.export_hf_weights(destinations=[0])}
        old_logp, _ = worker.compute_logprobs(batch)
        metrics = worker.update(_training_batch(batch, old_logp))
        after = dict(worker.export_hf_weights(destinations=[0]))
        results[name] = (metrics, max((float((after[n] - before[n]).abs().max()) for n in before), default=0.0))
    destroy()
    return results


def test_every_policy_loss_trains_through_config_alone(checkpoints):
    """Each name of the registry, set as ``policy_loss.name``, gets its own parameters' defaults and
    runs a real update on TP2: finite loss and gradient, weights moved."""
    from rlmega.algos import POLICY_LOSSES

    layout = ParallelLayout(tp=2, world_size=2)
    results = run_on_ranks(_every_loss_body, 2, timeout_s=TIMEOUT_S,
                           args=(layout, str(checkpoints["llama"]), sorted(POLICY_LOSSES)))[0]
    assert sorted(results) == sorted(POLICY_LOSSES)
    for name, (metrics, moved) in results.items():
        assert math.isfinite(metrics["actor/loss"]) and math.isfinite(metrics["actor/grad_norm"]), name
        assert metrics["actor/skipped_steps"] == 0 and moved > 0, name


def _on_policy_body(rank, world_size, layout, hf_dir, fused):
    initialize(layout)
    config = dataclasses.replace(_config(), policy_loss=PolicyLossConfig(name="ppo", entropy_coeff=0.01))
    worker = MegatronWorker(_spec(hf_dir), layout, config, hf_dir=hf_dir)
    batch = make_batch()
    generator = torch.Generator().manual_seed(9)
    advantages = [torch.randn(n, generator=generator) for n in batch.response_lengths]
    if fused:
        metrics, logp, entropy = worker.update_on_policy(batch.with_fields(advantages=advantages))
    else:
        logp, entropy = worker.compute_logprobs(batch)
        metrics = worker.update(batch.with_fields(old_logp=logp, advantages=advantages))
    weights = {name: tensor.clone() for name, tensor in worker.export_hf_weights(destinations=[0])}
    destroy()
    return metrics, weights, logp, entropy


@pytest.mark.parametrize("layout_args", [dict(world_size=1), dict(tp=2, pp=2, world_size=4)], ids=["tp1", "tp2-pp2"])
def test_on_policy_update_equals_a_separate_old_logprob_pass(checkpoints, layout_args):
    """The fused path (old log-probs from the update's own forward) gives the same step as scoring the
    batch first: weights and gradient norm to 1e-6, and the same log-probs and entropies."""
    layout = ParallelLayout(**layout_args)
    runs = {fused: run_on_ranks(_on_policy_body, layout.world_size, timeout_s=TIMEOUT_S,
                                args=(layout, str(checkpoints["llama"]), fused))[0] for fused in (False, True)}
    (separate, separate_weights, separate_logp, separate_entropy) = runs[False]
    (fused, fused_weights, fused_logp, fused_entropy) = runs[True]
    assert fused["actor/grad_norm"] == pytest.approx(separate["actor/grad_norm"], rel=1e-6)
    assert fused["actor/ppo_kl"] == 0.0 and fused["actor/pg_clipfrac"] == 0.0  # ratio exactly 1
    for name, tensor in separate_weights.items():
        torch.testing.assert_close(fused_weights[name], tensor, rtol=0, atol=1e-6, msg=name)
    for got, want in zip(fused_logp + fused_entropy, separate_logp + separate_entropy):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_on_policy_update_refuses_batches_that_need_the_separate_pass(checkpoints):
    with pytest.raises(Exception, match="ppo_epochs=1 and ppo_mini_batches=1"):
        run_on_ranks(_refused_body, 1, timeout_s=TIMEOUT_S, args=(str(checkpoints["llama"]),))


def _refused_body(rank, world_size, hf_dir):
    initialize(ParallelLayout())
    try:
        worker = MegatronWorker(_spec(hf_dir), ParallelLayout(), dataclasses.replace(_config(), ppo_mini_batches=2),
                                hf_dir=hf_dir)
        worker.update_on_policy(make_batch())
    finally:
        destroy()


def _host_collectives_body(rank, world_size, layout, hf_dir, host_collectives):
    from rlmega.parallel import cpu_platform

    initialize(layout, host_collectives=host_collectives)
    worker = MegatronWorker(_spec(hf_dir), layout, _config(min_microbatches=2), hf_dir=hf_dir)
    batch = make_batch()
    old_logp, _ = worker.compute_logprobs(batch)
    metrics = worker.update(_training_batch(batch, old_logp))
    weights = {name: tensor.clone() for name, tensor in worker.export_hf_weights(destinations=[0])}
    through_shared_memory = sum(host._sequence for host in cpu_platform._HOST_GROUPS.values() if host)
    destroy()
    return metrics, weights, old_logp, through_shared_memory


def test_shared_memory_collectives_give_the_gloo_run_bit_for_bit(checkpoints):
    """TP2 on one host: the tensor-parallel all-reduces, the checks' and the export's gathers through shared
    memory (rlmega.parallel.host_collectives) give exactly the log-probs, metrics and weights of gloo."""
    layout = ParallelLayout(tp=2, world_size=2)
    runs = {host: run_on_ranks(_host_collectives_body, 2, timeout_s=TIMEOUT_S,
                               args=(layout, str(checkpoints["llama"]), host))[0] for host in (False, True)}
    gloo_metrics, gloo_weights, gloo_logp, gloo_routed = runs[False]
    host_metrics, host_weights, host_logp, host_routed = runs[True]
    assert gloo_routed == 0 and host_routed > 20
    def numbers(metrics):
        return {name: value for name, value in metrics.items() if not name.startswith("perf/")}  # not timings

    assert numbers(host_metrics) == numbers(gloo_metrics)
    assert all(torch.equal(host, gloo) for host, gloo in zip(host_logp, gloo_logp))
    assert host_weights.keys() == gloo_weights.keys()
    assert all(torch.equal(host_weights[name], gloo_weights[name]) for name in gloo_weights)
