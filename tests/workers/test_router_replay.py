"""MoE routing replay (R2, R3): the routing recorded in one pass is exactly what a later pass routes through,
in every layout (tensor with sequence parallelism, expert, pipeline, context and data parallel)."""

import dataclasses
import json

import pytest
import torch

from rlmega.models import model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import RankFailure, run_on_ranks
from rlmega.workers.config import BatchingConfig, WorkerConfig
from rlmega.workers.worker import MegatronWorker
from worker_cases import make_batch

TIMEOUT_S = 300
ATOL = 1e-6  # the same routing and weights: the same arithmetic, up to reduction order (fp32)


def _worker(layout, hf_dir, packing, replay="r2"):
    config = WorkerConfig(role="actor", router_replay=replay,
                          batching=BatchingConfig(packing=packing, max_tokens_per_microbatch=20))
    return MegatronWorker(model_spec_from_hf(hf_dir), layout, config, hf_dir=hf_dir)


def _perturb_routers(worker, scale: float) -> None:
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for chunk in worker.chunks:
            for name, param in chunk.named_parameters():
                if name.endswith("router.weight"):
                    param.add_(scale * torch.randn(param.shape, generator=generator).to(param.dtype))


def _record_and_replay(rank, world_size, layout, hf_dir, packing):
    initialize(layout)
    worker = _worker(layout, hf_dir, packing)
    batch = make_batch()
    logp, _ = worker.compute_logprobs(batch)  # records (R2)
    routing = worker._recorded_routing[1]
    replayed, _ = worker.compute_logprobs(dataclasses.replace(batch, routing=routing))  # replays (as R3)
    moe_layers = routing[0].shape[1]
    shifted = [(r.long() + 1) % worker.spec.num_experts for r in routing]  # every token to other experts
    moved, _ = worker.compute_logprobs(dataclasses.replace(batch, routing=[s.to(torch.int16) for s in shifted]))
    destroy()
    return logp, replayed, moved, routing, moe_layers


def _moe_shape(hf_dir) -> tuple[int, int]:
    """(MoE layers, top-k) from config.json: DeepSeek's first ``first_k_dense_replace`` layers are dense."""
    config = json.loads((hf_dir / "config.json").read_text())
    return config["num_hidden_layers"] - (config.get("first_k_dense_replace") or 0), config["num_experts_per_tok"]

LAYOUTS = {
    "tp1": dict(world_size=1),
    "tp2-sp": dict(tp=2, world_size=2),
    "ep2": dict(ep=2, world_size=2),
    "pp2": dict(pp=2, world_size=2),
    "cp2": dict(cp=2, world_size=2),
    "dp2": dict(world_size=2),
}


@pytest.fixture(scope="module")
def single_rank_routing(checkpoints):
    """The routing one rank records, per model and packing: what every layout must record too."""
    found = {}
    for model in ("qwen3-moe", "deepseek-v3"):
        for packing in (True, False):
            found[model, packing] = run_on_ranks(_record_and_replay, 1, timeout_s=TIMEOUT_S, args=(
                ParallelLayout(), str(checkpoints[model]), packing))[0][3]
    return found


CASES = ([("qwen3-moe", name, True) for name in LAYOUTS]
         + [("qwen3-moe", name, False) for name in ("tp1", "pp2", "cp2")]  # padded rows; pp: fixed shapes
         + [("deepseek-v3", name, True) for name in ("tp1", "pp2", "cp2")])  # a dense first layer before the MoE ones


@pytest.mark.parametrize("model,layout_name,packing", CASES,
                         ids=[f"{m}-{n}-{'packed' if p else 'padded'}" for m, n, p in CASES])
def test_recorded_routing_replays_to_the_same_logprobs(checkpoints, single_rank_routing, model, layout_name, packing):
    layout = ParallelLayout(**LAYOUTS[layout_name])
    results = run_on_ranks(_record_and_replay, layout.world_size, timeout_s=TIMEOUT_S,
                           args=(layout, str(checkpoints[model]), packing))
    batch = make_batch()
    layers, topk = _moe_shape(checkpoints[model])
    for logp, replayed, moved, routing, moe_layers in results:
        assert moe_layers == layers
        # Every rank assembles the whole batch's routing, equal to what one rank records.
        assert [tuple(r.shape) for r in routing] == [(n, layers, topk) for n in batch.lengths]
        for got, want in zip(routing, single_rank_routing[model, packing]):
            assert torch.equal(got, want)
        for got, want in zip(replayed, logp):  # placed right: the same network, the same log-probs
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        # ... and replay is applied: routing every token elsewhere changes them.
        assert max(float((a - b).abs().max()) for a, b in zip(moved, logp)) > 1e-3


def _update_through_recorded_routing(rank, world_size, layout, hf_dir, replay):
    initialize(layout)
    worker = _worker(layout, hf_dir, packing=True, replay=replay)
    batch = make_batch()
    old_logp, _ = worker.compute_logprobs(batch)
    routing = getattr(worker, "_recorded_routing", (None, None))[1]
    _perturb_routers(worker, 0.5)  # the routers now choose other experts for many tokens
    with_recorded = without = None
    if routing is not None:
        with_recorded, _ = worker.compute_logprobs(dataclasses.replace(batch, routing=routing))
    else:
        without, _ = worker.compute_logprobs(batch)
    advantages = [torch.ones(n) for n in batch.response_lengths]
    metrics = worker.update(batch.with_fields(old_logp=old_logp, advantages=advantages))
    destroy()
    return old_logp, with_recorded, without, metrics


@pytest.mark.parametrize("layout_name", ["tp1", "tp2-sp", "pp2"])
def test_r2_update_routes_through_the_old_policys_routing(checkpoints, layout_name):
    """After the routers moved, the update's forward pass (its ppo_kl) is the recorded routing's, not the routers' own."""
    layout = ParallelLayout(**LAYOUTS[layout_name])
    hf_dir = str(checkpoints["qwen3-moe"])
    r2 = run_on_ranks(_update_through_recorded_routing, layout.world_size, timeout_s=TIMEOUT_S, args=(layout, hf_dir, "r2"))
    old_logp, with_recorded, _, metrics = r2[0]
    expected = float((torch.cat(old_logp) - torch.cat(with_recorded)).mean())
    assert metrics["actor/ppo_kl"] == pytest.approx(expected, abs=1e-6)
    free = run_on_ranks(_update_through_recorded_routing, layout.world_size, timeout_s=TIMEOUT_S,
                        args=(layout, hf_dir, "none"))
    _, _, without, free_metrics = free[0]
    assert free_metrics["actor/ppo_kl"] == pytest.approx(float((torch.cat(old_logp) - torch.cat(without)).mean()), abs=1e-6)
    assert abs(free_metrics["actor/ppo_kl"] - metrics["actor/ppo_kl"]) > 1e-4  # the perturbation moved the routing


def _update_without_recording(rank, world_size, hf_dir):
    initialize(ParallelLayout())
    try:
        worker = _worker(ParallelLayout(), hf_dir, packing=True)
        batch = make_batch()
        worker.update(batch.with_fields(old_logp=[torch.zeros(n) for n in batch.response_lengths],
                                        advantages=[torch.ones(n) for n in batch.response_lengths]))
    finally:
        destroy()


def _build_only(rank, world_size, hf_dir):
    initialize(ParallelLayout())
    try:
        _worker(ParallelLayout(), hf_dir, packing=True)
    finally:
        destroy()


def test_r2_update_without_a_recorded_pass_is_refused(checkpoints):
    with pytest.raises(RankFailure, match="routing was not recorded"):
        run_on_ranks(_update_without_recording, 1, timeout_s=TIMEOUT_S, args=(str(checkpoints["qwen3-moe"]),))


def test_router_replay_needs_a_moe_model(checkpoints):
    with pytest.raises(RankFailure, match="this model has no experts"):
        run_on_ranks(_build_only, 1, timeout_s=TIMEOUT_S, args=(str(checkpoints["llama"]),))


def _megatron_routing(rank, world_size, layout, hf_dir, tokens, prompt_lengths):
    from rlmega.workers.batching import SequenceBatch

    initialize(layout)
    worker = _worker(layout, hf_dir, packing=True)
    worker.compute_logprobs(SequenceBatch(tokens, prompt_lengths))
    routing = worker._recorded_routing[1]
    destroy()
    return routing


@pytest.mark.parametrize("layout_name", ["tp1", "ep2"])
def test_engine_routing_is_the_trainers_routing(checkpoints, layout_name):
    """R3 is only sound if the engine's experts are the ones Megatron would choose with the same weights:
    the hf engine's recorded routing equals the Megatron actor's, token for token (the last token aside,
    which the engine never feeds back)."""
    from rlmega.rollout.hf_engine import HFEngine
    from rlmega.rollout.protocol import SamplingParams

    hf_dir = checkpoints["qwen3-moe"]
    prompts = [[3, 17, 5, 9], [8, 1, 22, 40, 9, 2, 7]]
    generations = HFEngine(hf_dir, record_routing=True).generate(prompts, SamplingParams(n=2, max_new_tokens=5, seed=2))
    tokens = [torch.tensor(prompts[g.prompt_index] + g.response_token_ids) for g in generations]
    layout = ParallelLayout(**LAYOUTS[layout_name])
    megatron = run_on_ranks(_megatron_routing, layout.world_size, timeout_s=TIMEOUT_S,
                            args=(layout, str(hf_dir), tokens, [len(prompts[g.prompt_index]) for g in generations]))[0]
    for generation, trainer in zip(generations, megatron):
        engine = generation.routing
        assert engine.shape == trainer.shape
        assert torch.equal(engine[:-1].sort(dim=-1).values, trainer[:-1].sort(dim=-1).values)


def _replayed_update(rank, world_size, layout, hf_dir, recompute):
    initialize(layout)
    config = WorkerConfig(role="actor", router_replay="r2", recompute_granularity="full" if recompute else None,
                          batching=BatchingConfig(packing=True, max_tokens_per_microbatch=20))
    worker = MegatronWorker(model_spec_from_hf(hf_dir), layout, config, hf_dir=hf_dir)
    batch = make_batch()
    old_logp, _ = worker.compute_logprobs(batch)
    _perturb_routers(worker, 0.5)
    metrics = worker.update(batch.with_fields(old_logp=old_logp, advantages=[torch.ones(n) for n in batch.response_lengths]))
    weights = [param.detach().clone() for chunk in worker.chunks for param in chunk.parameters()]
    destroy()
    return metrics, weights


def test_recomputed_layers_replay_their_own_micro_batchs_routing(checkpoints):
    """Full recomputation with pipeline stages: the backward pass recomputes a layer of micro-batch i while
    later micro-batches' routing is already set; the gradient must still be the one without recomputation."""
    layout = ParallelLayout(pp=2, world_size=2)
    hf_dir = str(checkpoints["qwen3-moe"])
    plain = run_on_ranks(_replayed_update, 2, timeout_s=TIMEOUT_S, args=(layout, hf_dir, False))
    recomputed = run_on_ranks(_replayed_update, 2, timeout_s=TIMEOUT_S, args=(layout, hf_dir, True))
    assert plain[0][0]["actor/grad_norm"] == pytest.approx(recomputed[0][0]["actor/grad_norm"], rel=1e-6)
    for (_, want), (_, got) in zip(plain, recomputed):
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


# ---- the acceptance case: engine and trainer break routing ties the other way ------------------------

DELTA = 1e-6  # far below anything that moves a log-prob by 1e-5, enough to decide a tie


def _tied_routers(source, target, sign: float):
    """A copy of ``source`` whose routers tie experts (Qwen3-MoE: 3 with 2; DeepSeek-V3: group {2, 3} with
    {0, 1}), each tie broken by ``sign * DELTA`` along expert 0's row: a copy with the other sign routes the
    tokens at the tie to other experts, with gate values that differ by ~DELTA."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    deepseek = any(name.endswith("e_score_correction_bias") for name in tensors)
    for name, weight in tensors.items():
        if name.endswith("mlp.gate.weight"):
            pairs = [(2, 0), (3, 1)] if deepseek else [(3, 2)]
            for tied, like in pairs:
                weight[tied] = weight[like] + sign * DELTA * weight[0]
        if name.endswith("e_score_correction_bias"):
            weight[2], weight[3] = weight[0], weight[1]
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def _trainer_logprobs(rank, world_size, layout, hf_dir, tokens, prompt_lengths, routing):
    from rlmega.workers.batching import SequenceBatch

    initialize(layout)
    batch = SequenceBatch(tokens, prompt_lengths, temperature=1.0)
    free, _ = _worker(layout, hf_dir, packing=True, replay="none").compute_logprobs(batch)
    worker = _worker(layout, hf_dir, packing=True, replay="r3")
    replayed, _ = worker.compute_logprobs(dataclasses.replace(batch, routing=routing))
    differs = worker._routing_metrics
    destroy()
    return free, replayed, differs


@pytest.mark.parametrize("model", ["qwen3-moe", "deepseek-v3"])
def test_r3_trainer_logprobs_equal_the_engines_where_routing_ties_break_differently(checkpoints, tmp_path, model):
    from rlmega.rollout.hf_engine import HFEngine
    from rlmega.rollout.protocol import SamplingParams

    engine_dir = _tied_routers(checkpoints[model], tmp_path / "engine", +1.0)
    trainer_dir = _tied_routers(checkpoints[model], tmp_path / "trainer", -1.0)
    prompts = [[3, 17, 5, 9], [8, 1, 22, 40, 9, 2, 7], [12, 4]]
    generations = HFEngine(engine_dir, record_routing=True).generate(
        prompts, SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=4))
    tokens = [torch.tensor(prompts[g.prompt_index] + g.response_token_ids) for g in generations]
    layout = ParallelLayout(ep=2, world_size=2)
    free, replayed, differs = run_on_ranks(_trainer_logprobs, 2, timeout_s=TIMEOUT_S, args=(
        layout, str(trainer_dir), tokens, [len(prompts[g.prompt_index]) for g in generations],
        [g.routing for g in generations]))[0]
    engine = [torch.tensor(g.logprobs) for g in generations]
    assert differs["routing/rollout_differs"] > 0.05, differs  # the trainer alone would route elsewhere
    replayed_gap = max(float((a - b).abs().max()) for a, b in zip(replayed, engine))
    free_gap = max(float((a - b).abs().max()) for a, b in zip(free, engine))
    assert replayed_gap <= 1e-5, replayed_gap
    assert free_gap > 1e-3, free_gap


def _r2_after_tie_flip(rank, world_size, layout, hf_dir):
    initialize(layout)
    worker = _worker(layout, hf_dir, packing=True, replay="r2")
    batch = make_batch()
    old_logp, _ = worker.compute_logprobs(batch)  # records this tie-break
    recorded = worker._recorded_routing[1]
    deepseek = worker.spec.config.get("moe_router_score_function") == "sigmoid"
    with torch.no_grad():  # flip every tie to the other side, as an update of the routers might
        for chunk in worker.chunks:
            for name, param in chunk.named_parameters():
                if name.endswith("router.weight"):
                    for tied in ((2, 3) if deepseek else (3,)):
                        param[tied] += 2 * DELTA * param[0]
    replayed, _ = worker.compute_logprobs(dataclasses.replace(batch, routing=recorded))
    free, _ = worker.compute_logprobs(batch)
    destroy()
    return old_logp, replayed, free


@pytest.mark.parametrize("model", ["qwen3-moe", "deepseek-v3"])
def test_r2_update_logprobs_stay_the_old_policys_when_routing_ties_flip(checkpoints, tmp_path, model):
    hf_dir = _tied_routers(checkpoints[model], tmp_path / "tied", -1.0)
    old_logp, replayed, free = run_on_ranks(_r2_after_tie_flip, 2, timeout_s=TIMEOUT_S,
                                            args=(ParallelLayout(ep=2, world_size=2), str(hf_dir)))[0]
    assert max(float((a - b).abs().max()) for a, b in zip(replayed, old_logp)) <= 1e-5
    assert max(float((a - b).abs().max()) for a, b in zip(free, old_logp)) > 1e-3
