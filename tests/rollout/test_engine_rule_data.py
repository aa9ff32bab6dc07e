"""The engines' validation rules as data (fakes/api/rules.json, each cited from its wheel): every rule is read by a
fake, every refusal the fakes raise for a wheel comes from a rule, and the fakes behave as the rules say, so
changing a rule's data changes what a CPU test sees."""

import ast
import re
import sys
from pathlib import Path

import pytest
import torch

from .fakes import api_snapshot, fake_sglang, fake_vllm, one_thread
from .tiny_models import PROMPTS, checkpoint_tensors

FAKES = Path(__file__).parent / "fakes"
# api_snapshot.rule("vllm", "name"), .refusal("vllm", "name", ...), functools.partial(api_snapshot.refusal, "vllm", ...)
RULE_CALL = re.compile(r"""\b(?:rule|refusal)(?:\(|,)\s*"(vllm|sglang)",\s*"(\w+)\"""")
# The exception types the wheels raise for a refused setting or request.
REFUSALS = {"ValueError", "AssertionError", "VLLMValidationError"}


def _fake_sources() -> dict[str, str]:
    return {path.name: path.read_text() for path in FAKES.glob("*.py")}


def test_every_rule_is_read_by_a_fake_and_every_read_rule_exists():
    read = {match for source in _fake_sources().values() for match in RULE_CALL.findall(source)}
    listed = {(package, name) for package in ("vllm", "sglang") for name in api_snapshot._rules()[package]}
    assert listed - read == set(), "rules no fake reads"
    assert read - listed == set(), "rules the fakes read that rules.json lacks"


def _refusals_without_a_rule(source: str) -> list[str]:
    """Each ``raise ValueError/AssertionError/...(message)`` whose message is not ``api_snapshot.refusal(...)`` or a
    call of a name bound to ``functools.partial(api_snapshot.refusal, ...)``."""
    tree = ast.parse(source)
    readers = {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
               and isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "functools.partial"
               and node.value.args and ast.unparse(node.value.args[0]) == "api_snapshot.refusal"
               for target in node.targets if isinstance(target, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
            continue
        kind = node.exc.func
        if not (isinstance(kind, ast.Name) and kind.id in REFUSALS):
            continue
        message = node.exc.args[0] if node.exc.args else None
        reads = isinstance(message, ast.Call) and (ast.unparse(message.func) == "api_snapshot.refusal"
                                                   or ast.unparse(message.func) in readers)
        if not reads:
            found.append(f"line {node.lineno}: {ast.unparse(node)[:100]}")
    return found


@pytest.mark.parametrize("fake", ["fake_vllm.py", "fake_sglang.py", "fake_vllm_weight_transfer.py"])
def test_every_refusal_of_the_fakes_reads_its_rule(fake):
    """Where a fake refuses as the wheel does (ValueError, AssertionError, vLLM's VLLMValidationError), the message
    comes from rules.json, whose ``where`` cites the wheel; what a fake does not emulate raises NotImplementedError
    or TypeError instead, and the stand-ins for crashes RuntimeError."""
    source = _fake_sources()[fake]
    assert _refusals_without_a_rule(source) == []
    for package in ("vllm", "sglang"):  # nor is a rule's message spelled out by hand beside the rule
        for name, rule in api_snapshot._rules()[package].items():
            for message in [rule.get("message"), *rule.get("messages", {}).values()]:
                if message:
                    longest = max(re.split(r"\{[^}]*\}", message), key=len).strip()
                    assert longest not in source, f"{fake} spells out {package}.{name}'s message"


def test_the_ast_scan_finds_a_hand_written_refusal():
    assert _refusals_without_a_rule('raise ValueError("temperature must be in [0, 2]")')
    assert _refusals_without_a_rule('raise AssertionError(f"n must be {n}")')
    assert not _refusals_without_a_rule('raise ValueError(api_snapshot.refusal("vllm", "x"))')
    assert not _refusals_without_a_rule('check = functools.partial(api_snapshot.refusal, "vllm", "x")\n'
                                        'raise ValueError(check("case"))')
    assert not _refusals_without_a_rule('raise NotImplementedError("the fake does not emulate it")')


@pytest.fixture
def vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with one_thread():
        yield fake_vllm


def _with_rule(monkeypatch, package: str, name: str, **values):
    """rules.json with one rule's values changed, for the fakes that read it at call time."""
    rules = dict(api_snapshot._rules())
    rules[package] = dict(rules[package], **{name: dict(rules[package][name], **values)})
    monkeypatch.setattr(api_snapshot, "_rules", lambda: rules)


def test_vllm_temperature_limits_come_from_the_rules(vllm, monkeypatch):
    with pytest.raises(fake_vllm.VLLMValidationError, match=r"temperature must be in \[0, 2\], got 2.5"):
        fake_vllm.SamplingParams(temperature=2.5)
    assert not isinstance(fake_vllm.VLLMValidationError("x"), ValueError)  # as vllm/exceptions.py declares it
    assert fake_vllm.SamplingParams(temperature=0.005).temperature == 0.01
    _with_rule(monkeypatch, "vllm", "temperature_above_max", max=3.0)
    assert fake_vllm.SamplingParams(temperature=2.5).temperature == 2.5


def test_sharded_rdt_and_multimodal_construction_refusals_come_from_the_rules(vllm, monkeypatch, llama_dir):
    transfer = {"weight_transfer_config": {"backend": "sharded_rdt"}}
    with pytest.raises(ValueError, match="requires distributed_executor_backend='ray', got 'mp'"):
        fake_vllm.LLM(str(llama_dir), tensor_parallel_size=2, **transfer)
    _with_rule(monkeypatch, "vllm", "sharded_rdt_needs_ray_executor", executor="mp")
    fake_vllm.LLM(str(llama_dir), tensor_parallel_size=2, **transfer)


def test_a_fused_layer_sent_in_part_is_rebuilt_from_uninitialised_memory(vllm, llama_dir, llama_other_dir):
    """What rlmega's commit check (VLLMEngine._check_whole_layers) guards against, shown on the fake alone."""
    llm = fake_vllm.LLM(str(llama_dir), skip_tokenizer_init=True, weight_transfer_config={"backend": "nccl"})
    new = checkpoint_tensors(llama_other_dir)
    attention = "model.layers.0.self_attn."
    llm.start_weight_update()
    llm.model.load_weights([(attention + "q_proj.weight", new[attention + "q_proj.weight"]),
                            (attention + "o_proj.weight", new[attention + "o_proj.weight"])])
    llm.finish_weight_update()
    weights = llm.model.model.model.layers[0].self_attn
    assert torch.equal(weights.q_proj.weight, new[attention + "q_proj.weight"])
    assert torch.equal(weights.o_proj.weight, new[attention + "o_proj.weight"])  # a whole layer of its own
    assert weights.k_proj.weight.isnan().all() and weights.v_proj.weight.isnan().all()
    assert not weights.o_proj.weight.isnan().any()
    assert not llm.model.model.model.layers[0].mlp.gate_proj.weight.isnan().any()  # not sent: kept


@pytest.mark.parametrize("stop_first, reason", [(True, "stop"), (False, "length")])
def test_stop_tokens_before_the_length_limit_come_from_the_rules(vllm, llama_dir, monkeypatch, stop_first, reason):
    monkeypatch.setattr(fake_vllm, "STOP_FIRST", stop_first)
    monkeypatch.setattr(fake_sglang, "STOP_FIRST", stop_first)
    assert api_snapshot.rule("vllm", "stop_tokens_before_length")["stop_first"] is True
    assert api_snapshot.rule("sglang", "stop_tokens_before_length")["stop_first"] is True
    llm = fake_vllm.LLM(str(llama_dir), skip_tokenizer_init=True)
    request = [{"prompt_token_ids": PROMPTS[0]}]
    (free,) = llm.generate(request, fake_vllm.SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    (first,) = free.outputs[0].token_ids  # a stop token drawn as the last allowed one
    params = fake_vllm.SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, stop_token_ids=[first])
    llm.reset_prefix_cache()
    assert llm.generate(request, params)[0].outputs[0].finish_reason == reason
    engine = fake_sglang.Engine(model_path=str(llama_dir))
    (out,) = engine.generate(input_ids=[PROMPTS[0]], sampling_params=[
        {"max_new_tokens": 1, "temperature": 0, "stop_token_ids": [first]}])
    assert out["meta_info"]["finish_reason"]["type"] == reason


def test_sglang_rejections_raise_with_the_rules_message(qwen3_moe_dirs):
    engine = fake_sglang.Engine(model_path=str(qwen3_moe_dirs[0]), enable_return_routed_experts=True)
    params = [{"max_new_tokens": 2, "temperature": 0}]
    with pytest.raises(ValueError, match=r"routed_experts_start_len=-1 is lower than 0"):
        engine.generate(input_ids=[[1, 2, 3]], sampling_params=params, return_routed_experts=True,
                        routed_experts_start_len=-1)
