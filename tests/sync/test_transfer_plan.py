"""The sliced transfer plan (rlmega.sync.transfer_plan): every engine rank receives exactly the block of each tensor it
holds, from ranks that hold it, over the link the placement says; replicas share the sending; the summed traffic is
the messages' sum; and the plan of DeepSeek-V3 on 256 GPUs is quick to make. No process is started: the training
side comes from ``layout_pieces``, which tests/bridge/test_pieces.py holds to the built model's ``piece_layout``."""


import pytest
import torch

from rlmega.bridge.layout_pieces import PlacedPiece, placed_pieces
from rlmega.bridge.pieces import Piece
from rlmega.parallel.layout import ParallelLayout
from rlmega.rollout.engine_bytes import ROW, EngineLayout, HFTensor, held_region, hf_tensors
from rlmega.sync.transfer_plan import LINKS, NETWORK, NVLINK, SELF, Placement, TransferPlan, plan_transfer

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=100, max_position_embeddings=64, rms_norm_eps=1e-6, hidden_act="silu", rope_theta=10000.0,
              tie_word_embeddings=False)
QWEN3 = dict(COMMON, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32)
QWEN3_MOE = dict(COMMON, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=32, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[])
DEEPSEEK_V3 = dict(COMMON, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_key_value_heads=4,
                   moe_intermediate_size=32, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                   n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                   topk_method="noaux_tc", num_nextn_predict_layers=1)

# (HF config, training layout, engine layout, engines, colocated, GPUs per node)
CASES = {
    "qwen3-tp2-dp2-to-tp4": (QWEN3, dict(tp=2, world_size=4), EngineLayout(4), 1, True, 4),
    "qwen3-pp2-vpp2-to-tp2x2-disaggregated": (QWEN3, dict(pp=2, vpp=2, world_size=2), EngineLayout(2), 2, False, 2),
    "qwen3-moe-tp2-ep2-etp1-to-tp2dp2-ep4": (QWEN3_MOE, dict(tp=2, ep=2, world_size=8), EngineLayout(2, 4, 2), 2,
                                             True, 4),
    "qwen3-moe-ep4-etp2-to-tp4": (QWEN3_MOE, dict(tp=2, ep=2, etp=2, world_size=8), EngineLayout(4), 3, True, 8),
    "deepseek-v3-mtp-tp2-pp2-uneven-to-tp4": (DEEPSEEK_V3, dict(tp=2, pp=2, first_stage_layers=1, world_size=4),
                                              EngineLayout(4), 2, False, 4),
}


def _plan(case, replicas=True):
    hf, training, engine, engines, colocated, per_node = CASES[case]
    layout = ParallelLayout(**training)
    placement = Placement.of(num_engines=engines, engine_size=engine.world_size, gpus_per_node=per_node,
                             colocated=colocated, training_world=layout.world_size)
    return plan_transfer(placed_pieces(hf, layout), hf, engine, placement, replicas=replicas), layout


def _numel(box):
    count = 1
    for start, stop in box:
        count *= stop - start
    return count


def _overlap(a, b):
    return all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b))


def _inside(box, region):
    return all(r0 <= b0 < b1 <= r1 for (b0, b1), (r0, r1) in zip(box, region))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("replicas", [True, False], ids=["replicas", "replica0"])
def test_each_engine_rank_receives_exactly_its_region_from_ranks_that_hold_it(case, replicas):
    plan, _ = _plan(case, replicas)
    received: dict = {}
    holders = {}
    for placed in plan.pieces:
        piece = placed.piece
        for replica in (placed.replicas if replicas else placed.replicas[:1]):
            for index, owner in enumerate(replica):
                holders.setdefault(piece.name, {})[owner] = index
    for message in plan.messages():
        received.setdefault((message.tensor, message.engine, message.engine_rank), []).append(message.box)
        # The sender holds the block: a copy of an owner whose chunk contains it.
        index = holders[message.tensor][message.sender]
        piece = next(p.piece for p in plan.pieces if p.piece.name == message.tensor)
        if piece.split_dim is not None:
            start, stop = piece.rows(index)
            assert start <= message.box[piece.split_dim][0] and message.box[piece.split_dim][1] <= stop
        assert message.receiver == plan.placement.engine_gpus[message.engine][message.engine_rank]
        assert message.nbytes == _numel(message.box) * plan.layout.dtype_bytes
    engine_names = {tensor.name for tensor in hf_tensors(CASES[case][0])}
    assert {placed.piece.name for placed in plan.pieces} == engine_names
    for tensor in hf_tensors(CASES[case][0]):
        for engine in range(len(plan.placement.engine_gpus)):
            for rank in range(plan.layout.world_size):
                region = held_region(tensor, plan.layout, rank)
                boxes = received.get((tensor.name, engine, rank), [])
                if region is None:
                    assert not boxes, (tensor.name, rank)
                    continue
                assert all(_inside(box, region) for box in boxes), (tensor.name, rank)
                assert sum(_numel(box) for box in boxes) == _numel(region), (tensor.name, rank)
                assert not any(_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]), (tensor.name, rank)


def test_engine_slices_are_cut_from_the_training_chunks():
    """o_proj [64, 128] trained at tp2 (columns 0-63, 64-127) into engine tp4 (32 columns each): each engine rank's
    slice from the one owner whose columns hold it. q_norm, whole on every rank: from the copy on the receiver's GPU."""
    plan, _ = _plan("qwen3-tp2-dp2-to-tp4")
    o_proj = [(m.engine_rank, m.sender, m.box) for m in plan.messages()
              if m.tensor == "model.layers.0.self_attn.o_proj.weight" and m.engine == 0]
    # Columns 0-63 are on GPUs 0 and 2 (owner 0 of both replicas), 64-127 on GPUs 1 and 3: engine ranks 0 and 3 take
    # theirs from their own GPU, ranks 1 and 2 from either copy on their node.
    assert [(rank, box) for rank, _, box in o_proj] == [(0, ((0, 64), (0, 32))), (1, ((0, 64), (32, 64))),
                                                        (2, ((0, 64), (64, 96))), (3, ((0, 64), (96, 128)))]
    assert o_proj[0][1] == 0 and o_proj[1][1] in (0, 2) and o_proj[2][1] in (1, 3) and o_proj[3][1] == 3
    norm = [(m.sender, m.receiver, m.link) for m in plan.messages()
            if m.tensor == "model.layers.0.self_attn.q_norm.weight"]
    assert norm == [(gpu, gpu, SELF) for gpu in range(4)]


def test_a_row_split_chunk_and_a_column_slice_intersect_in_a_block():
    """A tensor held whole by the trainer's TP ranks but split by rows over two owners meets an engine column slice:
    lm_head [100, 64] trained at tp2 (rows 0-49, 50-99) and, hand-made, an engine that splits it by columns."""
    piece = Piece("w", torch.bfloat16, (100, 64), (0, 1), 0)
    plan = TransferPlan([PlacedPiece(piece, ((0, 1),), False)], [HFTensor("w", (100, 64), ROW)], EngineLayout(2),
                        Placement(((2, 3),), gpus_per_node=4), True, [])
    assert [(m.sender, m.engine_rank, m.box) for m in plan.messages()] == [
        (0, 0, ((0, 50), (0, 32))), (1, 0, ((50, 100), (0, 32))), (0, 1, ((0, 50), (32, 64))),
        (1, 1, ((50, 100), (32, 64)))]


def test_links_follow_the_placement():
    hf = dict(QWEN3)
    pieces = placed_pieces(hf, ParallelLayout(tp=2, world_size=2))
    for placement, expected in [
        (Placement(((0, 1),), gpus_per_node=2), {SELF}),                       # each engine rank on its owner's GPU
        (Placement(((1, 0),), gpus_per_node=2), {NVLINK, SELF}),               # swapped: split blocks cross NVLink
        (Placement(((1, 0),), gpus_per_node=1), {NETWORK, SELF}),              # one GPU per node: the network
        (Placement(((2, 3),), gpus_per_node=2), {NETWORK}),                    # another node
        (Placement(((2, 3),), gpus_per_node=4), {NVLINK}),                     # the same node, other GPUs
    ]:
        plan = plan_transfer(pieces, hf, EngineLayout(2), placement)
        links = set()
        for message in plan.messages():
            same_node = message.sender // placement.gpus_per_node == message.receiver // placement.gpus_per_node
            assert message.link == (SELF if message.sender == message.receiver else NVLINK if same_node else NETWORK)
            links.add(message.link)
        assert links == expected, placement


def test_replicas_share_the_sending_and_prefer_the_receivers_gpu_or_node():
    """Four data-parallel replicas and one engine on another node: each replica sends about a quarter; with
    replica 0 alone, rank 0 sends everything. Colocated at the same TP, every block is already on its GPU."""
    hf = dict(QWEN3)
    pieces = placed_pieces(hf, ParallelLayout(world_size=4))
    far = Placement(((4, 5),), gpus_per_node=4)
    shared = plan_transfer(pieces, hf, EngineLayout(2), far).traffic
    total = shared.total_bytes
    assert total == sum(_numel(m.box) * 2 for m in plan_transfer(pieces, hf, EngineLayout(2), far).messages())
    sent = shared.sent_bytes.sum(axis=1)
    assert all(0.15 * total < sent[rank] < 0.35 * total for rank in range(4)), sent
    alone = plan_transfer(pieces, hf, EngineLayout(2), far, replicas=False).traffic
    assert alone.sent_bytes.sum(axis=1)[0] == alone.total_bytes == total

    colocated = plan_transfer(placed_pieces(hf, ParallelLayout(tp=2, world_size=4)), hf, EngineLayout(2),
                              Placement.of(num_engines=2, engine_size=2, gpus_per_node=8, colocated=True,
                                           training_world=4))
    assert colocated.traffic.link_bytes[NVLINK] == colocated.traffic.link_bytes[NETWORK] == 0
    near = plan_transfer(pieces, hf, EngineLayout(2), Placement(((5, 6),), gpus_per_node=4))  # GPUs 4-7: none
    assert near.traffic.link_bytes[NVLINK] == 0
    near = plan_transfer(placed_pieces(hf, ParallelLayout(world_size=6)), hf, EngineLayout(2),
                         Placement(((6, 7),), gpus_per_node=4))  # replicas 4 and 5 share the engine's node
    assert near.traffic.link_bytes[NETWORK] == near.traffic.link_bytes[SELF] == 0
    assert set(near.traffic.sent_bytes.sum(axis=1).nonzero()[0]) == {4, 5}


@pytest.mark.parametrize("case", CASES)
def test_the_summed_traffic_is_the_sum_of_the_messages(case):
    for replicas in (True, False):
        plan, _ = _plan(case, replicas)
        traffic = plan.traffic
        links = {link: [0, 0] for link in LINKS}
        sent = [[0] * len(LINKS) for _ in range(plan.num_gpus)]
        received = [[0] * len(LINKS) for _ in range(plan.num_gpus)]
        sent_messages, received_messages = [0] * plan.num_gpus, [0] * plan.num_gpus
        for message in plan.messages():
            links[message.link][0] += 1
            links[message.link][1] += message.nbytes
            sent[message.sender][LINKS.index(message.link)] += message.nbytes
            received[message.receiver][LINKS.index(message.link)] += message.nbytes
            sent_messages[message.sender] += 1
            received_messages[message.receiver] += 1
        assert traffic.link_messages == {link: count for link, (count, _) in links.items()}
        assert traffic.link_bytes == {link: nbytes for link, (_, nbytes) in links.items()}
        assert traffic.sent_bytes.tolist() == sent and traffic.received_bytes.tolist() == received
        assert traffic.sent_messages.tolist() == sent_messages
        assert traffic.received_messages.tolist() == received_messages


def test_messages_follow_the_layer_order_then_engine_then_rank():
    plan, _ = _plan("deepseek-v3-mtp-tp2-pp2-uneven-to-tp4")
    order = {placed.piece.name: index for index, placed in enumerate(plan.pieces)}
    keys = [(order[m.tensor], m.engine, m.engine_rank) for m in plan.messages()]
    assert keys == sorted(keys)
    assert plan.pieces[0].piece.name == "model.embed_tokens.weight" and plan.pieces[-1].piece.name == "lm_head.weight"
    # The MTP layer (model.layers.4) is trained but no engine loads it.
    assert plan.not_loaded and all(name.startswith("model.layers.4.") for name in plan.not_loaded)


def test_a_model_the_engines_load_more_of_than_the_trainer_holds_is_refused():
    hf = dict(QWEN3)
    pieces = [placed for placed in placed_pieces(hf, ParallelLayout()) if placed.piece.name != "lm_head.weight"]
    with pytest.raises(ValueError, match="the engines load lm_head.weight .* which the training layout does not hold"):
        plan_transfer(pieces, hf, EngineLayout(1), Placement(((0,),), gpus_per_node=8))


def test_deepseek_v3_on_256_gpus_plans_whole():
    """The recipe's layout (PP16 uneven, EP16) into 8 engines of TP32: 45k tensors, 11 million messages, summed."""
    import json
    from pathlib import Path

    hf = json.loads(Path("configs/recipes/deepseek_v3_671b/hf/config.json").read_text())
    hf = dict(hf, num_nextn_predict_layers=0)
    layout = ParallelLayout(pp=16, ep=16, first_stage_layers=3, last_stage_layers=2, world_size=256)
    plan = plan_transfer(placed_pieces(hf, layout, transformer_engine=True), hf, EngineLayout(32),
                         Placement.of(num_engines=8, engine_size=32, gpus_per_node=8, colocated=True,
                                      training_world=256))
    traffic = plan.traffic
    assert sum(traffic.link_messages.values()) > 10_000_000
    # Every engine GPU receives its own slices of the model: about 44 GB at TP32.
    assert 40e9 < traffic.received_bytes.sum(axis=1).max() < 48e9
