"""The bodies of the minimal GPU tier (tests/gpu/test_minimal_tier.py), written once for both devices.

Each body runs on one spawned rank (``rlmega.parallel.spawn.run_on_ranks``): on CUDA in bf16 when the
rank sees a GPU (NCCL, Megatron's own CUDA paths), on CPU in fp32 otherwise (gloo, rlmega's CPU
platform). The CPU contract tests run exactly these bodies, so a broken body fails here, not on the
GPU machine. Bodies return plain CPU tensors and numbers; the tests judge them.
"""

import contextlib
import math

import torch
from safetensors.torch import load_file

from rlmega.models import model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.plan.placement import allocated_bytes, on_host, simulated_gpu, storage_key
from rlmega.rollout import HFEngine, SamplingParams
from rlmega.sync import WeightSyncError, post_sync_check, push_weights, require_version
from rlmega.workers.batching import SequenceBatch
from rlmega.workers.config import BatchingConfig, OptimizerConfig, PolicyLossConfig, WorkerConfig
from rlmega.workers.offload import model_tensors, optimizer_tensors
from rlmega.workers.worker import MegatronWorker

from .conftest import PROMPTS

GREEDY = SamplingParams(temperature=0, max_new_tokens=8)


def _start() -> str:
    """Megatron's groups at world size 1 (NCCL with CUDA, gloo without); the device's name."""
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references stay fp32
        torch.backends.cudnn.allow_tf32 = False
    initialize(ParallelLayout())
    return "cuda" if torch.cuda.is_available() else "cpu"


def worker_dtype() -> str:
    return "bf16" if torch.cuda.is_available() else "fp32"


def torch_dtype() -> torch.dtype:
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def training_batch() -> SequenceBatch:
    generator = torch.Generator().manual_seed(0)
    tokens = [torch.tensor(prompt + torch.randint(3, 512, (7 + 3 * i,), generator=generator).tolist())
              for i, prompt in enumerate(PROMPTS)]
    return SequenceBatch(tokens, [len(prompt) for prompt in PROMPTS])


def actor(hf_dir, dtype: str, **optimizer) -> MegatronWorker:
    config = WorkerConfig(role="actor", dtype=dtype, batching=BatchingConfig(packing=False),
                          optimizer=OptimizerConfig(lr=1e-2, adam_eps=1e-3, lr_schedule="constant", **optimizer),
                          policy_loss=PolicyLossConfig(name="ppo"))
    return MegatronWorker(model_spec_from_hf(hf_dir), ParallelLayout(), config, hf_dir=hf_dir)


def train_once(worker: MegatronWorker, seed: int = 1) -> dict:
    batch = training_batch()
    old_logp, _ = worker.compute_logprobs(batch)
    generator = torch.Generator().manual_seed(seed)
    advantages = [torch.randn(n, generator=generator) for n in batch.response_lengths]
    return worker.update(batch.with_fields(old_logp=old_logp, advantages=advantages))


def hf_weights(worker: MegatronWorker) -> dict[str, torch.Tensor]:
    return {name: tensor.float().cpu().clone() for name, tensor in worker.export_hf_weights()}


def _arrays(tensors: list) -> list:
    """The model's and optimizer's tensors but the scalars: torch's Adam keeps each ``step`` count as a
    CPU scalar, which stays in host memory and is not offloaded."""
    return [tensor for tensor in tensors if tensor.dim()]


# ---- the bodies ------------------------------------------------------------------------------

def update_body(rank, world_size, hf_dir, dtype):
    """One PPO update; the change of every HF weight, and the gradient norm."""
    _start()
    worker = actor(hf_dir, dtype)
    before = hf_weights(worker)
    metrics = train_once(worker)
    after = hf_weights(worker)
    destroy(including_default_group=True)
    return {"delta": {name: after[name] - before[name] for name in before}, "grad_norm": metrics["actor/grad_norm"]}


def offload_body(rank, world_size, hf_dir, dtype):
    """Offload then onload after an update (optimizer state filled): bit-exact, memory released, trains on."""
    device = _start()
    worker = actor(hf_dir, dtype)
    train_once(worker, seed=1)
    tensors = list(model_tensors(worker.chunks)) + list(optimizer_tensors(worker.optimizer))
    before = [tensor.detach().clone() for tensor in tensors]
    if device == "cuda":
        torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated() if device == "cuda" else 0
    moved_out = worker.offload()
    released = all(tensor.untyped_storage().nbytes() == 0 for tensor in _arrays(tensors))
    freed = resident - torch.cuda.memory_allocated() if device == "cuda" else 0
    moved_in = worker.onload()
    identical = all(torch.equal(a, b) for a, b in zip(before, (t.detach() for t in tensors)))
    on_device = all(t.device.type == device for t in _arrays(tensors))
    loss = train_once(worker, seed=2)["actor/loss"]
    destroy(including_default_group=True)
    return dict(moved_out=moved_out, moved_in=moved_in, released=released, freed=freed, identical=identical,
                on_device=on_device, trains=math.isfinite(loss))


def distributed_optimizer_body(rank, world_size, hf_dir, settings):
    """One fp32 update per ``distributed_optimizer`` setting: the optimizer's class and the weights after."""
    _start()
    results = []
    for setting in settings:
        worker = actor(hf_dir, "fp32", distributed_optimizer=setting)
        train_once(worker)
        inner = getattr(worker.optimizer, "chained_optimizers", [worker.optimizer])
        results.append(([type(o).__name__ for o in inner], hf_weights(worker)))
    destroy(including_default_group=True)
    return results


def export_body(rank, world_size, hf_dir, dtype):
    """The bridge's export of the loaded model: names, devices, dtypes, and values against the checkpoint
    rounded to the worker's dtype (loading and exporting only round once, so they must be equal)."""
    device = _start()
    worker = MegatronWorker(model_spec_from_hf(hf_dir), ParallelLayout(), WorkerConfig(role="ref", dtype=dtype),
                            hf_dir=hf_dir)
    checkpoint = load_file(next(hf_dir.glob("*.safetensors")))
    wanted = torch_dtype()
    devices, dtypes, differing = set(), set(), []
    names = []
    for name, tensor in worker.export_hf_weights():
        names.append(name)
        devices.add(tensor.device.type)
        dtypes.add(tensor.dtype)
        if not torch.equal(tensor.cpu(), checkpoint[name].to(wanted)):
            differing.append(name)
    destroy(including_default_group=True)
    return dict(device=device, devices=devices, dtypes=dtypes, differing=differing,
                names=sorted(names), checkpoint_names=sorted(checkpoint))


def hf_engine_check(hf_dir, other_dir, device: str, dtype: torch.dtype):
    """HFEngine on ``device``: greedy log-probs equal teacher forcing, an update serves the other
    checkpoint, sleep releases the weights and wake restores the same outputs. Runs in the test's process."""
    engine = HFEngine(hf_dir, dtype=dtype, device=device, attn_implementation="eager")
    greedy = engine.generate(PROMPTS, GREEDY)
    rescored = []
    with torch.no_grad():
        for g in greedy:
            prompt = PROMPTS[g.prompt_index]
            tokens = torch.tensor([prompt + g.response_token_ids], device=device)
            logits = engine.model(tokens).logits[0, len(prompt) - 1:-1].float()
            expected = torch.log_softmax(logits, -1).gather(-1, tokens[0, len(prompt):, None])[:, 0].cpu()
            rescored.append((torch.tensor(g.logprobs) - expected).abs().max().item())
    other = sorted((n, t.to(device=device, dtype=dtype)) for n, t in load_file(next(other_dir.glob("*.safetensors"))).items())
    engine.update_weights(iter(other), version=1)
    updated = engine.generate(PROMPTS, GREEDY)
    fresh = HFEngine(other_dir, dtype=dtype, device=device, attn_implementation="eager").generate(PROMPTS, GREEDY)
    if device == "cuda":
        torch.cuda.synchronize()
    awake = torch.cuda.memory_allocated() if device == "cuda" else 0
    engine.sleep(level=1)
    asleep = torch.cuda.memory_allocated() if device == "cuda" else 0
    engine.wake()
    woken = engine.generate(PROMPTS, GREEDY)
    return dict(
        device=device, rescored_max=max(rescored), version=engine.weight_version(),
        updated_equals_fresh=[g.response_token_ids for g in updated] == [g.response_token_ids for g in fresh],
        changed=[g.response_token_ids for g in updated] != [g.response_token_ids for g in greedy],
        freed=awake - asleep, same_after_wake=[g.response_token_ids for g in woken] == [g.response_token_ids for g in updated],
    )


def sync_body(rank, world_size, hf_dir, other_dir, dtype, atol):
    """Train the actor once, push it in-process into an engine that starts from other weights, and run
    the post-sync check; before the push, the same check must catch the engine's wrong weights."""
    device = _start()
    worker = actor(hf_dir, dtype)
    train_once(worker)
    engine = HFEngine(other_dir, dtype=torch_dtype(), device=device, attn_implementation="eager")
    try:
        post_sync_check(worker.chunks, worker.spec, engine, PROMPTS, atol=atol)
        caught_unsynced = False
    except WeightSyncError:
        caught_unsynced = True
    stats = push_weights(worker.chunks, worker.spec, engine, version=1, transport="in_process")
    require_version(engine, 1)
    worst = post_sync_check(worker.chunks, worker.spec, engine, PROMPTS, atol=atol, version=1)
    # transformers' own names: a MoE's experts are fused there, so they are not the exported checkpoint names
    synced_on_device = all(tensor.device.type == device for tensor in engine.model.state_dict().values())
    destroy(including_default_group=True)
    return dict(caught_unsynced=caught_unsynced, transport=stats.transport, bytes=stats.bytes, worst=worst,
                version=engine.weight_version(), synced_on_device=synced_on_device)


def _optimizer_bytes(worker: MegatronWorker, is_host) -> dict[str, int]:
    """The optimizer's own storages by place, the model's parameters and gradient buffers left out."""
    model = {storage_key(param) for chunk in worker.chunks for param in chunk.parameters()}
    for chunk in worker.chunks:
        model |= {storage_key(buffer.grad_data) for buffer in chunk.buffers + chunk.expert_parallel_buffers}
    return allocated_bytes(worker.optimizer, model, is_host=is_host)


def offloaded_optimizer_body(rank, world_size, hf_dir, root):
    """The CPU-offloaded optimizer (distributed, ``cpu_offload_fraction=1``, bf16): its state's bytes by
    place once built, after an update, and in a fresh worker that loaded a checkpoint of it; the elements of
    its shard; whether both workers give the same weights. On CUDA the places are the tensors' devices; on
    the CPU, ``simulated_gpu``'s (Megatron's offload moves only tensors that say they are on the GPU), and
    the checkpoint is saved and loaded outside the simulation (torch's collectives would ask CUDA about the
    tensors), so there the resumed state's place is not known (None)."""
    on_gpu = _start() == "cuda"
    simulation = contextlib.nullcontext if on_gpu else simulated_gpu
    is_host = (lambda tensor: tensor.device.type == "cpu") if on_gpu else on_host
    offloaded = dict(distributed_optimizer=True, cpu_offload_fraction=1.0)
    with simulation():
        worker = actor(hf_dir, "bf16", **offloaded)
        built = _optimizer_bytes(worker, is_host)
        train_once(worker)
        stepped = _optimizer_bytes(worker, is_host)
    owned = sum(shard.numel() for inner in worker.optimizer.chained_optimizers
                for group in inner.shard_float16_groups for shard in group)
    worker.save_checkpoint(root)
    with simulation():
        fresh = actor(hf_dir, "bf16", **offloaded)
    fresh.load_checkpoint(root)
    resumed = _optimizer_bytes(fresh, is_host) if on_gpu else None
    trained, loaded = hf_weights(worker), hf_weights(fresh)
    destroy(including_default_group=True)
    return dict(built=built, stepped=stepped, resumed=resumed, owned=owned,
                same_weights=all(torch.equal(loaded[name], tensor) for name, tensor in trained.items()))
