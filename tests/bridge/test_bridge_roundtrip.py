"""HF -> Megatron -> HF for every architecture and layout: logits match, export is bit-identical.

Each tiny random HF model is saved with transformers' own ``save_pretrained`` (per-expert keys on
disk), imported into Megatron-Core in a parallel layout (each rank reads its own slices), run
forward through Megatron's schedule, and streamed back out; the exported tensors are compared
with the saved safetensors files, key by key and bit by bit.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from hf_models import VOCAB, probe_tokens, save_tiny_model
from rlmega.bridge import export_hf_weights, load_hf_weights
from rlmega.models import build_chunks, model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks

LOGITS_ATOL = 1e-4  # fp32; the acceptance bound for HF vs Megatron logits
TIMEOUT_S = 180


def _megatron_logits(chunks, tokens):
    """Full-vocabulary logits on the last pipeline stage (None elsewhere), via Megatron's schedule."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(iterator, model):
        batch = next(iterator)
        positions = torch.arange(batch.shape[1]).unsqueeze(0).expand_as(batch)
        output = model(batch, positions, None)
        return output, lambda out: (out.sum() * 0, {"logits": out.detach().clone()})

    rows = list(tokens.split(1))  # one sequence per micro-batch: interleaving needs >= pp of them
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(rows) for _ in chunks] if len(chunks) > 1 else iter(rows),
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(rows), seq_length=tokens.shape[1], micro_batch_size=1,
        forward_only=True,
    )
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    local = torch.cat([output["logits"] for output in outputs])
    shards = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(shards, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=-1)[..., :VOCAB]


def _import_run_export(rank, world_size, layout, hf_dir, bucket_bytes, destinations=None):
    initialize(layout)
    spec = model_spec_from_hf(hf_dir)
    chunks = build_chunks(spec, layout)
    for chunk in chunks:
        chunk.eval()
    load_hf_weights(chunks, spec, hf_dir)
    with torch.no_grad():
        logits = _megatron_logits(chunks, probe_tokens())
    exported = {}
    for name, tensor in export_hf_weights(chunks, spec, bucket_bytes=bucket_bytes, destinations=destinations):
        assert name not in exported, f"{name} exported twice"
        exported[name] = tensor.clone()
    destroy()
    return logits, exported if rank == world_size - 1 else sorted(exported)


DENSE_LAYOUTS = {
    "tp1": dict(),
    "tp2": dict(tp=2),
    "pp2": dict(pp=2),
    "pp2-vpp2": dict(pp=2, vpp=2),
    "tp2-pp2": dict(tp=2, pp=2),
    "pp2-uneven-1-3": dict(pp=2, first_stage_layers=1),
}
MOE_LAYOUTS = {
    "tp1": dict(),
    "ep2": dict(ep=2),
    "tp2-etp2": dict(tp=2, etp=2),
    "tp2-ep2": dict(tp=2, ep=2),
    "pp2-ep2": dict(pp=2, ep=2),
    "pp2-vpp2": dict(pp=2, vpp=2),
    "tp2-pp2": dict(tp=2, pp=2),
    "tp2-ep2-etp2": dict(tp=2, ep=2, etp=2),
}
CASES = [(arch, name, layout) for arch in ("llama", "qwen2-tied", "qwen3") for name, layout in DENSE_LAYOUTS.items()]
CASES += [(arch, name, layout) for arch in ("qwen3-moe", "mixtral") for name, layout in MOE_LAYOUTS.items()]


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    saved = {}
    for arch in ("llama", "qwen2-tied", "qwen3", "qwen3-moe", "mixtral"):
        directory = tmp_path_factory.mktemp(arch)
        saved[arch] = (directory, save_tiny_model(arch, directory))
    return saved


def _world_size(layout: dict) -> int:
    tp, pp, ep, etp = layout.get("tp", 1), layout.get("pp", 1), layout.get("ep", 1), layout.get("etp")
    return max(tp, ep * (etp or 1)) * pp


@pytest.mark.parametrize("arch, layout_name, layout_kwargs", CASES, ids=[f"{a}-{n}" for a, n, _ in CASES])
def test_import_matches_hf_logits_and_export_is_bit_identical(arch, layout_name, layout_kwargs, hf_checkpoints):
    directory, hf_logits = hf_checkpoints[arch]
    layout = ParallelLayout(world_size=_world_size(layout_kwargs), **layout_kwargs)
    # A small bucket forces many buckets, so bucket boundaries are exercised too.
    results = run_on_ranks(_import_run_export, layout.world_size, timeout_s=TIMEOUT_S, args=(layout, str(directory), 64 * 1024))

    assert_round_trip(results, directory, hf_logits)


def test_export_to_one_destination_reaches_only_that_rank(hf_checkpoints):
    directory, hf_logits = hf_checkpoints["qwen3-moe"]
    layout = ParallelLayout(tp=2, ep=2, world_size=4)
    results = run_on_ranks(_import_run_export, 4, timeout_s=TIMEOUT_S, args=(layout, str(directory), 64 * 1024, [3]))
    assert_round_trip(results, directory, hf_logits, everyone_receives=False)  # rank 3: everything, bit-identical
    assert all(names == [] for _, names in results[:-1])  # the others: nothing


def assert_round_trip(results, directory, hf_logits, everyone_receives=True):
    """Every last-stage rank's logits match HF; the stream equals the saved checkpoint bit for bit."""
    last_stage_logits = [logits for logits, _ in results if logits is not None]
    assert last_stage_logits
    for logits in last_stage_logits:
        assert (logits - hf_logits).abs().max().item() <= LOGITS_ATOL

    saved = load_file(Path(directory) / "model.safetensors")
    _, exported = results[-1]
    assert sorted(exported) == sorted(saved), "exported keys differ from the checkpoint's"
    for name, tensor in saved.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    if everyone_receives:
        for _, names in results[:-1]:  # every rank received the same stream
            assert names == sorted(saved)
