"""On-policy distillation in the RL loop, driven with a fake teacher: the advantages the actor receives are the
RL advantages minus ``coef * KL`` (alone with reward weight 0), the top-k estimator hands the teacher's top-k
to the actor's loss, the metrics are logged every step, and settings that cannot work are refused in one line."""

import json
import math

import pytest
import torch

from rlmega.config import load_config
from rlmega.config.load import ConfigError
from rlmega.trainer.controller import Trainer
from rlmega.trainer.prompt_side import build_prompt_side

from .fakes import ROLLOUT_LOGP, FakeActor, FakeEngines, FakeJob, FakeReference

N, PROMPTS, STEPS, K = 3, 2, 2, 4
ACTOR_SHIFT, TEACHER_SHIFT = 0.25, -0.5
KL = ACTOR_SHIFT - TEACHER_SHIFT
"""k1 at every token: the fake actor's old log-probs minus the fake teacher's."""
COEF = 0.4


class FakeTeacher:
    """Log-probs ``ROLLOUT_LOGP + TEACHER_SHIFT`` at every token; top-k ids ``0..k-1`` with log-probs ``-1 - j``."""

    def __init__(self):
        self.calls, self.shut_down = [], False

    def compute_logprobs(self, batch, data_sources):
        self.calls.append(("logprobs", len(batch), list(data_sources)))
        return [torch.full((n,), ROLLOUT_LOGP + TEACHER_SHIFT) for n in batch.response_lengths], None

    def compute_top_k(self, batch, k, data_sources):
        self.calls.append(("top_k", k, list(data_sources)))
        return ([torch.arange(k).repeat(n, 1) for n in batch.response_lengths],
                [-1.0 - torch.arange(k, dtype=torch.float32).repeat(n, 1) for n in batch.response_lengths])

    def shutdown(self) -> None:
        self.shut_down = True


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(num_train=32, num_val=8)


def _overrides(tmp_path, *extra):
    return [f"run_dir={tmp_path}", f"trainer.total_steps={STEPS}", f"trainer.prompts_per_step={PROMPTS}",
            f"rollout.n={N}", "trainer.val_every=0", "trainer.save_every=0", "export_hf=false",
            "reward.num_workers=1", "metrics.backends=[jsonl]", "metrics.plot=false", "actor.ppo_mini_batches=1",
            *extra]


def _run(tmp_path, assets, *overrides, teacher=True):
    """A finished run with fake parts: its actor, teacher (None without) and metrics rows."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "assets").symlink_to(assets)
    distill = [f"teacher.path={tmp_path}/assets/model", "teacher.enable=true", f"teacher.top_k={K}"] if teacher else []
    config = load_config("tiny_cpu", _overrides(tmp_path, *distill, *overrides))
    prompts = build_prompt_side(config)
    actor, teachers = FakeActor(ACTOR_SHIFT), FakeTeacher() if teacher else None
    trainer = Trainer(config, prompts, FakeJob(), actor,
                      FakeEngines(prompts.data.tokenizer, prompts.generator.stop_token_ids[0]), teachers=teachers,
                      reference=FakeReference() if config.needs_reference else None)
    assert trainer.fit() == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return actor, teachers, rows


@pytest.mark.parametrize("estimator", ["grpo", "reinforce_plus_plus"])
def test_the_actor_trains_on_the_rl_advantages_minus_coef_times_the_teacher_kl(tmp_path, assets, estimator):
    rl, _, _ = _run(tmp_path / "rl", assets, f"algorithm.adv_estimator={estimator}", teacher=False)
    actor, teacher, rows = _run(tmp_path / "distill", assets, f"algorithm.adv_estimator={estimator}",
                                f"algorithm.distill.coef={COEF}")
    assert rl.logprob_batches == [] and len(rl.updates) == STEPS  # one optimizer step per batch: fused
    assert len(actor.logprob_batches) == STEPS  # the teacher's KL needs them before the update: a pass of their own
    for plain, distilled in zip(rl.updates, actor.updates):
        assert [t.tolist() for t in plain.tokens] == [t.tolist() for t in distilled.tokens]
        for rl_advantage, advantage in zip(plain.fields["advantages"], distilled.fields["advantages"]):
            torch.testing.assert_close(advantage, rl_advantage - COEF * KL, rtol=0, atol=1e-6)
        assert distilled.distill is None and "teacher_topk_ids" not in distilled.fields
    data_sources = {source for _, _, sources in teacher.calls for source in sources}
    assert [call[:2] for call in teacher.calls] == [("logprobs", PROMPTS * N)] * STEPS and len(data_sources) == 1
    assert teacher.shut_down  # with the run
    for row in rows:
        assert row["distill/teacher_kl"] == pytest.approx(KL)
        assert row["distill/teacher_kl_k3"] == pytest.approx(math.exp(-KL) + KL - 1)
        assert row["distill/teacher_logp"] == pytest.approx(ROLLOUT_LOGP + TEACHER_SHIFT)
        assert "timing_s/teacher" in row


@pytest.mark.parametrize("bypass", [False, True], ids=["trainer-logprobs", "bypass-mode"])
def test_pure_distillation_trains_on_the_distillation_term_alone(tmp_path, assets, bypass):
    actor, _, _ = _run(tmp_path, assets, f"algorithm.distill.coef={COEF}", "algorithm.distill.reward_weight=0",
                       "algorithm.distill.estimator=k3", f"algorithm.rollout_correction.bypass_mode={bypass}")
    kl = -TEACHER_SHIFT if bypass else KL  # bypass mode: the student's log-probs are the engine's
    k3 = math.exp(-kl) + kl - 1
    for update in actor.updates:
        for advantage in update.fields["advantages"]:
            torch.testing.assert_close(advantage, torch.full_like(advantage, -COEF * k3), rtol=0, atol=1e-6)


def test_top_k_hands_the_teachers_top_k_to_the_actors_loss(tmp_path, assets):
    rl, _, _ = _run(tmp_path / "rl", assets, teacher=False)
    actor, teacher, rows = _run(tmp_path / "distill", assets, f"algorithm.distill.coef={COEF}",
                                "algorithm.distill.estimator=top_k", f"algorithm.distill.top_k={K - 1}",
                                "algorithm.distill.reward_weight=0.5")
    assert [call[:2] for call in teacher.calls] == [("logprobs", PROMPTS * N), ("top_k", K - 1)] * STEPS
    for plain, update in zip(rl.updates, actor.updates):
        assert update.distill.coef == COEF and update.distill.estimator == "top_k"
        for ids, logp, n in zip(update.fields["teacher_topk_ids"], update.fields["teacher_topk_logp"],
                                update.response_lengths):
            assert ids.shape == logp.shape == (n, K - 1) and ids[0].tolist() == [0, 1, 2]
        for rl_advantage, advantage in zip(plain.fields["advantages"], update.fields["advantages"]):
            torch.testing.assert_close(advantage, 0.5 * rl_advantage, rtol=0, atol=1e-6)  # the KL is in the loss
    assert all(row["distill/teacher_kl"] == pytest.approx(KL) for row in rows)


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.distill.coef=0.5"], "algorithm.distill.coef: 0.5 distills from a teacher: set teacher.enable=true "
                                     "and teacher.path, or algorithm.distill.coef=0"),
    (["algorithm.distill.coef=0.5", "teacher.enable=true", "teacher.path=/teacher", "teacher.top_k=8",
      "algorithm.distill.estimator=top_k", "algorithm.distill.top_k=16"],
     "algorithm.distill.top_k: 16 needs the teacher's 16 most likely tokens: set teacher.top_k >= 16 (it is 8)"),
    (["algorithm.distill.estimator=k2"], "algorithm.distill.estimator: 'k2' is not one of k1, k3, top_k"),
    (["algorithm.distill.coef=-1"], "algorithm.distill.coef: must be >= 0 (0: off), got -1.0"),
])
def test_settings_that_cannot_work_are_refused_in_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config("tiny_cpu", _overrides(tmp_path, *overrides))
    assert str(error.value) == message
