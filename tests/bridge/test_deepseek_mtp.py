"""DeepSeek-V3 with a multi-token-prediction (MTP) layer: HF <-> Megatron round trips.

The tiny checkpoint (deepseek_mtp_models) holds MTP layer 0 as ``model.layers.4.*``. Imported into
Megatron-Core in a parallel layout: the main logits must match HF's, Megatron's MTP logits must match
a reference built from HF's own modules, and the export must be bit-identical to the checkpoint,
MTP keys (with their embedding / LM-head copies) included.
"""

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from deepseek_models import tiny_config
from deepseek_mtp_models import MTP_LAYER, reference_mtp_logits, save_tiny_deepseek_mtp, write_checkpoint
from hf_models import VOCAB, probe_tokens
from rlmega.bridge import export_hf_weights, load_hf_weights
from rlmega.bridge.params import local_params, unwrap
from rlmega.models import UnsupportedModelError, build_chunks, model_spec_from_hf, padded_vocab_size
from rlmega.parallel.layout import ParallelLayout, destroy, initialize
from rlmega.parallel.spawn import RankFailure, run_on_ranks
from test_bridge_roundtrip import LOGITS_ATOL, TIMEOUT_S, _megatron_logits, _world_size, assert_round_trip

MTP = f"model.layers.{MTP_LAYER}"


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("deepseek-v3-mtp")
    hf_logits = save_tiny_deepseek_mtp(directory)
    return directory, hf_logits, reference_mtp_logits(directory, probe_tokens())


def _gather_vocab(local: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    shards = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(shards, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=-1)[..., :VOCAB]


def _megatron_mtp_logits(chunks, tokens):
    """MTP layer 0's logits ``[b, s, vocab]`` on the last pipeline stage (None elsewhere).

    Megatron computes MTP only as a loss inside a forward with labels: the MTP block's output (the
    main and MTP hidden states, stacked along the sequence) is captured and put through the
    shared output layer.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    last = unwrap(chunks[-1])
    captured = []
    hook = last.mtp.register_forward_hook(lambda module, args, output: captured.append(output)) if hasattr(last, "mtp") else None

    def forward_step(iterator, model):
        batch = next(iterator)
        positions = torch.arange(batch.shape[1]).unsqueeze(0).expand_as(batch)
        output = model(batch, positions, None, labels=batch)  # any labels: the MTP loss is not checked here
        return output, lambda out: (out.sum() * 0, {})

    rows = list(tokens.split(1))
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(rows) for _ in chunks] if len(chunks) > 1 else iter(rows),
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(rows), seq_length=tokens.shape[1], micro_batch_size=1,
        forward_only=True,
    )
    if hook is not None:
        hook.remove()
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    mtp_hidden = torch.cat([output.chunk(2, dim=0)[1] for output in captured], dim=1)  # [s, b, h]
    local_logits, _ = last.output_layer(mtp_hidden)
    return _gather_vocab(local_logits).transpose(0, 1)


def _import_run_export(rank, world_size, layout, hf_dir, bucket_bytes):
    initialize(layout)
    spec = model_spec_from_hf(hf_dir)
    chunks = build_chunks(spec, layout)
    for chunk in chunks:
        chunk.eval()
    load_hf_weights(chunks, spec, hf_dir)
    with torch.no_grad():
        logits = _megatron_logits(chunks, probe_tokens())  # no labels: MTP is skipped
        mtp_logits = _megatron_mtp_logits(chunks, probe_tokens())
    exported = {name: tensor.clone() for name, tensor in export_hf_weights(chunks, spec, bucket_bytes=bucket_bytes)}
    destroy()
    return (logits, exported if rank == world_size - 1 else sorted(exported)), mtp_logits


def _assert_mtp_logits(results, reference):
    last_stage = [mtp_logits for _, mtp_logits in results if mtp_logits is not None]
    assert last_stage
    for mtp_logits in last_stage:
        assert (mtp_logits - reference).abs().max().item() <= LOGITS_ATOL


# ---------------------------------------------------------------- config and names


def _spec(**overrides):
    config = tiny_config(**overrides)
    config.architectures = ["DeepseekV3ForCausalLM"]
    return model_spec_from_hf(config.to_dict())


def test_spec_sets_mtp_layers_and_keeps_models_without_mtp_unchanged():
    with_mtp = _spec(num_nextn_predict_layers=1)
    assert (with_mtp.config["mtp_num_layers"], with_mtp.config["mtp_loss_scaling_factor"]) == (1, 0.1)
    assert with_mtp.mtp_num_layers == 1
    without = _spec()
    assert "mtp_num_layers" not in without.config and without.mtp_num_layers == 0
    assert without.mtp_block_spec(config=None) is None


def test_mtp_model_is_gated_to_the_checked_megatron_core_release():
    from rlmega.models.mtp_model import check_mcore_version

    for version in ("0.16.1", "0.17.1", "0.18.2", "0.19.2"):
        check_mcore_version(version)
    with pytest.raises(RuntimeError, match=r"megatron-core 0\.16\.x through 0\.19\.x defines it, not 0\.20\.0's; "
                                           r"install 'megatron-core>=0\.16,<0\.20'"):
        check_mcore_version("0.20.0")


@pytest.mark.parametrize("overrides, message", [
    (dict(tie_word_embeddings=True), r"tie_word_embeddings=true with num_nextn_predict_layers > 0"),
    (dict(first_k_dense_replace=5), r"first_k_dense_replace=5 > num_hidden_layers"),
])
def test_spec_refuses_mtp_layers_megatron_would_build_differently(overrides, message):
    with pytest.raises(UnsupportedModelError, match=message):
        _spec(num_nextn_predict_layers=1, **overrides)


def test_mtp_names_resolve_to_deepseek_layer_num_hidden_layers():
    from rlmega.bridge.mapping import GATE_UP, VOCAB as VOCAB_TRANSFORM, RuleBook

    book = RuleBook("DeepseekV3ForCausalLM")
    mtp = "mtp.layers.4"
    expected = {
        f"{mtp}.enorm.weight": f"{MTP}.enorm.weight",
        f"{mtp}.hnorm.weight": f"{MTP}.hnorm.weight",
        f"{mtp}.eh_proj.weight": f"{MTP}.eh_proj.weight",
        f"{mtp}.final_layernorm.weight": f"{MTP}.shared_head.norm.weight",
        f"{mtp}.embed_tokens.weight": f"{MTP}.embed_tokens.weight",
        f"{mtp}.shared_head.head.weight": f"{MTP}.shared_head.head.weight",
        f"{mtp}.transformer_layer.input_layernorm.weight": f"{MTP}.input_layernorm.weight",
        f"{mtp}.transformer_layer.self_attention.linear_kv_down_proj.weight": f"{MTP}.self_attn.kv_a_proj_with_mqa.weight",
        f"{mtp}.transformer_layer.pre_mlp_layernorm.weight": f"{MTP}.post_attention_layernorm.weight",
        f"{mtp}.transformer_layer.mlp.router.expert_bias": f"{MTP}.mlp.gate.e_score_correction_bias",
        f"{mtp}.transformer_layer.mlp.experts.local_experts.3.linear_fc2.weight": f"{MTP}.mlp.experts.3.down_proj.weight",
    }
    for megatron, hf in expected.items():
        assert book.resolve(megatron)[1] == (hf,), megatron
    assert book.resolve(f"{mtp}.embed_tokens.weight")[0].transform == VOCAB_TRANSFORM
    rule, names = book.resolve(f"{mtp}.transformer_layer.mlp.shared_experts.linear_fc1.weight")
    assert rule.transform == GATE_UP
    assert names == (f"{MTP}.mlp.shared_experts.gate_proj.weight", f"{MTP}.mlp.shared_experts.up_proj.weight")


def _canonical_names(rank, world_size, layout, hf_dir):
    initialize(layout)
    spec = model_spec_from_hf(hf_dir)
    names = [(p.canonical, p.tied_output, p.copy_of) for p in local_params(build_chunks(spec, layout))]
    destroy()
    return names


def test_canonical_mtp_names_use_the_global_layer_index_and_globalise_experts(mtp_checkpoint):
    directory, _, _ = mtp_checkpoint
    layout = ParallelLayout(world_size=2, pp=2, ep=1)
    first, last = run_on_ranks(_canonical_names, 2, timeout_s=TIMEOUT_S, args=(layout, str(directory)))
    assert not any(name.startswith("mtp.") for name, _, _ in first)
    mtp = {name: (tied, copy_of) for name, tied, copy_of in last if name.startswith("mtp.")}
    assert "mtp.layers.4.transformer_layer.mlp.experts.local_experts.3.linear_fc1.weight" in mtp
    assert mtp["mtp.layers.4.embed_tokens.weight"] == (False, "embedding.word_embeddings.weight")
    assert mtp["mtp.layers.4.shared_head.head.weight"] == (False, "output_layer.weight")
    # The last stage's own copy of the embedding, which its MTP layer reads, is loaded, not exported.
    assert ("embedding.word_embeddings.weight", True, None) in last


# ---------------------------------------------------------------- round trips

LAYOUTS = {"tp1": dict(), "tp2": dict(tp=2), "pp2": dict(pp=2), "pp2-vpp2": dict(pp=2, vpp=2), "ep2": dict(ep=2)}


@pytest.mark.parametrize("layout_kwargs", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_mtp_import_matches_hf_and_export_is_bit_identical(layout_kwargs, mtp_checkpoint):
    directory, hf_logits, reference = mtp_checkpoint
    layout = ParallelLayout(world_size=_world_size(layout_kwargs), **layout_kwargs)
    results = run_on_ranks(_import_run_export, layout.world_size, timeout_s=TIMEOUT_S, args=(layout, str(directory), 16 * 1024))

    assert_round_trip([round_trip for round_trip, _ in results], directory, hf_logits)
    _assert_mtp_logits(results, reference)
    assert {f"{MTP}.enorm.weight", f"{MTP}.embed_tokens.weight", f"{MTP}.shared_head.head.weight"} <= set(results[-1][0][1])


def test_swapped_mtp_norms_change_megatron_mtp_logits(mtp_checkpoint, tmp_path):
    """A mapping that mixed up enorm and hnorm would be caught: the MTP logits check fails."""
    directory, hf_logits, reference = mtp_checkpoint
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(directory) / name, tmp_path / name)
    tensors = load_file(Path(directory) / "model.safetensors")
    tensors[f"{MTP}.enorm.weight"], tensors[f"{MTP}.hnorm.weight"] = tensors[f"{MTP}.hnorm.weight"], tensors[f"{MTP}.enorm.weight"]
    write_checkpoint(tmp_path, tensors)
    results = run_on_ranks(_import_run_export, 1, timeout_s=TIMEOUT_S, args=(ParallelLayout(world_size=1), str(tmp_path), 1 << 20))

    assert_round_trip([round_trip for round_trip, _ in results], tmp_path, hf_logits)  # the main model is untouched
    with pytest.raises(AssertionError):
        _assert_mtp_logits(results, reference)


def _load_only(rank, world_size, layout, hf_dir):
    initialize(layout)
    spec = model_spec_from_hf(hf_dir)
    load_hf_weights(build_chunks(spec, layout), spec, hf_dir)
    destroy()


@pytest.mark.parametrize("copy_name, owner", [
    (f"{MTP}.embed_tokens.weight", "model.embed_tokens.weight"),
    (f"{MTP}.shared_head.head.weight", "lm_head.weight"),
])
def test_mtp_copies_that_differ_from_the_main_tensors_are_refused_by_name(copy_name, owner, mtp_checkpoint, tmp_path):
    directory, _, _ = mtp_checkpoint
    shutil.copy(Path(directory) / "config.json", tmp_path / "config.json")
    tensors = load_file(Path(directory) / "model.safetensors")
    tensors[copy_name] = tensors[copy_name].clone()
    tensors[copy_name][VOCAB - 1, 0] += 1.0
    write_checkpoint(tmp_path, tensors)

    with pytest.raises(RankFailure, match=rf"'{copy_name}' in .* differs from '{owner}'"):
        run_on_ranks(_load_only, 2, timeout_s=TIMEOUT_S, args=(ParallelLayout(world_size=2, tp=2), str(tmp_path)))


def test_missing_mtp_tensor_is_refused_by_name(mtp_checkpoint, tmp_path):
    directory, _, _ = mtp_checkpoint
    shutil.copy(Path(directory) / "config.json", tmp_path / "config.json")
    tensors = load_file(Path(directory) / "model.safetensors")
    del tensors[f"{MTP}.eh_proj.weight"]
    write_checkpoint(tmp_path, tensors)

    with pytest.raises(RankFailure, match=rf"missing '{MTP}.eh_proj.weight'"):
        run_on_ranks(_load_only, 1, timeout_s=TIMEOUT_S, args=(ParallelLayout(world_size=1), str(tmp_path)))


# ---------------------------------------------------------------- MTP training forward


def _next_token_labels(tokens: torch.Tensor) -> torch.Tensor:
    return torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)


def _training_step(rank, world_size, layout, hf_dir):
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    initialize(layout)
    spec = model_spec_from_hf(hf_dir)
    (model,) = build_chunks(spec, layout)
    load_hf_weights([model], spec, hf_dir)
    model.train()
    tokens = probe_tokens()
    labels = _next_token_labels(tokens)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    loss = model(tokens, positions, None, labels=labels)
    loss.mean().backward()
    tracker = MTPLossLoggingHelper.tracker
    mtp_loss = tracker["loss_values" if "loss_values" in tracker else "values"][0].item()  # renamed in 0.17
    eh_proj_grad = model.mtp.layers[0].eh_proj.weight.grad.abs().sum().item()
    destroy()
    return mtp_loss, eh_proj_grad


def test_training_forward_computes_the_mtp_loss_and_trains_the_mtp_layer(mtp_checkpoint):
    directory, _, reference = mtp_checkpoint
    ((mtp_loss, eh_proj_grad),) = run_on_ranks(_training_step, 1, timeout_s=TIMEOUT_S, args=(ParallelLayout(world_size=1), str(directory)))

    # MTP position i is scored against labels[i + 1]; Megatron's roll leaves the last position out.
    # Its loss takes the softmax over the padded vocabulary, whose zero padding rows give logit 0.
    labels = _next_token_labels(probe_tokens())
    padded = torch.nn.functional.pad(reference[:, :-1], (0, padded_vocab_size(VOCAB, 1) - VOCAB))
    expected = torch.nn.functional.cross_entropy(padded.reshape(-1, padded.shape[-1]), labels[:, 1:].reshape(-1))
    assert mtp_loss == pytest.approx(expected.item(), abs=1e-4)
    assert eh_proj_grad > 0


def _load_without_mtp(rank, world_size, layout, hf_dir):
    initialize(layout)
    spec = model_spec_from_hf(hf_dir, mtp="off")
    chunks = build_chunks(spec, layout)
    load_hf_weights(chunks, spec, hf_dir)
    logits = _megatron_logits(chunks, probe_tokens())
    names = sorted(name for name, _ in export_hf_weights(chunks, spec))
    destroy()
    return logits, names


def test_mtp_off_builds_the_main_model_and_leaves_the_mtp_weights_unread(mtp_checkpoint):
    """model.mtp=off with a checkpoint that holds the MTP layer (DeepSeek's release): no MTP block, its
    tensors neither loaded nor refused as unexpected, the main logits HF's, and no MTP tensor exported."""
    directory, hf_logits, _ = mtp_checkpoint
    spec = model_spec_from_hf(directory, mtp="off")
    assert spec.mtp_num_layers == 0 and spec.unused_hf_prefixes == (f"{MTP}.",) and not spec.notes
    [(logits, names)] = run_on_ranks(_load_without_mtp, 1, timeout_s=TIMEOUT_S, args=(ParallelLayout(world_size=1), str(directory)))
    assert torch.allclose(logits, hf_logits, atol=LOGITS_ATOL)
    assert names == sorted(name for name in load_file(Path(directory) / "model.safetensors") if not name.startswith(f"{MTP}."))
    assert model_spec_from_hf(directory).mtp_num_layers == 1  # auto: the weights are there
