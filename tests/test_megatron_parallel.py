"""Real Megatron-Core on CPU: every parallel layout trains exactly like one rank.

A tiny GPT (RMSNorm, SwiGLU, RoPE, GQA) and a tiny MoE (alltoall dispatcher) are initialised once on
a single rank and saved with dist_checkpointing; each layout loads those weights, runs Megatron's
own schedule (1F1B, or interleaved for VPP) over micro-batches split across data-parallel ranks,
and saves its gradients and, after three Adam steps, its parameters. Everything is compared with
the single-rank run after unsharding.
"""

import dataclasses
from pathlib import Path

import pytest
import torch

from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.models import tiny_gpt
from rlmega.parallel.spawn import run_on_ranks

NUM_MICROBATCHES = 4
MICRO_BATCH_SIZE = 2
NUM_STEPS = 3
LR = 1e-2
# Adam divides by sqrt(v) + eps: with the usual 1e-8, gradients of ~1e-10 turn last-bit
# differences in summation order into visible parameter changes. 1e-3 (as in the worker tests)
# keeps the comparison about the parallel arithmetic rather than about that amplification; the
# gradients themselves are compared at rtol 1e-5 before any step.
ADAM_EPS = 1e-3
TIMEOUT_S = 240

DENSE = tiny_gpt.TinyGPTSpec()
MOE = tiny_gpt.TinyGPTSpec(num_experts=4)


def _train_and_record(rank, world_size, layout, spec, workdir, tag):
    """Load (or create) the shared weights, record gradients, train NUM_STEPS, record parameters."""
    from megatron.core import parallel_state

    workdir = Path(workdir)
    initialize(layout)
    chunks = tiny_gpt.build_model(spec, layout)
    if tag == "reference":
        tiny_gpt.save_weights(chunks, workdir / "initial")
    else:
        tiny_gpt.load_weights(chunks, workdir / "initial")
    batches = tiny_gpt.make_batches(NUM_MICROBATCHES, MICRO_BATCH_SIZE)
    dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    local_batches = batches[dp_rank::dp]  # each data-parallel rank trains on its share

    optimizer = tiny_gpt.build_optimizer(chunks, lr=LR, adam_eps=ADAM_EPS)
    losses, grad_norms = [], []
    for step in range(NUM_STEPS):
        tiny_gpt.zero_grads(chunks, optimizer)
        losses.append(tiny_gpt.forward_backward(chunks, local_batches))
        if step == 0:
            tiny_gpt.save_grads(chunks, workdir / f"grads-{tag}")
        _, grad_norm, _ = optimizer.step()
        grad_norms.append(grad_norm)
    tiny_gpt.save_weights(chunks, workdir / f"params-{tag}")
    destroy()
    return {"losses": losses, "grad_norms": grad_norms}


def _mean_losses(results):
    """Per-step loss averaged over the last-stage ranks (one per data-parallel rank)."""
    per_rank = [r["losses"] for r in results if r["losses"][0] is not None]
    return [sum(step) / len(step) for step in zip(*per_rank)]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    runs = {}
    for name, spec in (("dense", DENSE), ("moe", MOE)):
        workdir = tmp_path_factory.mktemp(name)
        [result] = run_on_ranks(
            _train_and_record, 1, timeout_s=TIMEOUT_S,
            args=(ParallelLayout(), spec, str(workdir), "reference"),
        )
        runs[name] = (workdir, result)
    return runs


def _assert_close_scaled(actual, expected, what):
    """rtol 1e-5 against the tensor's own scale, so near-zero entries do not demand exactness."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{what}: {m}")


LAYOUTS = {
    "tp2": ("dense", dict(tp=2, world_size=2)),
    "pp2-1f1b": ("dense", dict(pp=2, world_size=2)),
    "tp2-pp2": ("dense", dict(tp=2, pp=2, world_size=4)),
    "pp2-vpp2": ("dense", dict(pp=2, vpp=2, world_size=2)),
    "dp2": ("dense", dict(world_size=2)),
    "moe-ep2": ("moe", dict(ep=2, world_size=2)),
    "tp2-sp": ("dense", dict(tp=2, world_size=2), dict(sequence_parallel=True)),
    "moe-tp2-ep2-sp": ("moe", dict(tp=2, ep=2, world_size=4), dict(sequence_parallel=True)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_a_single_rank(name, references):
    model, layout_kwargs, *spec_changes = LAYOUTS[name]
    spec = dataclasses.replace(MOE if model == "moe" else DENSE, **(spec_changes[0] if spec_changes else {}))
    workdir, reference = references[model]
    layout = ParallelLayout(**layout_kwargs)
    results = run_on_ranks(
        _train_and_record, layout.world_size, timeout_s=TIMEOUT_S,
        args=(layout, spec, str(workdir), name),
    )

    losses = _mean_losses(results)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference["losses"]), rtol=1e-5, atol=0)
    for result in results:  # the clipped gradient norm is global: every rank agrees with one rank
        torch.testing.assert_close(torch.tensor(result["grad_norms"]), torch.tensor(reference["grad_norms"]), rtol=1e-5, atol=0)

    expected_grads = tiny_gpt.read_checkpoint(workdir / "grads-reference")
    grads = tiny_gpt.read_checkpoint(workdir / f"grads-{name}")
    assert grads.keys() == expected_grads.keys()
    for key in expected_grads:
        assert expected_grads[key].abs().max() > 0, f"{key} has no gradient; the comparison would be vacuous"
        _assert_close_scaled(grads[key], expected_grads[key], f"gradient of {key}")

    expected_params = tiny_gpt.read_checkpoint(workdir / "params-reference")
    params = tiny_gpt.read_checkpoint(workdir / f"params-{name}")
    initial = tiny_gpt.read_checkpoint(workdir / "initial")
    for key in expected_params:
        assert not torch.equal(expected_params[key], initial[key]), f"{key} did not train"
        _assert_close_scaled(params[key], expected_params[key], f"parameter {key} after {NUM_STEPS} steps")
