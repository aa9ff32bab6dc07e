"""VLLMEngine against a stand-in for vllm 0.33 (tests/rollout/fakes/fake_vllm.py) whose every call is bound
to the API recorded from the wheel (fakes/api/vllm.json): the RolloutEngine contract, and the vLLM calls
the adapter makes. tests/gpu/test_vllm_engine.py runs the real engine."""

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from .fakes import contract, fake_vllm, one_thread
from .tiny_models import PROMPTS, checkpoint_tensors


@pytest.fixture
def vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with one_thread():
        yield fake_vllm


@pytest.fixture
def make_engine(vllm):
    from rlmega.rollout.vllm_engine import VLLMEngine

    return lambda path, **kwargs: VLLMEngine(path, gpu_memory_utilization=0.5, **kwargs)


def _weight_calls(engine):
    return [c for c in engine.llm.calls if c[0] == "collective_rpc"]


def test_engine_arguments_and_sampling_params(make_engine, llama_dir):
    import os

    engine = make_engine(llama_dir)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # in-process engine core: tensors by reference
    _, model, kwargs = engine.llm.calls[0]
    assert model == str(llama_dir)
    assert kwargs == {"gpu_memory_utilization": 0.5, "skip_tokenizer_init": True, "logprobs_mode": "processed_logprobs",
                      "enable_sleep_mode": True, "weight_transfer_config": {"backend": "nccl"},
                      "worker_extension_cls": "rlmega.rollout.vllm_engine.VLLMWorkerExtension",
                      "enable_return_routed_experts": False}
    engine.generate(PROMPTS[:2], [contract.GREEDY, contract.SamplingParams(top_k=5, n=2, seed=3, max_new_tokens=4,
                                                                           stop_token_ids=[9])])
    (_, prompts, params), = [c for c in engine.llm.calls if c[0] == "generate"]
    assert prompts == [PROMPTS[0], PROMPTS[1], PROMPTS[1]]  # one request per response, prompt-major
    assert [(p.n, p.temperature, p.top_k, p.max_tokens, p.stop_token_ids, p.ignore_eos, p.logprobs, p.detokenize)
            for p in params] == [(1, 0, 0, 8, [], True, 0, False), (1, 1.0, 5, 4, [9], True, 0, False),
                                 (1, 1.0, 5, 4, [9], True, 0, False)]
    assert params[0].seed is None and params[1].seed != params[2].seed


def test_settings_the_adapter_owns_cannot_be_overridden(make_engine, llama_dir):
    with pytest.raises(ValueError, match=r"VLLMEngine sets \['logprobs_mode'\] itself"):
        make_engine(llama_dir, logprobs_mode="raw_logprobs")


def test_greedy_matches_hf(make_engine, llama_dir):
    contract.check_greedy_matches_hf(make_engine(llama_dir), contract.hf_engine(llama_dir))


def test_no_implicit_eos(make_engine, llama_dir, tmp_path):
    contract.check_no_implicit_eos(make_engine, llama_dir, tmp_path)


def test_samples_are_prompt_major_seeded_with_tempered_logprobs(make_engine, llama_dir):
    contract.check_samples(make_engine(llama_dir), llama_dir, filters=False)


def test_streamed_update(make_engine, llama_dir, llama_other_dir):
    engine = make_engine(llama_dir, bucket_bytes=20_000)
    contract.check_streamed_update(engine, llama_other_dir)
    sent = [name for call in _weight_calls(engine) for name, _ in call[2][0]]
    assert sorted(sent) == sorted(checkpoint_tensors(llama_other_dir))
    assert len(_weight_calls(engine)) > 3  # bucketed by size, not by the producer's chunks
    assert engine.llm.calls.index(("reset_prefix_cache",)) > engine.llm.calls.index(_weight_calls(engine)[-1])
    # vLLM's own update session around the buckets: layerwise reload, and the version it reports.
    session = [c for c in engine.llm.calls if c[0] in ("start_weight_update", "finish_weight_update", "collective_rpc")]
    assert session == [("start_weight_update",)] + _weight_calls(engine) + [("finish_weight_update", "1")]
    assert engine.llm.weight_version == "1"


def test_the_fake_refuses_what_the_release_does_not_accept(vllm, llama_dir):
    """Each fake call is bound to the signature recorded from the wheel: an engine argument, a keyword or a
    log-prob mode that 0.33 does not have fails here, as it would on a GPU."""
    with pytest.raises(TypeError, match=r"EngineArgs .* has no field\(s\) \['enable_magic'\]"):
        vllm.LLM(str(llama_dir), enable_magic=True)
    with pytest.raises(ValueError, match="logprobs_mode 'processed'"):
        vllm.LLM(str(llama_dir), logprobs_mode="processed")
    llm = vllm.LLM(str(llama_dir))
    with pytest.raises(TypeError, match=r"LLM\.reset_prefix_cache .*'device'"):
        llm.reset_prefix_cache(device="cuda")
    with pytest.raises(RuntimeError, match="set weight_transfer_config"):
        llm.start_weight_update()


def test_bad_updates_send_nothing(make_engine, llama_dir):
    engine = make_engine(llama_dir)
    contract.check_bad_updates_send_nothing(engine, lambda: _weight_calls(engine))


def test_torn_update_refuses_generate(make_engine, llama_dir, llama_other_dir):
    contract.check_torn_update(make_engine(llama_dir, bucket_bytes=1), contract.hf_engine(llama_other_dir),
                               llama_other_dir)


def test_sleep_level_1(make_engine, llama_dir):
    engine = make_engine(llama_dir)
    contract.check_sleep_level_1(engine)
    assert [c for c in engine.llm.calls if c[0] in ("sleep", "wake_up")] == [("sleep", 1),
                                                                             ("wake_up", ["weights", "kv_cache"])]


@pytest.mark.parametrize("wake_first", [True, False], ids=["wake-then-resync", "resync-then-wake"])
def test_sleep_level_2_requires_resync(make_engine, llama_dir, wake_first):
    engine = make_engine(llama_dir)
    contract.check_sleep_level_2(engine, llama_dir, wake_first=wake_first)
    expected = ([("sleep", 2), ("wake_up", ["weights", "kv_cache"])] if wake_first else
                [("sleep", 2), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"])])  # weights woken to be written
    assert [c for c in engine.llm.calls if c[0] in ("sleep", "wake_up")] == expected


def test_broadcast_update(make_engine, llama_dir, llama_other_dir):
    engine = make_engine(llama_dir)
    contract.check_broadcast_update(engine, llama_other_dir)
    assert [c[1] for c in _weight_calls(engine)] == (["rlmega_init_weight_group"] + ["rlmega_receive_weights"] * 3
                                                      + ["rlmega_destroy_weight_group"])


def test_calls_while_paused_abort_without_reaching_vllm(make_engine, llama_dir):
    engine = make_engine(llama_dir)
    contract.check_paused_calls(engine, lambda: [c for c in engine.llm.calls if c[0] == "generate"])


def test_pause_does_not_interrupt_a_running_call(make_engine, llama_dir, monkeypatch):
    """The offline LLM.generate is not interrupted: a running call completes ("length")."""
    engine = make_engine(llama_dir)
    in_call, release = threading.Event(), threading.Event()
    generate = engine.llm.generate

    def held(*args, **kwargs):
        in_call.set()
        assert release.wait(contract.WAIT_S)
        return generate(*args, **kwargs)

    monkeypatch.setattr(engine.llm, "generate", held)
    with ThreadPoolExecutor(max_workers=1) as pool:
        running = pool.submit(engine.generate, PROMPTS, contract.GREEDY)
        assert in_call.wait(contract.WAIT_S)
        engine.pause_generation()
        release.set()
        contract.assert_same_generations(running.result(contract.WAIT_S),
                                         contract.hf_engine(llama_dir).generate(PROMPTS, contract.GREEDY))
    assert {g.finish_reason for g in engine.generate(PROMPTS, contract.GREEDY)} == {"abort"}


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    return contract.save_deepseek_dense_first_layer(tmp_path_factory.mktemp("deepseek-v3-dense-first-layer"))


@pytest.mark.parametrize("which", ["qwen3_moe_dirs", "deepseek_dir"])
def test_routing_is_recorded_in_our_convention(make_engine, which, request):
    """record_routing=True builds vLLM with enable_return_routed_experts; its [P + R - 1, layers, k] uint8
    rows come back as [P + R, M, k] int16 in the MoE layers (DeepSeek's dense first layer dropped)."""
    path = request.getfixturevalue(which)
    path = path[0] if isinstance(path, tuple) else path
    engine = make_engine(path, record_routing=True)
    assert engine.llm.calls[0][2]["enable_return_routed_experts"] is True
    contract.check_routing(engine, path)
    (_, _, params), *_ = [c for c in engine.llm.calls if c[0] == "generate"]
    assert {p.routed_experts_prompt_start for p in params} == {0}  # every prompt row


def test_routing_conversion(make_engine, qwen3_moe_dirs, monkeypatch):
    """A hand-built engine answer: vLLM's rows per decoder layer, the last sampled token without a row."""
    engine = make_engine(qwen3_moe_dirs[0], record_routing=True)
    prompt, new = [5, 17, 33], 3
    rows = np.arange(5 * 2 * 2, dtype=np.uint8).reshape(5, 2, 2)  # P + R - 1 = 5 rows, 2 layers, top-2
    monkeypatch.setattr(engine.llm.model, "routed_experts", lambda tokens: rows.astype(np.int32)[:len(tokens)])
    (generation,) = engine.generate([prompt], contract.SamplingParams(temperature=0, max_new_tokens=new))
    expected = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]], [[12, 13], [14, 15]],
                             [[16, 17], [18, 19]], [[16, 17], [18, 19]]], dtype=torch.int16)
    assert torch.equal(generation.routing, expected)


def test_routing_conversion_of_engine_layouts():
    """Dense layers dropped, uint16 ids (> 256 experts) kept, rows past a cut response dropped."""
    from rlmega.rollout.engine_common import routing_in_convention

    captured = np.array([[[300, 1], [0, 0], [7, 8]], [[2, 301], [0, 0], [9, 10]], [[3, 4], [0, 0], [11, 12]]],
                        dtype=np.uint16)  # 3 rows (P + R - 1), layers 0 and 2 are MoE
    assert torch.equal(routing_in_convention(captured, (0, 2), 4), torch.tensor(
        [[[300, 1], [7, 8]], [[2, 301], [9, 10]], [[3, 4], [11, 12]], [[3, 4], [11, 12]]], dtype=torch.int16))
    assert torch.equal(routing_in_convention(captured, (0, 2), 2), torch.tensor(
        [[[300, 1], [7, 8]], [[300, 1], [7, 8]]], dtype=torch.int16))
    with pytest.raises(RuntimeError, match=r"shape \(3, 3, 2\); expected \[>= 4"):
        routing_in_convention(captured, (0, 2), 5)


def test_without_record_routing_nothing_is_asked(make_engine, qwen3_moe_dirs):
    engine = make_engine(qwen3_moe_dirs[0])
    assert engine.llm.calls[0][2]["enable_return_routed_experts"] is False
    assert {g.routing for g in engine.generate(PROMPTS[:2], contract.GREEDY)} == {None}


def test_dense_models_cannot_record_routing(make_engine, vllm, llama_dir, monkeypatch):
    monkeypatch.setattr(vllm, "LLM", lambda *args, **kwargs: pytest.fail("the engine was built"))
    with pytest.raises(ValueError, match="this model has no MoE layers"):
        make_engine(llama_dir, record_routing=True)


def test_the_fake_refuses_routing_where_the_release_does(vllm, llama_dir, qwen3_moe_dirs):
    """vllm/config/vllm.py: _verify_aux_output_compatibility; input_processor.py: routed_experts_prompt_start."""
    with pytest.raises(ValueError, match="only supports MoE models"):
        vllm.LLM(str(llama_dir), enable_return_routed_experts=True)
    with pytest.raises(ValueError, match="requires prefix caching"):
        vllm.LLM(str(qwen3_moe_dirs[0]), enable_return_routed_experts=True, enable_prefix_caching=False)
    llm = vllm.LLM(str(qwen3_moe_dirs[0]), enable_return_routed_experts=True)
    with pytest.raises(vllm.VLLMValidationError, match="routed_experts_prompt_start must be between 0 and the "
                                                       "prompt length"):
        llm.generate([{"prompt_token_ids": [1, 2]}], vllm.SamplingParams(routed_experts_prompt_start=3))
    (output,) = llm.generate([{"prompt_token_ids": [1, 2, 3]}], vllm.SamplingParams(max_tokens=2, temperature=0))
    routed = output.outputs[0].routed_experts  # [P + R - 1, num_hidden_layers, k], uint8 (4 experts)
    assert routed.dtype == np.uint8 and routed.shape == (3 + 2 - 1, 2, 2)


def test_version_gate(vllm, monkeypatch, llama_dir):
    from rlmega.rollout.vllm_engine import VLLMEngine

    monkeypatch.setattr(vllm, "__version__", "0.11.0")
    with pytest.raises(RuntimeError, match=r"vllm 0\.11\.0 is installed, but rlmega's vllm adapter supports "
                                           r"vllm>=0\.33,<0\.35"):
        VLLMEngine(llama_dir)
    monkeypatch.setattr(vllm, "__version__", "0.34.0")  # 0.34: the same calls (fakes/api/vllm-0.34.json)
    assert VLLMEngine(llama_dir).health()["engine_version"] == "0.34.0"


def test_importing_rlmega_rollout_imports_no_engine():
    code = ("import sys, rlmega.rollout as r; assert 'vllm' not in sys.modules and 'sglang' not in sys.modules; "
            "assert r.VLLMEngine.__name__ == 'VLLMEngine' and r.SGLangEngine.__name__ == 'SGLangEngine'; "
            "assert 'vllm' not in sys.modules and 'sglang' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sharded_rdt_engines_are_built_on_vllms_ray_executor(make_engine, llama_dir):
    """vLLM's sharded_rdt engine refuses any executor but Ray's at construction (the fake, as the wheel's
    sharded_rdt_engine.py); unset, vLLM would pick "uni" for one GPU."""
    with pytest.raises(ValueError, match="requires distributed_executor_backend='ray', got 'uni'"):
        fake_vllm.LLM(str(llama_dir), weight_transfer_config={"backend": "sharded_rdt"})
    engine = make_engine(llama_dir, weight_transfer="sharded_rdt")
    assert engine.llm.calls[0][2]["distributed_executor_backend"] == "ray"
    assert "distributed_executor_backend" not in make_engine(llama_dir).llm.calls[0][2]  # nccl: vLLM's choice
    with pytest.raises(ValueError, match="weight_transfer='sharded_rdt' needs distributed_executor_backend='ray'"):
        make_engine(llama_dir, weight_transfer="sharded_rdt", distributed_executor_backend="mp")


def test_vllm_layer_groups_the_weights_vllm_loads_together():
    from rlmega.rollout.vllm_engine import vllm_layer

    attention = "model.layers.0.self_attn."
    assert {vllm_layer(attention + f"{p}_proj.{kind}") for p in "qkv" for kind in ("weight", "bias")} == \
        {attention + "qkv_proj"}
    assert vllm_layer(attention + "o_proj.weight") == attention + "o_proj"
    assert vllm_layer("model.layers.1.mlp.up_proj.weight") == vllm_layer("model.layers.1.mlp.gate_proj.weight")
    assert vllm_layer("model.layers.1.mlp.experts.7.down_proj.weight") == "model.layers.1.mlp.experts"
    assert vllm_layer("model.layers.1.mlp.shared_expert.up_proj.weight") == "model.layers.1.mlp.shared_expert.gate_up_proj"
    assert vllm_layer("model.layers.0.block_sparse_moe.experts.0.w1.weight") == "model.layers.0.block_sparse_moe.experts"
    assert vllm_layer("model.layers.0.self_attn.kv_a_proj_with_mqa.weight") == \
        vllm_layer("model.layers.0.self_attn.q_a_proj.weight")


def test_a_partial_update_of_a_fused_layer_is_refused(make_engine, llama_dir, tmp_path):
    """q_proj without k_proj / v_proj: vLLM would rebuild the rest of qkv_proj from uninitialised memory at the
    end of the update (vllm/model_executor/model_loader/reload/layerwise.py), so the commit refuses and the engine
    refuses to generate until a whole update lands; a whole layer alone is fine."""
    from rlmega.rollout import EngineNotReadyError

    engine = make_engine(llama_dir)
    tensors = dict(checkpoint_tensors(llama_dir))
    q_name = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match=r"q_proj.weight without .*k_proj.weight.*self_attn.qkv_proj"):
        engine.update_weights(iter([(q_name, tensors[q_name])]), version=1)
    assert engine.weight_version() == 0 and engine.health()["torn_update_version"] == 1
    with pytest.raises(EngineNotReadyError):
        engine.generate(PROMPTS[:1], contract.GREEDY)
    attention = [(name, tensor) for name, tensor in tensors.items() if ".0.self_attn." in name and "_proj" in name]
    engine.update_weights(iter(attention), version=1)  # the whole of qkv_proj (and o_proj)
    assert engine.weight_version() == 1 and engine.health()["ready"]
    engine.generate(PROMPTS[:1], contract.GREEDY)


def test_the_fake_stops_before_the_length_limit_as_vllm_does(vllm, llama_dir):
    """vllm/v1/core/sched/utils.py check_stop tests the stop tokens before the length limit: a stop token drawn
    as the last allowed token finishes "stop"."""
    llm = fake_vllm.LLM(str(llama_dir), skip_tokenizer_init=True)
    request = [{"prompt_token_ids": PROMPTS[0]}]
    free = llm.generate(request, fake_vllm.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    tokens = free[0].outputs[0].token_ids
    k = max(i for i, token in enumerate(tokens) if token not in tokens[:i])  # a token not drawn before it
    stopped = llm.generate(request, fake_vllm.SamplingParams(temperature=0, max_tokens=k + 1, ignore_eos=True,
                                                             stop_token_ids=[tokens[k]]))[0].outputs[0]
    assert stopped.token_ids == tokens[:k + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == tokens[k]


def test_top_k_logprobs_are_of_the_truncated_distribution_on_cpu(make_engine, llama_dir):
    """CPU twin of tests/gpu/test_vllm_engine.py's check, on the fake (processed_logprobs, as the wheel's sampler)."""
    from gpu.engine_checks import check_top_k_logprobs_are_truncated

    check_top_k_logprobs_are_truncated(make_engine(llama_dir), llama_dir, device="cpu")
