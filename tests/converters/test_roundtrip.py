"""HF -> torch_dist (TP=2, through ``rlmega convert``) -> HF is bit-identical, and Megatron loads
the written checkpoint at another layout (TP=2×EP=2) to the same weights."""

import json

import pytest
import torch
from safetensors.torch import load_file

from rlmega.cli.main import main
from rlmega.parallel.layout import ParallelLayout
from rlmega.parallel.spawn import run_on_ranks
from test_mcore_to_hf import read_export

TIMEOUT_S = 180


def _load_and_export(rank, world_size, layout, hf_dir, checkpoint_dir):
    from megatron.core import dist_checkpointing

    from rlmega.bridge import export_hf_weights
    from rlmega.models import build_chunks, model_spec_from_hf
    from rlmega.parallel.layout import destroy, initialize

    initialize(layout)
    spec = model_spec_from_hf(hf_dir)
    [chunk] = build_chunks(spec, layout)
    state = dist_checkpointing.load({"model": chunk.sharded_state_dict()}, checkpoint_dir)
    chunk.load_state_dict(state["model"])
    exported = {name: tensor.clone() for name, tensor in export_hf_weights([chunk], spec, destinations=[0])}
    destroy()
    return exported if rank == 0 else None


def test_hf_to_mcore_to_hf_is_bit_identical_and_loads_at_another_layout(hf_models, tmp_path):
    hf = hf_models["qwen3-moe"]
    original = load_file(hf / "model.safetensors")
    megatron = tmp_path / "megatron"
    assert main(["convert", "hf-to-mcore", str(hf), str(megatron), "--tp", "2", "--iteration", "0", "--quiet"]) == 0
    assert (megatron / "latest_checkpointed_iteration.txt").read_text().strip() == "0"
    assert (megatron / "iter_0000000" / ".metadata").is_file()

    back = tmp_path / "hf-again"
    assert main(["convert", "mcore-to-hf", str(megatron), str(back), "--hf-base", str(hf), "--quiet"]) == 0
    exported = read_export(back)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    assert main(["convert", "verify", str(back), str(hf)]) == 0

    # Cast on export: not bit-identical any more, so verify judges the fp32 logits.
    cast = tmp_path / "hf-bf16"
    assert main(["convert", "mcore-to-hf", str(megatron), str(cast), "--hf-base", str(hf), "--dtype", "bfloat16", "--quiet"]) == 0
    assert json.loads((cast / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in read_export(cast).values())
    assert main(["convert", "verify", str(cast), str(hf), "--atol", "0.05"]) == 0
    assert main(["convert", "verify", str(cast), str(hf), "--atol", "1e-7"]) == 1

    layout = ParallelLayout(tp=2, ep=2, world_size=2)
    loaded = run_on_ranks(_load_and_export, 2, timeout_s=TIMEOUT_S,
                          args=(layout, str(hf), str(megatron / "iter_0000000")))[0]
    assert sorted(loaded) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("layout", [
    ["--ep", "2"],
    ["--pp", "2", "--ep", "2"],  # MTP on the last stage, away from the embedding it shares
    ["--pp", "2", "--first-stage-layers", "1"],  # uneven: the last stage holds 3 layers and MTP
    ["--tp", "2", "--pp", "2", "--last-stage-layers", "1"],  # uneven, MTP's weights split over tp
], ids=lambda layout: "-".join(arg.strip("-").replace("-stage-layers", "") for arg in layout))
def test_deepseek_v3_with_mtp_round_trip(tmp_path, layout):
    """Dense and MoE layers mixed (Megatron then stores one key per layer), MLA, shared experts,
    the router's score bias and an MTP layer whose embedding / LM head copies HF stores."""
    from deepseek_mtp_models import save_tiny_deepseek_mtp

    hf = tmp_path / "hf"
    save_tiny_deepseek_mtp(hf)
    megatron, back = tmp_path / "megatron", tmp_path / "back"
    assert main(["convert", "hf-to-mcore", str(hf), str(megatron), *layout, "--quiet"]) == 0
    assert main(["convert", "mcore-to-hf", str(megatron), str(back), "--hf-base", str(hf), "--quiet"]) == 0
    original, exported = load_file(hf / "model.safetensors"), read_export(back)
    assert sorted(exported) == sorted(original)
    assert "model.layers.4.shared_head.head.weight" in exported  # the MTP layer's copy of the LM head
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    assert main(["convert", "verify", str(back), str(hf)]) == 0
