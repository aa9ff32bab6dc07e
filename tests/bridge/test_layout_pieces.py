"""``rlmega.bridge.layout_pieces`` without ranks: each piece's replicas are the ranks Megatron gives the same
coordinates (``StageCoordinates``: tp-cp-dp for dense layers, etp-ep-edp for experts), context parallelism
included; the stages hold Megatron's layers. tests/bridge/test_pieces.py holds the owners, shapes, splits and order
to the built model's ``piece_layout``."""

import pytest

from rlmega.bridge.layout_pieces import layout_pieces, placed_pieces, stage_layers
from rlmega.models import model_spec_from_hf
from rlmega.parallel.layout import ParallelLayout
from rlmega.plan.meta_build import StageCoordinates

MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=64, intermediate_size=96,
           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=100,
           max_position_embeddings=64, rms_norm_eps=1e-6, hidden_act="silu", num_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)


@pytest.mark.parametrize("layout", [dict(tp=2, cp=2, world_size=8), dict(tp=2, ep=4, world_size=16, pp=2),
                                    dict(tp=2, ep=2, etp=2, cp=2, world_size=16)], ids=str)
def test_replicas_are_the_ranks_with_the_owners_coordinates(layout):
    layout = ParallelLayout(**layout)
    per_stage = layout.world_size // layout.pp
    for placed in placed_pieces(MOE, layout):
        assert placed.replicas[0] == placed.piece.owners
        base = placed.piece.owners[0] // per_stage * per_stage
        expert_rank = StageCoordinates.of(placed.piece.owners[0] - base, layout).expert_rank
        for replica, owners in enumerate(placed.replicas):
            for position, rank in enumerate(owners):
                at = StageCoordinates.of(rank - base, layout)
                if placed.expert:
                    assert (at.expert_tp_rank, at.expert_rank, at.expert_data_parallel_rank) == (
                        position, expert_rank, replica), placed.piece.name
                else:
                    assert (at.tp_rank, at.data_parallel_index) == (position, replica), placed.piece.name
        # Together they are every rank with those coordinates: the stage (context-parallel ranks hold copies too),
        # or for an expert the ranks of its expert-parallel rank.
        ranks = sorted(rank for owners in placed.replicas for rank in owners)
        assert ranks == [base + i for i in range(per_stage)
                         if not placed.expert or StageCoordinates.of(i, layout).expert_rank == expert_rank]


@pytest.mark.parametrize("layout", [dict(pp=4, world_size=4), dict(pp=2, vpp=2, world_size=2),
                                    dict(pp=4, first_stage_layers=1, last_stage_layers=1, world_size=4),
                                    dict(pp=3, first_stage_layers=2, world_size=3)], ids=str)
def test_stages_hold_megatrons_layers(layout):
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layout = ParallelLayout(**layout)
    num_layers = 8 if not layout.first_stage_layers or layout.last_stage_layers else 6
    spec = model_spec_from_hf(dict(MOE, num_hidden_layers=num_layers))
    config = spec.transformer_config(layout)
    for stage, chunks in enumerate(stage_layers(layout, num_layers)):
        for vp, layers in enumerate(chunks):
            vp_stage = vp if layout.virtual_stages > 1 else None
            first = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=stage)
            count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=stage)
            assert layers == range(first, first + count), (stage, vp)


def test_a_model_without_an_analytic_layout_is_refused():
    reward = dict(MOE, architectures=["Qwen3ForSequenceClassification"], model_type="qwen3", num_labels=1)
    with pytest.raises(ValueError, match="no analytic piece layout for Qwen3ForSequenceClassification; supported"):
        layout_pieces(reward, ParallelLayout())
