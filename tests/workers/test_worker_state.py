"""Worker state: offload/onload is bit-exact, checkpoints resume in the same and other layouts,
the critic learns values, LR schedules follow their formulas."""

import math
import multiprocessing

import pytest
import torch
from transformers import AutoModelForCausalLM

from deepseek_mtp_models import save_tiny_deepseek_mtp
from hf_models import save_tiny_model
from rlmega.models import model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import RankFailure, run_on_ranks
from rlmega.workers.checkpoint import TRACKER, CheckpointNotFoundError, latest_checkpoint
from rlmega.workers.config import BatchingConfig, CriticLossConfig, OptimizerConfig, WorkerConfig
from rlmega.workers.offload import model_tensors, optimizer_tensors
from rlmega.workers.worker import MegatronWorker
from worker_cases import make_batch

TIMEOUT_S = 300


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", path)
    return path


def _actor_config(**optimizer):
    return WorkerConfig(role="actor", optimizer=OptimizerConfig(lr=1e-2, adam_eps=1e-3, **optimizer),
                        batching=BatchingConfig(max_tokens_per_microbatch=24))


def _train_batch(worker, seed):
    batch = make_batch(seed)
    old_logp, _ = worker.compute_logprobs(batch)
    generator = torch.Generator().manual_seed(seed)
    return batch.with_fields(old_logp=old_logp, advantages=[torch.randn(n, generator=generator) for n in batch.response_lengths])


def _weights(worker):
    return {name: tensor.clone() for name, tensor in worker.export_hf_weights(destinations=[0])}


# ---- offload ---------------------------------------------------------------------------------

def _offload_body(rank, world_size, layout, hf_dir):
    initialize(layout)
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, _actor_config(), hf_dir=hf_dir)
    worker.update(_train_batch(worker, 1))  # optimizer state and gradient buffers now hold values
    tensors = list(model_tensors(worker.chunks)) + list(optimizer_tensors(worker.optimizer))
    before = [tensor.detach().clone() for tensor in tensors]
    moved_out = worker.offload()
    released = all(tensor.untyped_storage().nbytes() == 0 for tensor in tensors if tensor.numel())
    moved_in = worker.onload()
    identical = all(torch.equal(a, b) for a, b in zip(before, (t.detach() for t in tensors)))
    metrics = worker.update(_train_batch(worker, 2))  # still trains after the round trip
    destroy()
    return moved_out, moved_in, released, identical, math.isfinite(metrics["actor/loss"])


def test_offload_then_onload_is_bit_identical(llama):
    layout = ParallelLayout(tp=2, world_size=2)
    for moved_out, moved_in, released, identical, trains in run_on_ranks(_offload_body, 2, timeout_s=TIMEOUT_S, args=(layout, str(llama))):
        assert moved_out == moved_in > 0
        assert released and identical and trains


def _reference_offload_body(rank, world_size, layout, hf_dir):
    initialize(layout)
    config = WorkerConfig(role="ref", offload=True)
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, config, hf_dir=hf_dir)
    resting = worker.offloaded
    logp, _ = worker.compute_logprobs(make_batch())
    still_resting = worker.offloaded
    plain = MegatronWorker(model_spec_from_hf(hf_dir), layout, WorkerConfig(role="ref"), hf_dir=hf_dir)
    expected, _ = plain.compute_logprobs(make_batch())
    destroy()
    return resting, still_resting, all(torch.equal(a, b) for a, b in zip(logp, expected))


def test_offloaded_reference_comes_in_for_the_pass_and_goes_back(llama):
    layout = ParallelLayout(world_size=1)
    resting, still_resting, equal = run_on_ranks(_reference_offload_body, 1, timeout_s=TIMEOUT_S, args=(layout, str(llama)))[0]
    assert resting and still_resting and equal


# ---- checkpoints ------------------------------------------------------------------------------

def _fused_flags(worker) -> list:
    return [group["fused"] for inner in worker.optimizer.chained_optimizers for group in inner.optimizer.param_groups]


def _fused_adam_body(rank, world_size, layout, hf_dir):
    initialize(layout)
    steps = {}
    for fused in (True, False):
        worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, _actor_config(), hf_dir=hf_dir)
        built = _fused_flags(worker)
        for inner in worker.optimizer.chained_optimizers:
            for group in inner.optimizer.param_groups:
                group["fused"] = fused  # False: torch's default on CPU, one parameter at a time
        for seed in (1, 2, 3):
            worker.update(_train_batch(worker, seed))
        steps[fused] = (built, _weights(worker))
    destroy()
    return steps


def test_adam_steps_with_torchs_fused_cpu_kernel_and_the_same_result(llama):
    """On CPU the optimizer uses torch's fused AdamW kernel (not its Python loop over parameters), and three
    steps give the weights the loop gives, up to fp32 rounding."""
    steps = run_on_ranks(_fused_adam_body, 1, timeout_s=TIMEOUT_S, args=(ParallelLayout(), str(llama)))[0]
    built, fused = steps[True]
    assert built and all(built)
    _, looped = steps[False]
    for name, tensor in fused.items():
        torch.testing.assert_close(tensor, looped[name], atol=1e-6, rtol=0, msg=name)


def _save_body(rank, world_size, layout, hf_dir, root):
    initialize(layout)
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, _actor_config(lr_schedule="cosine", lr_warmup_steps=1),
                            hf_dir=hf_dir, total_steps=5)
    worker.update(_train_batch(worker, 1))
    path = worker.save_checkpoint(root, extra={"sampler": {"epoch": 0, "position": 6}})
    left = [child.name for child in multiprocessing.active_children()]  # a writer process outliving the save
    metrics = worker.update(_train_batch(worker, 2))  # the step a resumed run must reproduce
    weights = _weights(worker)
    destroy()
    return str(path), metrics, weights, left


def _resume_body(rank, world_size, layout, hf_dir, root):
    initialize(layout)
    spec = model_spec_from_hf(hf_dir)
    worker = MegatronWorker(spec, layout, _actor_config(lr_schedule="cosine", lr_warmup_steps=1), total_steps=5)
    extra = worker.load_checkpoint(root)  # the root: its tracker names the latest
    step = worker.step
    metrics = worker.update(_train_batch(worker, 2))
    weights = _weights(worker)
    fused = _fused_flags(worker)  # the load restored the saved param groups; the fused kernel is still on
    destroy()
    return extra, step, metrics, weights, fused


@pytest.fixture(scope="module")
def saved(llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    layout = ParallelLayout(tp=2, world_size=2)
    path, metrics, weights, left = run_on_ranks(_save_body, 2, timeout_s=TIMEOUT_S, args=(layout, str(llama), str(root)))[0]
    return root, path, metrics, weights, left


def test_checkpoint_is_megatron_shaped_and_complete(saved):
    root, path, _, _, left = saved
    assert left == []  # megatron-core's save leaves no results-queue process behind (rlmega.workers.checkpoint)
    assert (root / TRACKER).read_text() == "1"
    assert latest_checkpoint(root) == latest_checkpoint(path) == root / "iter_0000001"
    assert not list(root.glob("*.tmp"))


def test_half_written_checkpoint_is_never_the_latest(llama, saved, tmp_path):
    root, path, _, _, _ = saved
    (tmp_path / "iter_0000003.tmp").mkdir()  # a crash mid-save leaves only a staging directory
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / TRACKER).write_text("3")  # even a tracker naming it does not make it complete
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(RankFailure, match=f"{CheckpointNotFoundError.__name__}: no complete checkpoint"):
        run_on_ranks(_resume_body, 1, timeout_s=TIMEOUT_S, args=(ParallelLayout(), str(llama), str(tmp_path)))


@pytest.mark.parametrize("layout_args", [dict(tp=2, world_size=2), dict(world_size=1), dict(pp=2, world_size=2),
                                         dict(cp=2, world_size=2)],
                         ids=["same-tp2", "tp1", "pp2", "cp2"])
def test_resume_gives_the_identical_next_step(llama, saved, layout_args):
    root, _, expected_metrics, expected_weights, _ = saved
    layout = ParallelLayout(**layout_args)
    extra, step, metrics, weights, fused = run_on_ranks(_resume_body, layout.world_size, timeout_s=TIMEOUT_S, args=(layout, str(llama), str(root)))[0]
    assert extra == {"sampler": {"epoch": 0, "position": 6}} and step == 1
    assert fused and all(fused)
    assert metrics["actor/lr"] == pytest.approx(expected_metrics["actor/lr"])  # the schedule resumed too
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, expected_weights[name], atol=1e-5, rtol=0, msg=name)


# A model with MTP layers: its last pipeline stage holds the MTP layer and a tied copy of the embedding.

def _mtp_save_body(rank, world_size, layout, hf_dir, root):
    initialize(layout)
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, _actor_config(), hf_dir=hf_dir)
    worker.update(_train_batch(worker, 1))  # weights off the HF ones, optimizer state for every parameter
    worker.save_checkpoint(root)
    weights = _weights(worker)
    worker.update(_train_batch(worker, 2))  # the step a resumed actor must reproduce, in any layout
    after = _weights(worker)
    destroy()
    return weights, after


def _mtp_load_body(rank, world_size, layout, hf_dir, root, role):
    initialize(layout)
    config = _actor_config() if role == "actor" else WorkerConfig(role=role)
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, config)  # random weights until loaded
    worker.load_checkpoint(root)
    weights = _weights(worker)
    destroy()
    return weights


@pytest.fixture(scope="module")
def mtp_saved(tmp_path_factory):
    hf_dir, root = tmp_path_factory.mktemp("deepseek-v3-mtp"), tmp_path_factory.mktemp("mtp-checkpoints")
    save_tiny_deepseek_mtp(hf_dir)
    layout = ParallelLayout(pp=2, first_stage_layers=1, world_size=2)  # uneven: 1 + 3 layers, MTP on the last stage
    weights, after = run_on_ranks(_mtp_save_body, 2, timeout_s=TIMEOUT_S, args=(layout, str(hf_dir), str(root)))[0]
    return hf_dir, root, weights, after


@pytest.mark.parametrize("layout_args, role", [
    (dict(tp=2, pp=2, world_size=4), "actor"),  # even stages, the MTP layer split over tp
    (dict(world_size=1), "actor"),  # MTP on the one stage, beside the embedding
    (dict(ep=2, world_size=2), "ref"),  # the model alone
], ids=["tp2-pp2", "pp1", "ep2-model"])
def test_mtp_checkpoint_saved_at_uneven_pp2_loads_bit_exact_in_another_layout(mtp_saved, layout_args, role):
    hf_dir, root, expected, _ = mtp_saved
    assert "model.layers.4.eh_proj.weight" in expected  # the MTP layer is in the checkpoint
    layout = ParallelLayout(**layout_args)
    weights = run_on_ranks(_mtp_load_body, layout.world_size, timeout_s=TIMEOUT_S,
                           args=(layout, str(hf_dir), str(root), role))[0]
    assert sorted(weights) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


def _mtp_carry_body(rank, world_size, layout, hf_dir, source, target):
    initialize(layout)
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, _actor_config())
    worker.load_checkpoint(source)
    worker.save_checkpoint(target)  # no step between: the state passes through this layout unchanged
    destroy()


def _mtp_resume_body(rank, world_size, layout, hf_dir, root):
    initialize(layout)
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, _actor_config())
    worker.load_checkpoint(root)
    worker.update(_train_batch(worker, 2))
    weights = _weights(worker)
    destroy()
    return weights


def test_mtp_actor_state_passes_through_layouts_that_split_the_experts_unchanged(mtp_saved, tmp_path):
    """Model and optimizer saved at uneven PP2 (one optimizer, and a rank 0 whose stage has no experts),
    loaded and saved again at EP2 (megatron-core chains a second optimizer for the experts), then at
    uneven PP2 x EP2 (a chain saved by a rank 0 without experts), then resumed in the first layout:
    the next step is the one the first layout took without the detour (Adam's moments and step intact)."""
    hf_dir, root, _, expected = mtp_saved
    hops = [ParallelLayout(ep=2, world_size=2), ParallelLayout(pp=2, first_stage_layers=1, ep=2, world_size=4)]
    source = root
    for index, layout in enumerate(hops):
        target = tmp_path / f"hop{index}"
        run_on_ranks(_mtp_carry_body, layout.world_size, timeout_s=TIMEOUT_S,
                     args=(layout, str(hf_dir), str(source), str(target)))
        source = target
    weights = run_on_ranks(_mtp_resume_body, 2, timeout_s=TIMEOUT_S,
                           args=(ParallelLayout(pp=2, first_stage_layers=1, world_size=2), str(hf_dir), str(source)))[0]
    assert sorted(weights) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


# ---- critic -----------------------------------------------------------------------------------

def _critic_body(rank, world_size, layout, hf_dir):
    initialize(layout)
    config = WorkerConfig(role="critic", optimizer=OptimizerConfig(lr=3e-3), critic_loss=CriticLossConfig(cliprange_value=None))
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, config, hf_dir=hf_dir)
    batch = make_batch()
    heads = [p for chunk in worker.chunks for p in chunk.parameters() if getattr(p, "is_value_head", False)]
    with torch.no_grad():
        for head in heads:  # the same known head on every rank, for the reference
            head.copy_(torch.randn(head.shape, generator=torch.Generator().manual_seed(8)))
    values = worker.compute_values(batch)
    with torch.no_grad():
        for head in heads:
            head.zero_()  # learn from the usual zero start
    generator = torch.Generator().manual_seed(4)
    returns = [torch.randn(n, generator=generator) for n in batch.response_lengths]
    losses = []
    for _ in range(10):
        losses.append(worker.update(batch.with_fields(values=worker.compute_values(batch), returns=returns))["critic/vf_loss"])
    destroy()
    return values, len(heads), losses


def _hf_values(hf_dir, batch, hidden_size):
    """The reference: HF's final (normed) hidden states at the response-predicting positions, times the head."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    head = torch.randn((1, hidden_size), generator=torch.Generator().manual_seed(8))
    values = []
    with torch.no_grad():
        for tokens, prompt in zip(batch.tokens, batch.prompt_lengths):
            hidden = model(tokens.unsqueeze(0), output_hidden_states=True).hidden_states[-1][0]
            values.append((hidden @ head.T)[prompt - 1:-1, 0])
    return values


@pytest.mark.parametrize("layout_args", [dict(tp=2, world_size=2), dict(cp=2, world_size=2)], ids=["tp2", "cp2"])
def test_critic_values_match_a_reference_forward_and_value_loss_falls(llama, layout_args):
    layout = ParallelLayout(**layout_args)
    expected = _hf_values(llama, make_batch(), 64)
    for values, num_heads, losses in run_on_ranks(_critic_body, 2, timeout_s=TIMEOUT_S, args=(layout, str(llama))):
        assert num_heads == 1  # one value head, on the last stage
        for got, want in zip(values, expected):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert losses[-1] < 0.5 * losses[0], losses


# ---- learning-rate schedules ------------------------------------------------------------------

def _schedule_body(rank, world_size, layout, hf_dir, schedules):
    initialize(layout)
    spec = model_spec_from_hf(hf_dir)
    curves = {}
    for name, settings in schedules.items():
        worker = MegatronWorker(spec, layout, WorkerConfig(optimizer=OptimizerConfig(**settings)), total_steps=10)
        curve = []
        for _ in range(10):
            worker.scheduler.step(increment=1)
            curve.append(worker.optimizer.param_groups[0]["lr"])
        curves[name] = curve
    destroy()
    return curves


def test_lr_schedules_follow_their_formulas(llama):
    peak, floor = 1e-3, 1e-4
    schedules = {
        "constant": dict(lr=peak, lr_schedule="constant", lr_warmup_steps=2),
        "cosine": dict(lr=peak, min_lr=floor, lr_schedule="cosine", lr_warmup_steps=2),
        "wsd": dict(lr=peak, min_lr=floor, lr_schedule="wsd", lr_warmup_steps=2, wsd_decay_steps=4),
    }
    curves = run_on_ranks(_schedule_body, 1, timeout_s=TIMEOUT_S, args=(ParallelLayout(), str(llama), schedules))[0]
    warmup = [peak / 2, peak]
    assert curves["constant"] == pytest.approx(warmup + [peak] * 8)
    cosine = [floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * (step - 2) / 8)) for step in range(3, 11)]
    assert curves["cosine"] == pytest.approx(warmup + cosine)
    wsd = [peak] * 4 + [peak - (peak - floor) * (step - 6) / 4 for step in range(7, 11)]
    assert curves["wsd"] == pytest.approx(warmup + wsd)
