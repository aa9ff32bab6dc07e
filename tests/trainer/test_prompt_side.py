"""The prompt side in parts: only its builder reads the run's config, each part gets its own slice of it, and a
part that fails to build leaves the parts built before it closed."""

import inspect

import pytest

from rlmega.config import load_config
from rlmega.trainer import (async_rollouts, batch_assembly, generation, prompt_data, prompt_side, reward_manager,
                            schedules, scoring, step_rollouts, validation, warm_start)
from rlmega.trainer.generation import ResponseGenerator
from rlmega.trainer.prompt_side import build_prompt_side
from rlmega.trainer.scoring import ScorerConfig

PARTS = (prompt_data, generation, scoring, batch_assembly, step_rollouts, validation, warm_start, schedules,
         async_rollouts, reward_manager, prompt_side)


def _functions(module):
    """Every function and method defined in ``module``."""
    for value in vars(module).values():
        if getattr(value, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(value):
            yield value
        elif inspect.isclass(value):
            for member in vars(value).values():
                member = getattr(member, "__func__", member)  # classmethods and staticmethods
                if inspect.isfunction(member):
                    yield member


@pytest.mark.parametrize("module", PARTS, ids=lambda module: module.__name__.rsplit(".", 1)[1])
def test_only_the_builder_takes_the_whole_run_config(module):
    takers = [function.__qualname__ for function in _functions(module)
              if "RLConfig" in str(function.__annotations__)]
    assert takers == (["build_prompt_side"] if module is prompt_side else []), takers


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(num_train=16, num_val=4, max_operand=99)


def _config(tmp_path, assets, name, *overrides):
    (tmp_path / "assets").symlink_to(assets)
    return load_config(name, [f"run_dir={tmp_path}", "trainer.prompts_per_step=2", "reward.num_workers=1", *overrides])


def test_each_part_gets_the_fields_it_reads(tmp_path, assets):
    config = _config(tmp_path, assets, "tiny_cpu_tools", "trainer.val_every=0", "rollout.top_p=0.9", "rollout.n=3",
                     "algo=dapo", "agent.max_response_tokens=40", "rollout.max_new_tokens=12")
    prompts = build_prompt_side(config)
    try:
        assert prompts.data.config.val_data is None and prompts.data.val_dataset is None  # no validation: not read
        assert prompts.data.sampler.batch_size == 2 and prompts.data.total_steps == config.trainer.total_steps
        assert prompts.generator.agent is not None and prompts.generator.config.top_p == 0.9
        assert prompts.scorer.config.max_response_length == 40  # the agent's budget, not one request's
        assert prompts.scorer.config.agent_scored_text == config.agent.scored_text
        assert prompts.assembler.config.multi_turn and not prompts.assembler.config.greedy_baseline
        assert prompts.step_rollouts.config.dynamic_sampling
        assert prompts.warm_start.config.sequences_per_step == 6
        assert prompts.warm_start.config.demonstration == config.agent.demonstration
        assert prompts.schedule.mode == config.rollout.mode and prompts.schedule.n == 3
    finally:
        prompts.close()


def test_a_scorer_that_fails_to_build_closes_the_generator(tmp_path, assets, monkeypatch):
    closed = []
    close = ResponseGenerator.close

    def recorded(self):
        closed.append(self)
        close(self)

    def fails(self, *args, **kwargs):
        raise ValueError("no rule scorer for data_source 'my_task'")

    monkeypatch.setattr(ResponseGenerator, "close", recorded)
    monkeypatch.setattr(ScorerConfig, "build", fails)
    with pytest.raises(ValueError, match="my_task"):
        build_prompt_side(_config(tmp_path, assets, "tiny_cpu_tools"))
    assert len(closed) == 1 and closed[0].agent is not None  # the agent loop's tool workers ended


@pytest.mark.parametrize("overrides, top_p, top_k, n", [
    ((), 0.9, 7, 1),  # unset: validation samples as training does
    (("rollout.val_top_p=0.5", "rollout.val_n=3"), 0.5, 7, 3),
    (("rollout.val_top_k=0", "rollout.val_top_p=1.0"), 1.0, None, 1),  # 0: no top-k at all
])
def test_validation_samples_with_its_own_parameters(tmp_path, assets, overrides, top_p, top_k, n):
    from .fakes import FakeEngines

    config = _config(tmp_path, assets, "tiny_cpu", "trainer.val_every=1", "trainer.val_prompts=4",
                     "rollout.val_temperature=0.8", "rollout.top_p=0.9", "rollout.top_k=7", *overrides)
    prompts = build_prompt_side(config)
    try:
        engines = FakeEngines(prompts.data.tokenizer, prompts.generator.stop_token_ids[0])  # right, wrong, right...
        metrics, _ = prompts.validation.run(engines)
    finally:
        prompts.close()
    params = engines.calls[-1]
    assert (params.temperature, params.top_p, params.top_k, params.n) == (0.8, top_p, top_k, n)
    assert metrics["val/accuracy"] == pytest.approx((n + 1) // 2 / n)
    assert ("val/pass@3" in metrics) == (n == 3) and metrics.get("val/pass@3", 1.0) == 1.0
