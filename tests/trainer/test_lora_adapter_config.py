"""``sync.lora``: adapters only where vLLM or SGLang applies them, each refusal one line naming what to set instead, and
the engines built for the actor's adapters."""

import pytest

from rlmega.config import load_config
from rlmega.errors import UserError
from tests.trainer.test_config_errors import _cli, run_dir  # noqa: F401 (the fixture)

ADAPTERS = ["actor.lora.rank=4", "sync.lora=adapters"]


@pytest.mark.parametrize("overrides, message", [
    (ADAPTERS, "sync.lora: adapters needs vLLM's or SGLang's LoRA kernels, but rollout.backend is hf: set "
               "sync.lora=merged (the hf engine takes the merged weights), or rollout.backend=vllm or sglang"),
    (["sync.lora=adapters", "rollout.backend=vllm"], "sync.lora: adapters sends a LoRA actor's adapters, but "
                                                     "actor.lora.rank is 0: set actor.lora.rank > 0, or sync.lora=merged"),
    ([*ADAPTERS, "rollout.backend=vllm", "rollout.weight_dtype=fp8"],
     "sync.lora: adapters keeps the base weights the engines loaded, but rollout.weight_dtype=fp8 quantizes the "
     "weights a sync sends: set sync.lora=merged, or rollout.weight_dtype=auto"),
    ([*ADAPTERS, "rollout.backend=vllm", "sync.transport=broadcast"],
     "sync.transport: broadcast moves base weights straight into the engines' layers, and sync.lora=adapters sends "
     "adapters: use one of auto, in_process, shared_memory, object_store"),
    (["sync.lora=partial"], "sync.lora: 'partial' is not one of merged, adapters"),
    ([*ADAPTERS, "rollout.backend=sglang", "actor.lora.target_modules=[linear_qkv,experts.linear_fc1]"],
     "sync.lora: adapters sends attention and dense-MLP adapters to the engines; their loading of per-expert adapters "
     "(experts.linear_fc1 in actor.lora.target_modules) is not checked yet: set sync.lora=merged, or adapt no experts"),
    ([*ADAPTERS, "rollout.backend=sglang", "rollout.weight_dtype=fp8"],
     "sync.lora: adapters keeps the base weights the engines loaded, but rollout.weight_dtype=fp8 quantizes the "
     "weights a sync sends: set sync.lora=merged, or rollout.weight_dtype=auto"),
])
def test_adapters_are_refused_where_nothing_applies_them(run_dir, overrides, message):  # noqa: F811
    with pytest.raises(UserError) as error:
        load_config("tiny_cpu", [f"run_dir={run_dir}", *overrides])
    assert str(error.value) == message


def test_the_command_line_refuses_in_one_line(run_dir):  # noqa: F811
    result = _cli(run_dir, "train", *ADAPTERS)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith("rlmega train: sync.lora: adapters needs vLLM's or SGLang's LoRA kernels") and \
        result.stderr.count("\n") == 1


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_engines_are_built_for_the_actor_adapters(run_dir, backend):  # noqa: F811
    from rlmega.rollout.sglang_engine import SGLangEngine
    from rlmega.rollout.vllm_engine import VLLMEngine
    from rlmega.trainer.rollout_group import _engine

    config = load_config("tiny_cpu", [f"run_dir={run_dir}", *ADAPTERS, f"rollout.backend={backend}"])
    engine_class, arguments = _engine(config)
    assert engine_class is {"vllm": VLLMEngine, "sglang": SGLangEngine}[backend] and arguments["lora_rank"] == 4
    merged = load_config("tiny_cpu", [f"run_dir={run_dir}", "actor.lora.rank=4", f"rollout.backend={backend}"])
    assert "lora_rank" not in _engine(merged)[1]  # merged weights: no LoRA kernels
