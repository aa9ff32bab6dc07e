"""The RolloutEngine contract, checked the same way for every adapter against ``HFEngine``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rlmega.rollout import EngineNotReadyError, HFEngine, SamplingParams, UnknownWeightError

from ..tiny_models import PROMPTS, checkpoint_tensors, in_buckets, load_reference, stream, teacher_forced_logprobs

LOGPROB_ATOL = 1e-4
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_new_tokens=MAX_NEW)


def hf_engine(path) -> HFEngine:
    return HFEngine(path, attn_implementation="eager")


def assert_same_generations(actual, expected) -> None:
    assert [(g.prompt_index, g.response_token_ids, g.finish_reason) for g in actual] == \
           [(g.prompt_index, g.response_token_ids, g.finish_reason) for g in expected]
    for a, e in zip(actual, expected):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(e.logprobs), atol=LOGPROB_ATOL, rtol=0)


def stop_case(reference: HFEngine) -> tuple[int, int]:
    """A token that prompt 0's greedy response emits at position k > 0 (first occurrence): ``(token, k)``."""
    response = reference.generate(PROMPTS[:1], GREEDY)[0].response_token_ids
    for k in range(1, len(response)):
        if response[k] not in response[:k]:
            return response[k], k
    raise AssertionError(f"no usable stop token in {response}")


def mixed_params(stop_token: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_new_tokens=MAX_NEW, stop_token_ids=(stop_token,)),
            GREEDY, SamplingParams(temperature=0, max_new_tokens=3), SamplingParams(temperature=0, top_k=1,
                                                                                     max_new_tokens=MAX_NEW)]


def check_greedy_matches_hf(engine, reference: HFEngine) -> None:
    """Greedy tokens, raw log-probs, stop token kept, finish reasons: all as HFEngine."""
    stop_token, k = stop_case(reference)
    params = mixed_params(stop_token)
    actual = engine.generate(PROMPTS, params)
    assert_same_generations(actual, reference.generate(PROMPTS, params))
    assert actual[0].response_token_ids[-1] == stop_token and actual[0].finish_reason == "stop"
    assert len(actual[0].response_token_ids) == k + 1
    assert {g.finish_reason for g in actual[1:]} == {"length"}
    # A stop token drawn as the last allowed token is a stop (the engines test the stop tokens first too).
    last = SamplingParams(temperature=0, max_new_tokens=k + 1, stop_token_ids=(stop_token,))
    assert engine.generate(PROMPTS[:1], last)[0].finish_reason == "stop"


def with_eos(path: Path, eos: int, directory: Path) -> Path:
    """A copy of a checkpoint whose config and generation config name ``eos`` as the EOS token."""
    copy = Path(shutil.copytree(path, directory / "eos-checkpoint"))
    for name in ("config.json", "generation_config.json"):
        file = copy / name
        config = json.loads(file.read_text()) if file.exists() else {}
        config["eos_token_id"] = eos
        file.write_text(json.dumps(config))
    return copy


def check_no_implicit_eos(make_engine, llama_dir: Path, tmp_path: Path) -> None:
    """The checkpoint's EOS stops a response only if the caller lists it in stop_token_ids."""
    reference = hf_engine(llama_dir)
    eos, k = stop_case(reference)
    engine = make_engine(with_eos(llama_dir, eos, tmp_path))
    assert_same_generations(engine.generate(PROMPTS, GREEDY), reference.generate(PROMPTS, GREEDY))
    with_stop = SamplingParams(temperature=0, max_new_tokens=MAX_NEW, stop_token_ids=(eos,))
    assert_same_generations(engine.generate(PROMPTS, with_stop), reference.generate(PROMPTS, with_stop))
    assert len(engine.generate(PROMPTS[:1], with_stop)[0].response_token_ids) == k + 1


def check_samples(engine, llama_dir: Path, *, seeded_repeat: bool = True, filters: bool = True) -> None:
    """n samples per prompt, prompt-major; log-probs are those of the temperature-scaled logits
    (before top-k / top-p, which ``filters=False`` leaves out for an engine whose log-probs include
    them); a fixed seed repeats; the n samples of a prompt differ."""
    params = SamplingParams(temperature=1.5, top_k=30 if filters else None, top_p=0.95 if filters else 1.0,
                            max_new_tokens=MAX_NEW, n=3, seed=7)
    first = engine.generate(PROMPTS, params)
    assert [g.prompt_index for g in first] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    reference = load_reference(llama_dir)
    for g in first:
        assert g.finish_reason == "length" and len(g.response_token_ids) == MAX_NEW
        expected = teacher_forced_logprobs(reference, PROMPTS[g.prompt_index], g.response_token_ids, temperature=1.5)
        torch.testing.assert_close(torch.tensor(g.logprobs), expected, atol=LOGPROB_ATOL, rtol=0)
    responses = [tuple(g.response_token_ids) for g in first]
    assert any(len(set(responses[3 * i:3 * i + 3])) > 1 for i in range(len(PROMPTS)))
    if seeded_repeat:
        assert [g.response_token_ids for g in engine.generate(PROMPTS, params)] == [list(r) for r in responses]


def streamed_with_versions(engine, buckets, seen):
    for bucket in buckets:
        seen.append(engine.weight_version())
        yield from bucket


def check_streamed_update(engine, llama_other_dir: Path) -> None:
    seen: list[int] = []
    engine.update_weights(streamed_with_versions(engine, in_buckets(checkpoint_tensors(llama_other_dir), 3), seen),
                          version=1)
    assert seen == [0, 0, 0] and engine.weight_version() == 1
    other = hf_engine(llama_other_dir)
    stop_token, _ = stop_case(other)
    params = mixed_params(stop_token)
    after = engine.generate(PROMPTS, params)
    assert_same_generations(after, other.generate(PROMPTS, params))
    assert {g.weight_version for g in after} == {1}


def check_bad_updates_send_nothing(engine, sent_calls) -> None:
    """Unknown names and wrong shapes raise before anything reaches the engine; the version stays."""
    with pytest.raises(UnknownWeightError, match=r"'model\.layers\.0\.mlp\.gate_prj\.weight'.*did you mean "
                                                 r"'model\.layers\.0\.mlp\.gate_proj\.weight'"):
        engine.update_weights([("model.layers.0.mlp.gate_prj.weight", torch.zeros(96, 64))], version=1)
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \(3,\), expected \(64,\)"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))], version=1)
    with pytest.raises(ValueError, match="version must be an int >= the current weight version 0"):
        engine.update_weights([], version=-1)
    assert sent_calls() == []
    assert engine.weight_version() == 0 and engine.health()["ready"]
    engine.update_weights([], version=1)  # an empty update is complete
    assert engine.weight_version() == 1


def check_torn_update(engine, reference_other: HFEngine, llama_other_dir: Path) -> None:
    """``engine`` sends each tensor on its own (tiny bucket_bytes), so the first tensors land before the bad one."""
    good = sorted(checkpoint_tensors(llama_other_dir).items())
    with pytest.raises(UnknownWeightError, match="'model.layers.7.self_attn.q_proj.weight'"):
        engine.update_weights(good[:5] + [("model.layers.7.self_attn.q_proj.weight", torch.zeros(64, 64))],
                              version=1)
    assert engine.weight_version() == 0
    assert engine.health()["torn_update_version"] == 1 and not engine.health()["ready"]
    with pytest.raises(EngineNotReadyError, match="update to weight version 1 failed part way"):
        engine.generate(PROMPTS, GREEDY)
    engine.update_weights(good, version=1)
    assert engine.weight_version() == 1 and engine.health()["ready"]
    assert_same_generations(engine.generate(PROMPTS, GREEDY), reference_other.generate(PROMPTS, GREEDY))


def check_sleep_level_1(engine) -> None:
    before = engine.generate(PROMPTS, GREEDY)
    engine.sleep(level=1)
    assert engine.health()["sleep_level"] == 1 and not engine.health()["ready"]
    with pytest.raises(EngineNotReadyError, match=r"asleep \(level 1\): call wake\(\) first"):
        engine.generate(PROMPTS, GREEDY)
    engine.wake()
    assert engine.health()["ready"]
    assert_same_generations(engine.generate(PROMPTS, GREEDY), before)


def check_sleep_level_2(engine, llama_dir: Path, *, wake_first: bool) -> None:
    before = engine.generate(PROMPTS, GREEDY)
    engine.sleep(level=2)
    names = checkpoint_tensors(llama_dir)
    assert engine.health()["missing_weights"] == len(names)
    with pytest.raises(EngineNotReadyError, match=r"call wake\(\) and re-sync every weight with update_weights"):
        engine.generate(PROMPTS, GREEDY)
    first, *rest = in_buckets(names, 3)
    if wake_first:
        engine.wake()
    engine.update_weights(first, version=0)  # re-sending the current version is allowed
    if wake_first:
        remaining = engine.health()["missing_weights"]
        assert remaining == sum(map(len, rest))
        with pytest.raises(EngineNotReadyError, match=f"{remaining} weights dropped by sleep\\(level=2\\) have not"):
            engine.generate(PROMPTS, GREEDY)
    engine.update_weights(stream(rest), version=0)
    if not wake_first:
        with pytest.raises(EngineNotReadyError, match="asleep"):
            engine.generate(PROMPTS, GREEDY)
        engine.wake()
    assert engine.health()["ready"]
    assert_same_generations(engine.generate(PROMPTS, GREEDY), before)


WAIT_S = 60.0  # waits on another thread: generous, since one that ends early passes


def check_paused_calls(engine, engine_generate_calls) -> None:
    """While paused, generate answers at once, every response "abort" and empty, without reaching the
    engine; pause and resume are idempotent; resumed, the same call repeats."""
    params = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, n=2, seed=4)
    before = engine.generate(PROMPTS, params)
    calls = len(engine_generate_calls())
    engine.pause_generation()
    engine.pause_generation()
    assert engine.health()["paused"]
    paused = engine.generate(PROMPTS, params)
    assert [(g.prompt_index, g.response_token_ids, g.logprobs, g.finish_reason, g.weight_version) for g in paused] \
        == [(g.prompt_index, [], [], "abort", 0) for g in before]
    assert len(engine_generate_calls()) == calls
    engine.resume_generation()
    engine.resume_generation()
    assert not engine.health()["paused"]
    assert_same_generations(engine.generate(PROMPTS, params), before)


SENDER = """
import os
import sys
import torch
from safetensors.torch import load_file
from rlmega.rollout.weight_group import init_weight_update_group, broadcast_weights
port, path, num_buckets = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
tensors = sorted(load_file(path).items())
size = -(-len(tensors) // num_buckets)
group = init_weight_update_group("127.0.0.1", port, rank=0, world_size=2, group_name=f"rlmega_test_{port}",
                                 backend="gloo")
for start in range(0, len(tensors), size):
    broadcast_weights(group, tensors[start:start + size])
torch.distributed.destroy_process_group(group)
os._exit(0)  # rank 0 hosts the rendezvous store; interpreter teardown aborts while the engine is still connected
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_broadcast_update(engine, llama_other_dir: Path) -> None:
    """Disaggregated mode: a trainer process (rank 0) broadcasts 3 buckets over gloo; the engine's workers
    receive them and the engine becomes the other checkpoint."""
    import subprocess
    import sys

    from rlmega.rollout.weight_group import weight_meta

    port = free_port()
    (file,) = sorted(Path(llama_other_dir).glob("*.safetensors"))
    sender = subprocess.Popen([sys.executable, "-c", SENDER, str(port), str(file), "3"], stderr=subprocess.PIPE,
                              text=True)
    try:
        engine.init_weight_update_group("127.0.0.1", port, rank_offset=1, world_size=2, backend="gloo",
                                        group_name=f"rlmega_test_{port}")  # names are process-wide
        engine.begin_update(1)
        for bucket in in_buckets(checkpoint_tensors(llama_other_dir), 3):
            engine.receive_weights(weight_meta(bucket))
            assert engine.weight_version() == 0
        engine.commit_update()
        _, errors = sender.communicate(timeout=60)
        assert sender.returncode == 0, errors
        engine.destroy_weight_update_group()
    finally:
        sender.kill()
    assert engine.weight_version() == 1
    other = hf_engine(llama_other_dir)
    assert_same_generations(engine.generate(PROMPTS, GREEDY), other.generate(PROMPTS, GREEDY))


# ---------------------------------------------------------------------------------------------- MoE routing (R3)

def save_deepseek_dense_first_layer(directory: Path, seed: int = 0) -> Path:
    """A tiny DeepSeek-V3 whose first layer is dense (``first_k_dense_replace=1``): MoE layers 1 and 2 of 3,
    so the engines' per-decoder-layer routing has a column to drop."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from ..tiny_models import VOCAB

    torch.manual_seed(seed)
    config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, n_shared_experts=1, max_position_embeddings=128, num_nextn_predict_layers=0)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(0.2 * torch.randn_like(tensor))
            elif tensor.dim() == 1:
                tensor.copy_(1.0 + 0.1 * torch.randn_like(tensor))
            else:
                tensor.normal_(0.0, 0.15)
    model.save_pretrained(directory)
    return directory


@torch.no_grad()
def teacher_forced_routing(model, tokens: list[int]) -> torch.Tensor:
    """``[T, M, k]`` int16: one forward pass of ``tokens``, the MoE gates' expert ids in layer order."""
    seen = []
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    handles = [gate.register_forward_hook(lambda module, inputs, output: seen.append(output[2])) for gate in gates]
    try:
        model(torch.tensor([tokens]))
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(seen, dim=1).to(torch.int16)


def check_routing(engine, path: Path) -> None:
    """Every generation's routing is ``[P + R, M, k]`` int16: the routing of one pass over prompt + response
    in the MoE layers (the last token repeating the one before), and, greedy, the hf engine's exactly."""
    reference = load_reference(path)
    num_moe = sum(hasattr(layer.mlp, "experts") for layer in reference.model.layers)
    sampled = SamplingParams(temperature=1.0, n=2, seed=5, max_new_tokens=6)
    for params in (GREEDY, sampled):
        generations = engine.generate(PROMPTS, params)
        for generation in generations:
            tokens = PROMPTS[generation.prompt_index] + generation.response_token_ids
            routing = generation.routing
            assert routing.dtype == torch.int16
            assert tuple(routing.shape) == (len(tokens), num_moe, reference.config.num_experts_per_tok)
            assert torch.equal(routing[:-1], teacher_forced_routing(reference, tokens)[:-1])
            assert torch.equal(routing[-1], routing[-2])
    hf = HFEngine(path, attn_implementation="eager", record_routing=True).generate(PROMPTS, GREEDY)
    for actual, expected in zip(engine.generate(PROMPTS, GREEDY), hf):
        assert actual.response_token_ids == expected.response_token_ids
        assert torch.equal(actual.routing, expected.routing)
