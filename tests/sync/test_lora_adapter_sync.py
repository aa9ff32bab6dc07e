"""``sync.lora=adapters`` on TP=2 ranks into the fake vLLM and SGLang engines: the sync sends the adapters alone (far
fewer bytes than the merged weights), the engine applies them, and the post-sync check compares its log-probs with the trainer's
(a trainer whose adapters moved without a sync fails it); after the warm-start folded the adapters into the base, the
first sync carries that base once."""

import sys

import pytest
import torch

from rlmega.bridge import load_hf_weights
from rlmega.models import build_chunks, lora, model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks
from rlmega.sync import SyncConfig, WeightSync, WeightSyncError
from rlmega.sync.lora_adapters import AdapterSource

PROMPTS = [[5, 17, 42, 8], [3, 99, 64]]
LORA = lora.LoraConfig(rank=4, alpha=16.0)


def _move_adapters(chunks, seed: int) -> None:
    """New B factors, the same draw on every rank (each keeps its own rows of a column-parallel B)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for _, adapter in lora.adapters(chunks):
            adapter.lora_b.normal_(0.0, 0.05)


def _engine_class(backend: str):
    """The backend's engine adapter over its fake, as the run's engines would be built."""
    if backend == "sglang":
        from rollout.fakes import fake_sglang

        sys.modules["sglang"] = fake_sglang
        from rlmega.rollout.sglang_engine import SGLangEngine

        return SGLangEngine
    from rollout.fakes import fake_vllm

    sys.modules["vllm"], sys.modules["vllm.lora.request"] = fake_vllm, fake_vllm.lora_request_module
    from rlmega.rollout.vllm_engine import VLLMEngine

    return VLLMEngine


def _served(engine) -> tuple[list, int]:
    """The adapters the engine holds, and how many weight-update sessions its base took."""
    if engine.engine_name == "sglang":
        sessions = sum(call[0] == "begin_weight_update" for call in engine.engine.calls)
        return sorted(engine.engine.lora.adapters), sessions
    sessions = sum(call[0] == "start_weight_update" for call in engine.llm.calls)
    return sorted(engine.llm.llm_engine.list_loras()), sessions


def _adapters_and_merged(rank, world_size, hf_dir, backend):
    engine_class = _engine_class(backend)
    torch.set_num_threads(1)
    layout = ParallelLayout(tp=2, world_size=2)
    initialize(layout)
    spec = model_spec_from_hf(hf_dir)
    chunks = build_chunks(spec, layout)
    for chunk in chunks:
        lora.attach(chunk, LORA)
    with lora.adapters_disabled(chunks):  # the checkpoint holds the base weights
        load_hf_weights(chunks, spec, hf_dir)
    folded = [False]
    source = AdapterSource(LORA, hf_dir, lambda: folded[0])
    adapter_engine = engine_class(hf_dir, lora_rank=LORA.rank) if rank == 0 else None
    merged_engine = engine_class(hf_dir) if rank == 0 else None
    adapters = WeightSync.build(SyncConfig(lora="adapters"), chunks, spec, adapter_engine and [adapter_engine],
                                atol=1e-4, adapters=source)
    merged = WeightSync.build(SyncConfig(), chunks, spec, merged_engine and [merged_engine], atol=1e-4)
    results = {"transport": adapters.transport.name}
    _move_adapters(chunks, 1)
    results["bytes"] = (adapters.push(1).bytes, merged.push(1).bytes)
    results["worst"] = (adapters.check(PROMPTS, 1), merged.check(PROMPTS, 1))
    _move_adapters(chunks, 2)  # trained, not synced: the engine's adapter is stale
    try:
        adapters.check(PROMPTS, 1)
    except WeightSyncError as error:
        results["stale"] = str(error)
    lora.fold(chunks)  # the warm-start: the base is now the adapted model, B = 0
    folded[0] = True
    _move_adapters(chunks, 3)
    results["folded_bytes"] = [adapters.push(version).bytes for version in (2, 3)]  # the base once, then adapters
    results["folded_worst"] = adapters.check(PROMPTS, 3)
    if rank == 0:
        results["loras"], results["weight_calls"] = _served(adapter_engine)
    adapters.close()
    merged.close()
    destroy()
    return results


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend, current", [("vllm", 3), ("sglang", "rlmega-3-v3")])
def test_adapters_alone_reach_the_engine_and_pass_the_post_sync_check(start_dir, backend, current):
    sender, other = run_on_ranks(_adapters_and_merged, 2, timeout_s=180, args=(str(start_dir), backend))
    adapter_bytes, merged_bytes = sender["bytes"]
    print(f"bytes per sync: adapters {adapter_bytes}, merged {merged_bytes}, ratio {merged_bytes / adapter_bytes:.1f}")
    assert sender["transport"] == "in_process"
    assert merged_bytes > 4 * adapter_bytes  # (the tiny model's vocabulary is most of its bytes)
    assert other["bytes"] == (0, 0)  # the other rank takes part in the gathers and sends nothing
    for result in (sender, other):  # every rank reaches the same verdicts
        assert max(result["worst"]) < 1e-4
        assert "engine and trainer log-probs differ" in result["stale"]
        assert result["folded_worst"] < 1e-4
    with_base, adapters_only = sender["folded_bytes"]
    assert with_base > merged_bytes > adapters_only == adapter_bytes
    assert sender["loras"] == [current]  # the current adapter only: each sync loaded a new one and removed the one before
    assert sender["weight_calls"] == 1  # the base moved once, in the first sync after the fold
