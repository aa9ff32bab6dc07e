"""Each rank's own pieces of the HF tensors (``rlmega.bridge.pieces``), put together as their layout says,
are the checkpoint bit for bit, in dense and MoE layouts with tensor, pipeline and expert parallelism.

Every rank sends its pieces, the layout and its full tensors to the last rank, which reassembles each tensor
from its owners' chunks (``torch.cat`` along the split dimension, owner order) and compares it with the saved
safetensors file. The layout must be the same on every rank, each rank must hand over exactly the names it
owns, and the bytes the layout counts per rank must be the bytes that rank handed over. The layout worked out from
the config alone (``rlmega.bridge.layout_pieces``, no model built) must be the built model's, list for list.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from deepseek_mtp_models import save_tiny_deepseek_mtp
from hf_models import save_tiny_model
from rlmega.bridge import load_hf_weights
from rlmega.bridge.layout_pieces import layout_pieces
from rlmega.bridge.pieces import Piece, bytes_held, full_tensors, local_pieces, piece_layout
from rollout.fakes.fake_vllm_weight_transfer import layerwise_groups  # the wheel's rule
from rlmega.models import build_chunks, model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import run_on_ranks

TIMEOUT_S = 180


def _pieces_on_rank(rank, world_size, layout, hf_dir):
    initialize(layout)
    spec = model_spec_from_hf(hf_dir)
    chunks = build_chunks(spec, layout)
    load_hf_weights(chunks, spec, hf_dir)
    pieces = piece_layout(chunks, spec)
    local = [(name, tensor.clone()) for name, tensor in local_pieces(chunks, spec)]
    full = [(name, tensor.clone()) for name, tensor in full_tensors(chunks, spec)]
    everyone = [None] * world_size
    dist.all_gather_object(everyone, pieces)
    destroy()
    return {"layout": pieces, "same_everywhere": all(other == pieces for other in everyone), "local": local,
            "full": full}


CASES = {
    "llama-tp2-pp2": ("llama", dict(tp=2, pp=2, world_size=4)),
    "qwen2-tied-tp2": ("qwen2-tied", dict(tp=2, world_size=2)),
    "qwen3-moe-tp2-ep2-etp2": ("qwen3-moe", dict(tp=2, ep=2, etp=2, world_size=4)),
    "mixtral-pp2-ep2": ("mixtral", dict(pp=2, ep=2, world_size=4)),
    # Expert-data-parallel replicas (etp 1 under ep 2 with tp 2), interleaved and uneven pipeline stages.
    "qwen3-moe-tp2-ep2-etp1": ("qwen3-moe", dict(tp=2, ep=2, world_size=4)),
    "mixtral-pp2-vpp2": ("mixtral", dict(pp=2, vpp=2, world_size=2)),
    "llama-pp2-uneven": ("llama", dict(pp=2, first_stage_layers=1, world_size=2)),
    # MLA, dense first layers, shared experts, the router's score bias, and the MTP layer's copies of the
    # embedding and LM head.
    "deepseek-v3-mtp-tp2-pp2": ("deepseek-v3-mtp", dict(tp=2, pp=2, world_size=4)),
}


@pytest.mark.parametrize("case", CASES)
def test_pieces_reassemble_to_the_checkpoint(case, tmp_path):
    arch, layout_kwargs = CASES[case]
    save_tiny_deepseek_mtp(tmp_path) if arch == "deepseek-v3-mtp" else save_tiny_model(arch, tmp_path)
    layout = ParallelLayout(**layout_kwargs)
    results = run_on_ranks(_pieces_on_rank, layout.world_size, timeout_s=TIMEOUT_S, args=(layout, str(tmp_path)))
    saved = load_file(Path(tmp_path) / "model.safetensors")

    assert all(result["same_everywhere"] for result in results)
    pieces = results[0]["layout"]
    assert layout_pieces(model_spec_from_hf(str(tmp_path)), layout, dtype=torch.float32) == pieces
    assert sorted(piece.name for piece in pieces) == sorted(saved)
    split = [piece.name for piece in pieces if piece.split_dim is not None]
    assert bool(split) == (layout.tp > 1 or layout.expert_tp > 1), split
    if layout.tp > 1:  # the padded vocabulary too, re-chunked with no gather
        assert "model.embed_tokens.weight" in split
    by_rank = {rank: dict(result["local"]) for rank, result in enumerate(results)}
    for rank, result in enumerate(results):  # each rank hands over exactly what it owns, in layout order
        assert [name for name, _ in result["local"]] == [p.name for p in pieces if rank in p.owners]
        assert [name for name, _ in result["full"]] == [p.name for p in pieces if rank in p.owners]
    for piece in pieces:
        expected = saved[piece.name]
        assert piece.shape == tuple(expected.shape) and piece.dtype == expected.dtype, piece.name
        held = [by_rank[owner][piece.name] for owner in piece.owners]
        if piece.split_dim is None:
            whole = held
        else:
            whole = [torch.cat(held, dim=piece.split_dim)]
            assert len(held) > 1 and all(tuple(t.shape) == piece.local_shape(i) for i, t in enumerate(held)), piece.name
            assert [tuple(t.shape) for t in held] == [tuple(t.shape) for t in expected.chunk(len(held), piece.split_dim)]
        for tensor in whole:
            assert torch.equal(tensor, expected), piece.name
        for owner in piece.owners:
            assert torch.equal(dict(results[owner]["full"])[piece.name], expected), piece.name

    # vLLM's sharded_rdt gathers and frees layer by layer: it refuses metadata whose order is not its
    # layerwise_groups' (embedding first, then each decoder layer whole, MTP included, then the final norm and head).
    names = [piece.name for piece in pieces]
    assert [name for group in layerwise_groups(names) for name in group] == names

    held = bytes_held(pieces)  # the layout's count is what each rank handed over
    assert held == {rank: sum(t.numel() * t.element_size() for _, t in result["local"])
                    for rank, result in enumerate(results) if result["local"]}


@pytest.mark.parametrize("length, parts", [(256, 2), (151936, 8), (129280, 16), (10, 4), (5, 4), (3, 8)])
def test_a_piece_has_the_rows_of_torch_chunk(length, parts):
    """vLLM reads a Shard as torch.chunk splits: chunks of ceil(length / parts), and none past the end."""
    piece = Piece("embed", torch.float32, (length, 2), tuple(range(parts)), 0)
    chunks = torch.arange(length).chunk(parts)
    for index in range(parts):
        start, stop = piece.rows(index)
        expected = chunks[index].tolist() if index < len(chunks) else []
        assert list(range(start, stop)) == expected
        assert piece.local_shape(index) == (stop - start, 2)
