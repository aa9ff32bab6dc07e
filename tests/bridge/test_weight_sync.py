"""Train a Megatron model at TP=2, push its weights into a transformers engine, check the engine.

The engine starts from the original checkpoint; after the sync it must serve the trained weights:
its greedy log-probs equal the trainer's, its version advances, and a sync through a deliberately
wrong mapping (gate and up projections swapped) is caught by the post-sync check.
"""

import pytest
import torch
from megatron.core import parallel_state as ps

from hf_models import VOCAB, save_tiny_model
from rlmega.bridge import export_hf_weights, load_hf_weights
from rlmega.models import build_chunks, model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.rollout import HFEngine
from rlmega.sync import WeightSyncError, post_sync_check, push_weights
from rlmega.parallel.spawn import run_on_ranks
from rlmega.workers.logprobs import vocab_parallel_logprobs

PROMPTS = [[5, 17, 42, 8], [3, 99, 64]]


def _train_steps(model, spec, steps=3, lr=0.5):
    """Plain SGD on the log-likelihood of a fixed sequence; large enough to change greedy outputs."""
    tokens = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(11))
    for _ in range(steps):
        logits = model(tokens, torch.arange(12).unsqueeze(0), None)[0, :-1]
        logprobs, _ = vocab_parallel_logprobs(
            logits, tokens[0, 1:], vocab_size=spec.vocab_size,
            vocab_start=ps.get_tensor_model_parallel_rank() * logits.shape[-1], group=ps.get_tensor_model_parallel_group(),
        )
        model.zero_grad()
        (-logprobs.mean()).backward()
        with torch.no_grad():
            for param in model.parameters():
                param -= lr * param.grad


def _swap_gate_and_up(stream):
    for name, tensor in stream:
        if name.endswith("mlp.gate_proj.weight"):
            name = name.replace("gate_proj", "up_proj")
        elif name.endswith("mlp.up_proj.weight"):
            name = name.replace("up_proj", "gate_proj")
        yield name, tensor


def _engine(hf_dir, in_ray_actor):
    if not in_ray_actor:
        return HFEngine(hf_dir)
    import ray

    from rlmega.trainer.engine_actor import RemoteEngine, start_engine_actor

    ray.init(address="local", num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=100 * 1024**2, log_to_driver=False)
    return RemoteEngine(start_engine_actor(hf_dir), bucket_bytes=32 * 1024)  # many small buckets


def _sync_and_check(rank, world_size, hf_dir, in_ray_actor):
    layout = ParallelLayout(tp=2, world_size=2)
    initialize(layout)
    spec = model_spec_from_hf(hf_dir)
    [model] = build_chunks(spec, layout)
    load_hf_weights([model], spec, hf_dir)
    engine = _engine(hf_dir, in_ray_actor) if rank == 0 else None
    before = post_sync_check([model], spec, engine, PROMPTS)  # same weights on both sides

    _train_steps(model, spec)
    model.eval()
    stale = None
    try:
        post_sync_check([model], spec, engine, PROMPTS)
    except WeightSyncError as error:
        stale = str(error)
    stats = push_weights([model], spec, engine, version=1, bucket_bytes=32 * 1024)
    after = post_sync_check([model], spec, engine, PROMPTS)

    wrong = None
    if engine is not None:
        engine.update_weights(_swap_gate_and_up(export_hf_weights([model], spec)), version=2)
    else:
        for _ in export_hf_weights([model], spec):
            pass
    try:
        post_sync_check([model], spec, engine, PROMPTS)
    except WeightSyncError as error:
        wrong = str(error)
    with torch.no_grad():  # weights that blew up: NaN log-probs must not pass as "no difference"
        next(model.parameters()).fill_(float("nan"))
    blown = None
    stats_nan = push_weights([model], spec, engine, version=3, bucket_bytes=32 * 1024)
    try:
        post_sync_check([model], spec, engine, PROMPTS)
    except WeightSyncError as error:
        blown = str(error)
    assert stats_nan.version == 3
    version = engine.weight_version() if engine is not None else None
    if in_ray_actor and engine is not None:
        import ray

        ray.shutdown()
    destroy()
    return dict(before=before, stale=stale, after=after, wrong=wrong, blown=blown, tensors=stats.tensors,
                bytes=stats.bytes, version=version)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", directory)
    return directory


@pytest.mark.parametrize("in_ray_actor", [False, True], ids=["in-process", "ray-actor"])
def test_synced_engine_serves_the_trained_weights_and_a_wrong_mapping_is_caught(llama_dir, in_ray_actor):
    engine_rank, other_rank = run_on_ranks(_sync_and_check, 2, timeout_s=180, args=(str(llama_dir), in_ray_actor))
    for result in (engine_rank, other_rank):  # every rank reaches the same verdicts
        assert result["before"] <= 1e-4
        assert result["stale"] is not None and "post-sync check failed" in result["stale"]  # training changed the policy
        assert result["after"] <= 1e-4
        assert result["wrong"] is not None and "the engine is not serving the trained weights" in result["wrong"]
        assert result["blown"] is not None and "the trainer's log-probs on the probe prompts are not finite" in result["blown"]
    assert engine_rank["version"] == 3
    assert engine_rank["tensors"] == 4 * 9 + 3  # all 39 tensors reach the engine's rank...
    assert other_rank["tensors"] == 0  # ...and only that rank
