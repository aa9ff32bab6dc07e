"""The weight-mapping transforms on their own: name resolution and exact split/merge round trips."""

import pytest
import torch

from rlmega.bridge.mapping import GATE_UP, QKV, VOCAB, Geometry, Rule, RuleBook, canonical_te_name, hf_shapes, shard_from_hf, to_hf

GEOMETRY = Geometry(num_query_groups=4, heads_per_group=2, head_dim=3, vocab_size=10)


def _reader(tensors):
    def read(name, rows, cols):
        tensor = tensors[name]
        tensor = tensor if rows is None else tensor[rows]
        return tensor if cols is None else tensor[:, cols]

    return read


def test_te_fused_norm_names_become_local_names():
    assert canonical_te_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == "decoder.layers.3.input_layernorm.weight"
    assert canonical_te_name("decoder.layers.3.mlp.linear_fc1.layer_norm_weight") == "decoder.layers.3.pre_mlp_layernorm.weight"
    assert canonical_te_name("decoder.layers.3.mlp.linear_fc1.weight") == "decoder.layers.3.mlp.linear_fc1.weight"


def test_rules_resolve_layers_and_experts():
    rule, names = RuleBook("MixtralForCausalLM").resolve("decoder.layers.7.mlp.experts.local_experts.5.linear_fc1.weight")
    assert rule.transform == GATE_UP
    assert names == ("model.layers.7.block_sparse_moe.experts.5.w1.weight", "model.layers.7.block_sparse_moe.experts.5.w3.weight")
    rule, names = RuleBook("LlamaForCausalLM").resolve("decoder.layers.0.self_attention.linear_qkv.weight")
    assert rule.transform == QKV and names[2] == "model.layers.0.self_attn.v_proj.weight"
    with pytest.raises(KeyError, match="no HF mapping for Megatron parameter 'decoder.layers.0.mystery.weight'"):
        RuleBook("LlamaForCausalLM").resolve("decoder.layers.0.mystery.weight")
    with pytest.raises(ValueError, match="no weight mapping for GPT2LMHeadModel; supported: LlamaForCausalLM"):
        RuleBook("GPT2LMHeadModel")


def test_qkv_interleaves_whole_query_groups():
    q = torch.arange(4 * 2 * 3).float().reshape(24, 1)  # group g owns q rows [6g, 6g+6)
    k = 100 + torch.arange(12).float().reshape(12, 1)
    v = 200 + torch.arange(12).float().reshape(12, 1)
    rule = Rule("x", ("q", "k", "v"), QKV)
    full = shard_from_hf(rule, _reader(dict(q=q, k=k, v=v)), ("q", "k", "v"), torch.Size([48, 1]), None, 0, 1, GEOMETRY)
    # group 0: q heads 0-1 (rows 0..5), then k rows 0..2, then v rows 0..2
    assert full[:12, 0].tolist() == [0, 1, 2, 3, 4, 5, 100, 101, 102, 200, 201, 202]


@pytest.mark.parametrize("transform, hf_names, hf_rows, partition_dim", [
    (QKV, ("q", "k", "v"), (24, 12, 12), 0),
    (GATE_UP, ("gate", "up"), (8, 8), 0),
    (VOCAB, ("embed",), (10,), 0),
])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shards_gather_to_the_megatron_tensor_and_back_to_hf_exactly(transform, hf_names, hf_rows, partition_dim, tp):
    torch.manual_seed(0)
    hf = {name: torch.randn(rows, 5) for name, rows in zip(hf_names, hf_rows)}
    rule = Rule("x", hf_names, transform)
    global_rows = {QKV: 48, GATE_UP: 16, VOCAB: 16}[transform]  # vocab padded 10 -> 16
    local = torch.Size([global_rows // tp, 5])
    shards = [shard_from_hf(rule, _reader(hf), hf_names, local, partition_dim, r, tp, GEOMETRY) for r in range(tp)]
    gathered = torch.cat(shards)
    back = to_hf(rule, gathered, hf_names, GEOMETRY, tp)
    assert set(back) == set(hf_names)
    for name in hf_names:
        assert torch.equal(back[name], hf[name])
    assert [tuple(s) for s in hf_shapes(rule, gathered.shape, GEOMETRY)] == [tuple(hf[n].shape) for n in hf_names]
    if transform == VOCAB:
        assert torch.count_nonzero(gathered[10:]) == 0  # padding rows are zero


def test_gate_up_shards_hold_their_own_gate_and_up_rows():
    gate, up = torch.arange(8).float().reshape(8, 1), 100 + torch.arange(8).float().reshape(8, 1)
    rule = Rule("x", ("gate", "up"), GATE_UP)
    shard1 = shard_from_hf(rule, _reader(dict(gate=gate, up=up)), ("gate", "up"), torch.Size([8, 1]), 0, 1, 2, GEOMETRY)
    assert shard1[:, 0].tolist() == [4, 5, 6, 7, 104, 105, 106, 107]  # [gate_r; up_r] for r = 1


def test_row_parallel_copy_reads_its_columns():
    weight = torch.arange(12).float().reshape(2, 6)
    rule = Rule("x", ("w",), "copy")
    shard = shard_from_hf(rule, _reader(dict(w=weight)), ("w",), torch.Size([2, 3]), 1, 1, 2, GEOMETRY)
    assert shard.tolist() == [[3, 4, 5], [9, 10, 11]]
