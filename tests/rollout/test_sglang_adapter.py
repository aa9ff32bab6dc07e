"""SGLangEngine against a stand-in for sglang 0.5.23 (tests/rollout/fakes/fake_sglang.py) whose every call is
bound to the API recorded from the wheel (fakes/api/sglang.json): the RolloutEngine contract, and the SGLang
calls the adapter makes. tests/gpu/test_sglang_engine.py runs the real engine."""

import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import base64

import numpy as np
import pytest
import torch

from rlmega.rollout import SamplingParams

from .fakes import contract, fake_sglang, one_thread
from .tiny_models import PROMPTS, checkpoint_tensors

UPDATE_CALLS = ("update_weights_from_tensor", "update_weights_from_distributed", "init_weights_update_group",
                "begin_weight_update")


@pytest.fixture
def sglang(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", fake_sglang)
    monkeypatch.delenv(fake_sglang.RAW_LOGPROB_ENV, raising=False)
    with one_thread():
        yield fake_sglang


@pytest.fixture
def make_engine(sglang):
    from rlmega.rollout.sglang_engine import SGLangEngine

    def make(path, **kwargs):
        kwargs = {"mem_fraction_static": 0.5, "enable_deterministic_inference": True,
                  "enable_weights_cpu_backup": True, **kwargs}
        return SGLangEngine(path, **kwargs)

    return make


def _calls(engine, *names):
    return [c for c in engine.engine.calls if c[0] in names]


def test_server_arguments_and_sampling_params(make_engine, llama_dir):
    import os

    engine = make_engine(llama_dir)
    assert fake_sglang.RAW_LOGPROB_ENV not in os.environ  # temperature-scaled log-probs from the scheduler processes
    (_, kwargs), = _calls(engine, "__init__")
    assert kwargs == {"model_path": str(llama_dir), "mem_fraction_static": 0.5, "enable_deterministic_inference": True,
                      "enable_weights_cpu_backup": True, "skip_tokenizer_init": True, "enable_memory_saver": True}
    engine.generate(PROMPTS[:2], [contract.GREEDY, contract.SamplingParams(top_k=5, n=2, seed=3, max_new_tokens=4,
                                                                           stop_token_ids=[2, 9])])
    (_, input_ids, params, return_logprob, start, routed), = _calls(engine, "generate")
    assert input_ids == [PROMPTS[0], PROMPTS[1], PROMPTS[1]] and return_logprob is True and start == -1
    assert routed is False and "enable_return_routed_experts" not in kwargs  # record_routing=False asks nothing
    assert params[0] == {"n": 1, "temperature": 0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8,
                         "stop_token_ids": [], "ignore_eos": True, "no_stop_trim": True}  # EOS (2) not a stop here
    assert {k: params[1][k] for k in ("top_k", "stop_token_ids", "ignore_eos")} == \
           {"top_k": 5, "stop_token_ids": [2, 9], "ignore_eos": False}  # every EOS id is a stop: SGLang stops
    assert 0 <= params[1]["sampling_seed"] < 2**31 and params[1]["sampling_seed"] != params[2]["sampling_seed"]


def test_greedy_matches_hf(make_engine, llama_dir):
    contract.check_greedy_matches_hf(make_engine(llama_dir), contract.hf_engine(llama_dir))


def test_no_implicit_eos(make_engine, llama_dir, tmp_path):
    contract.check_no_implicit_eos(make_engine, llama_dir, tmp_path)


def test_samples_are_prompt_major_seeded_with_tempered_logprobs(make_engine, llama_dir):
    contract.check_samples(make_engine(llama_dir), llama_dir)


def test_streamed_update(make_engine, llama_dir, llama_other_dir):
    engine = make_engine(llama_dir, bucket_bytes=20_000)
    contract.check_streamed_update(engine, llama_other_dir)
    updates = _calls(engine, "update_weights_from_tensor")
    assert sorted(n for call in updates for n in call[1]) == sorted(checkpoint_tensors(llama_other_dir))
    assert len(updates) > 3 and {(fmt, flush) for _, _, fmt, flush in updates} == {(None, False)}
    assert engine.engine.calls.index(("flush_cache",)) > engine.engine.calls.index(updates[-1])
    # One update session around the buckets (0.5.23 refuses updates outside one).
    sessions = [c[0] for c in _calls(engine, "begin_weight_update", "end_weight_update", "update_weights_from_tensor")]
    assert sessions == ["begin_weight_update"] + ["update_weights_from_tensor"] * len(updates) + ["end_weight_update"]


def test_bad_updates_send_nothing(make_engine, llama_dir):
    engine = make_engine(llama_dir)
    contract.check_bad_updates_send_nothing(engine, lambda: _calls(engine, *UPDATE_CALLS))


def test_torn_update_refuses_generate(make_engine, llama_dir, llama_other_dir):
    contract.check_torn_update(make_engine(llama_dir, bucket_bytes=1), contract.hf_engine(llama_other_dir),
                               llama_other_dir)


def test_sleep_level_1(make_engine, llama_dir):
    engine = make_engine(llama_dir)
    contract.check_sleep_level_1(engine)
    assert _calls(engine, "release_memory_occupation", "resume_memory_occupation") == [
        ("release_memory_occupation", ["kv_cache", "weights"]), ("resume_memory_occupation", ["weights", "kv_cache"])]


def test_sleep_level_1_needs_the_cpu_backup(make_engine, llama_dir):
    engine = make_engine(llama_dir, enable_weights_cpu_backup=False)
    with pytest.raises(ValueError, match="enable_weights_cpu_backup=True"):
        engine.sleep(level=1)


@pytest.mark.parametrize("wake_first", [True, False], ids=["wake-then-resync", "resync-then-wake"])
def test_sleep_level_2_requires_resync(make_engine, llama_dir, wake_first):
    engine = make_engine(llama_dir, enable_weights_cpu_backup=False)
    contract.check_sleep_level_2(engine, llama_dir, wake_first=wake_first)
    resumes = [c[1] for c in _calls(engine, "resume_memory_occupation")]
    assert resumes == ([["weights", "kv_cache"]] if wake_first else [["weights"], ["kv_cache"]])


def test_broadcast_update(make_engine, llama_dir, llama_other_dir):
    engine = make_engine(llama_dir)
    contract.check_broadcast_update(engine, llama_other_dir)
    (init,), received = _calls(engine, "init_weights_update_group"), _calls(engine, "update_weights_from_distributed")
    group_name = init[5]
    assert init[3:] == (1, 2, group_name, "gloo") and len(received) == 3
    assert all(call[4:] == (group_name, False) for call in received)
    assert [c[0] for c in _calls(engine, "begin_weight_update", "end_weight_update")] == \
        ["begin_weight_update", "end_weight_update"]


def test_receive_without_a_weight_group_sends_nothing(make_engine, llama_dir):
    """Disaggregated update before init_weight_update_group: refused by the adapter, before any engine call
    (SGLang's receiver asserts on the unknown group; in 0.5.3 the assert killed the scheduler)."""
    engine = make_engine(llama_dir)
    engine.begin_update(1)
    with pytest.raises(RuntimeError, match="call init_weight_update_group first"):
        engine.receive_weights([("model.norm.weight", "float32", (64,))])
    assert _calls(engine, *UPDATE_CALLS) == [] and engine.health()["ready"]


def test_the_raw_logprob_switch_is_cleared(sglang, monkeypatch, llama_dir):
    """The switch the pinned SGLang reads (recorded from its wheel) set to 1 by the user: the adapter clears
    it, so log-probs stay temperature-scaled (0.5.3's adapter cleared a name 0.5.23 no longer reads)."""
    from rlmega.rollout import sglang_engine
    from rlmega.rollout.sglang_engine import SGLangEngine

    assert sglang_engine.RAW_LOGPROB_ENV in sglang.API["env"]
    monkeypatch.setenv(sglang.RAW_LOGPROB_ENV, "1")
    with pytest.warns(UserWarning, match="overridden"):
        engine = SGLangEngine(llama_dir, enable_deterministic_inference=True)
    contract.check_samples(engine, llama_dir)


def test_the_fake_refuses_what_the_release_does_not_accept(sglang, llama_dir):
    """Each fake call is bound to the signature recorded from the wheel: a keyword or server argument that
    0.5.23 does not have fails here, as it would on a GPU."""
    with pytest.raises(TypeError, match=r"ServerArgs .* has no field\(s\) \['enable_magic'\]"):
        sglang.Engine(model_path=str(llama_dir), enable_magic=True)
    engine = sglang.Engine(model_path=str(llama_dir))
    with pytest.raises(TypeError, match=r"Engine\.update_weights_from_distributed .*'dtypes'"):
        engine.update_weights_from_distributed(names=[], dtype=[], shapes=[])
    with pytest.raises(TypeError, match=r"SamplingParams .* has no field\(s\) \['seed'\]"):
        engine.generate(input_ids=[[1]], sampling_params=[{"seed": 1}])


def test_calls_while_paused_abort_without_reaching_sglang(make_engine, llama_dir):
    engine = make_engine(llama_dir)
    contract.check_paused_calls(engine, lambda: _calls(engine, "generate"))


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + contract.WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def test_pause_aborts_the_running_requests(make_engine, llama_dir):
    """Called from another thread (as in a threaded Ray actor): the running request ends after one more
    token with what it generated, a prefix of the uninterrupted seeded response; queued ones come back empty."""
    engine = make_engine(llama_dir)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=5)
    expected = engine.generate(PROMPTS, params)
    hold_step, forwards, tokenizer_manager = 3, [], engine.engine.tokenizer_manager

    def hold_until_aborted(*_):  # the fake's scheduler decodes one request at a time
        forwards.append(1)
        if len(forwards) == hold_step:
            _wait_for(lambda: tokenizer_manager.aborts, "no abort reached the scheduler")

    hook = engine.engine.model.model.register_forward_hook(hold_until_aborted)
    with ThreadPoolExecutor(max_workers=1) as pool:
        running = pool.submit(engine.generate, PROMPTS, params)
        _wait_for(lambda: len(forwards) >= hold_step, "generate did not start")
        engine.pause_generation()
        interrupted = running.result(contract.WAIT_S)
    hook.remove()
    first, *queued = interrupted
    assert first.finish_reason == "abort" and first.weight_version == 0
    assert first.response_token_ids == expected[0].response_token_ids[:hold_step]
    torch.testing.assert_close(first.logprobs, expected[0].logprobs[:hold_step], rtol=0, atol=0)
    assert [(g.prompt_index, g.response_token_ids, g.finish_reason) for g in queued] == \
           [(i, [], "abort") for i in range(1, len(PROMPTS))]
    engine.resume_generation()
    contract.assert_same_generations(engine.generate(PROMPTS, params), expected)


def test_the_abort_repeats_for_a_call_that_passed_the_pause_check(make_engine, llama_dir):
    """A call that passed the pause check just before the pause may send its requests after the first
    abort: the abort repeats while paused and catches them."""
    engine = make_engine(llama_dir)
    tokenizer_manager = engine.engine.tokenizer_manager
    hook = engine.engine.model.model.register_forward_hook(
        lambda *_: _wait_for(lambda: tokenizer_manager.aborts >= 2, "the abort was not repeated"))
    engine.pause_generation()  # no call runs: the abort waits for the engine's loop to run
    responses = engine._engine_generate(PROMPTS, [SamplingParams(max_new_tokens=40)] * len(PROMPTS),
                                        [None] * len(PROMPTS))  # the engine call of a generate past the check
    hook.remove()
    assert [(len(r.tokens), r.aborted) for r in responses] == [(1, True)] + [(0, True)] * 3


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    return contract.save_deepseek_dense_first_layer(tmp_path_factory.mktemp("deepseek-v3-dense-first-layer"))


@pytest.mark.parametrize("which", ["qwen3_moe_dirs", "deepseek_dir"])
def test_routing_is_recorded_in_our_convention(make_engine, which, request):
    """record_routing=True starts SGLang with enable_return_routed_experts and asks every request with
    return_routed_experts; the base64 int32 [P + R - 1, layers, k] rows come back as [P + R, M, k] int16 in
    the MoE layers (DeepSeek's dense first layer dropped)."""
    path = request.getfixturevalue(which)
    path = path[0] if isinstance(path, tuple) else path
    engine = make_engine(path, record_routing=True)
    assert _calls(engine, "__init__")[0][1]["enable_return_routed_experts"] is True
    contract.check_routing(engine, path)
    assert {call[5] for call in _calls(engine, "generate")} == {True}


def test_routing_of_a_response_cut_after_its_stop_token(make_engine, qwen3_moe_dirs, tmp_path):
    """A stop id that is not every EOS runs with ignore_eos to max_new_tokens; the adapter cuts the response
    after its stop token and the routing with it."""
    reference = contract.hf_engine(qwen3_moe_dirs[0])
    stop, k = contract.stop_case(reference)
    path = contract.with_eos(qwen3_moe_dirs[0], eos=(stop + 1) % 100, directory=tmp_path / "eos")
    engine = make_engine(path, record_routing=True)
    (generation,) = engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=8,
                                                                stop_token_ids=[stop]))
    assert _calls(engine, "generate")[0][2][0]["ignore_eos"] is True
    assert generation.finish_reason == "stop" and len(generation.response_token_ids) == k + 1
    tokens = PROMPTS[0] + generation.response_token_ids
    assert generation.routing.shape[0] == len(tokens)
    expected = contract.teacher_forced_routing(contract.load_reference(path), tokens)
    assert torch.equal(generation.routing[:-1], expected[:-1]) and torch.equal(generation.routing[-1],
                                                                                generation.routing[-2])


def test_routing_conversion(make_engine, deepseek_dir, monkeypatch):
    """A hand-built engine answer: int32 rows per decoder layer (layer 0 dense), base64 in meta_info."""
    engine = make_engine(deepseek_dir, record_routing=True)
    rows = np.arange(4 * 3 * 2, dtype=np.int32).reshape(4, 3, 2)  # P + R - 1 = 4 rows, 3 layers, top-2
    monkeypatch.setattr(engine.engine.model, "routed_experts", lambda tokens: rows[:len(tokens)])
    (generation,) = engine.generate([[5, 17]], SamplingParams(temperature=0, max_new_tokens=3))
    expected = torch.tensor([[[2, 3], [4, 5]], [[8, 9], [10, 11]], [[14, 15], [16, 17]], [[20, 21], [22, 23]],
                             [[20, 21], [22, 23]]], dtype=torch.int16)
    assert torch.equal(generation.routing, expected)


def test_without_record_routing_there_is_no_routing(make_engine, qwen3_moe_dirs):
    engine = make_engine(qwen3_moe_dirs[0])
    assert {g.routing for g in engine.generate(PROMPTS[:2], contract.GREEDY)} == {None}
    assert {call[5] for call in _calls(engine, "generate")} == {False}


def test_dense_models_cannot_record_routing(make_engine, sglang, llama_dir, monkeypatch):
    monkeypatch.setattr(sglang, "Engine", lambda **kwargs: pytest.fail("the engine was built"))
    with pytest.raises(ValueError, match="this model has no MoE layers"):
        make_engine(llama_dir, record_routing=True)


def test_responses_aborted_while_queued_have_no_routing(make_engine, qwen3_moe_dirs):
    from rlmega.rollout.engine_common import EngineResponse

    engine = make_engine(qwen3_moe_dirs[0], record_routing=True)
    assert engine._routing(EngineResponse([], [], True, None), 3) is None
    with pytest.raises(RuntimeError, match="sglang returned no routed experts for a finished response"):
        engine._routing(EngineResponse([4], [-0.1], False, None), 4)


def test_the_fake_returns_routing_as_the_release_does(sglang, qwen3_moe_dirs):
    """Only with the server argument and the request's flag; base64 of int32 [seqlen - 1 - start, layers, k];
    a routed_experts_start_len past the prompt is rejected (Scheduler), which a non-streaming generate raises."""
    path = str(qwen3_moe_dirs[0])
    params = [{"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}]
    plain = sglang.Engine(model_path=path).generate(input_ids=[[1, 2, 3]], sampling_params=params,
                                                   return_routed_experts=True)
    assert "routed_experts" not in plain[0]["meta_info"]  # no capturer without enable_return_routed_experts
    engine = sglang.Engine(model_path=path, enable_return_routed_experts=True)
    (out,) = engine.generate(input_ids=[[1, 2, 3]], sampling_params=params, return_routed_experts=True,
                             routed_experts_start_len=1)
    rows = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
    assert rows.size == (3 + 3 - 1 - 1) * 2 * 2
    with pytest.raises(ValueError, match=r"routed_experts_start_len=4 is higher than the number of input tokens "
                                         r"len\(req.origin_input_ids\)=3"):  # rejected (status 400): raised
        engine.generate(input_ids=[[1, 2, 3]], sampling_params=params, return_routed_experts=True,
                        routed_experts_start_len=4)


def test_version_gate(sglang, monkeypatch, llama_dir):
    from rlmega.rollout.sglang_engine import SGLangEngine

    monkeypatch.setattr(sglang, "__version__", "0.5.3")
    with pytest.raises(RuntimeError, match=r"sglang 0\.5\.3 is installed, but rlmega's sglang adapter supports "
                                           r"sglang>=0\.5\.23,<0\.5\.24"):
        SGLangEngine(llama_dir)


def test_the_gpu_fixture_arguments_are_accepted(sglang, llama_dir):
    """CPU twin of tests/gpu/test_sglang_engine.py's fixture: every server argument exists in 0.5.23 and
    deterministic inference gets an attention backend it supports (0.5.3 refused it without one)."""
    from gpu.test_sglang_engine import ENGINE_KWARGS

    from rlmega.rollout.sglang_engine import SGLangEngine

    assert ENGINE_KWARGS["attention_backend"] in sglang.API["constants"]["DETERMINISTIC_ATTENTION_BACKEND_CHOICES"]
    SGLangEngine(llama_dir, **ENGINE_KWARGS).shutdown()


@pytest.mark.parametrize("finish_reason, message", [
    ({"type": "abort", "message": "Abort in waiting queue"}, "Abort in waiting queue (not by a pause)"),
    ({"type": "abort", "message": "Out of memory even after retracting all other requests", "status_code": 500},
     "Out of memory even after retracting all other requests (status 500)"),
])
def test_an_abort_that_is_not_the_pauses_fails_the_request(make_engine, llama_dir, monkeypatch, finish_reason,
                                                            message):
    """Only the pause's aborts (no status code, a pause asked during the call) come back as "abort"; any other
    abort SGLang returns fails the call with SGLang's message, so that no caller resubmits it for ever."""
    engine = make_engine(llama_dir)
    answer = engine.engine.generate

    def aborting(*args, **kwargs):
        outputs = answer(*args, **kwargs)
        outputs[0] = {"text": "", "meta_info": {"id": "7", "finish_reason": finish_reason, "prompt_tokens": 0,
                                                "completion_tokens": 0}}
        return outputs

    monkeypatch.setattr(engine.engine, "generate", aborting)
    with pytest.raises(RuntimeError, match=re.escape(f"SGLang aborted request 7: {message}")):
        engine.generate(PROMPTS[:2], contract.GREEDY)
    engine._paused.set()  # a call made past the pause check: a waiting-queue abort is then the pause's
    reasons = [r.aborted for r in engine._engine_generate(PROMPTS[:2], [contract.GREEDY] * 2, [None] * 2)
               ] if "status_code" not in finish_reason else None
    assert reasons in (None, [True, False])
    if "status_code" in finish_reason:  # an error is one, paused or not
        with pytest.raises(RuntimeError, match="status 500"):
            engine._engine_generate(PROMPTS[:2], [contract.GREEDY] * 2, [None] * 2)
