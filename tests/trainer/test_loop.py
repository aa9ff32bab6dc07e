"""The RL loop driven with fake role groups and a fake engine (no Ray, no processes): what each part
is called with, step by step, for GRPO, PPO and REINFORCE++; every advantage estimator of the
registry through config alone; the rollout correction's fields; the KL in the reward by hand."""

import json
import math

import pytest
import torch

from rlmega import algos
from rlmega.config import load_config
from rlmega.trainer.advantages import compute_advantages
from rlmega.trainer.controller import Trainer
from rlmega.trainer.prompt_side import build_prompt_side

from .fakes import REF_SHIFT, ROLLOUT_LOGP, FakeActor, FakeCritic, FakeEngines, FakeJob, FakeReference

N, PROMPTS, STEPS = 3, 2, 3


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(num_train=32, num_val=8)


def _trainer(tmp_path, assets, *overrides, shift=0.0):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "assets").symlink_to(assets)
    config = load_config("tiny_cpu", [
        f"run_dir={tmp_path}", f"trainer.total_steps={STEPS}", f"trainer.prompts_per_step={PROMPTS}",
        f"rollout.n={N}", "trainer.sft_steps=1", "trainer.val_every=0", "trainer.save_every=0", "export_hf=false",
        "rollout.val_temperature=0",
        "reward.num_workers=1", "metrics.backends=[jsonl]", "metrics.plot=false", "actor.ppo_mini_batches=1",
        *overrides])
    prompts = build_prompt_side(config)
    engines = FakeEngines(prompts.data.tokenizer, prompts.generator.stop_token_ids[0])
    parts = dict(job=FakeJob(), actor=FakeActor(shift), engines=engines,
                 reference=FakeReference() if config.needs_reference else None,
                 critic=FakeCritic() if config.needs_critic else None)
    return Trainer(config, prompts, **parts), parts


@pytest.mark.parametrize("setting, gpus, hands_over", [("auto", 0, False), ("auto", 1, True), ("always", 0, True),
                                                      ("never", 1, False)])
def test_colocated_parts_take_turns_with_memory_only_where_that_frees_some(tmp_path, assets, setting, gpus, hands_over):
    trainer, parts = _trainer(tmp_path, assets, f"rollout.colocated_offload={setting}")
    trainer.config.cluster.gpus_per_rank = gpus  # as a GPU cluster's config says (this machine has no GPU)
    assert trainer.fit() == 0
    turns = STEPS  # one rollout per step (no validation here)
    # Handing over: the training state leaves before each sync (the first included), everything while generating.
    released = "training state"
    assert parts["job"].offloads == ([released] + [True, False, released] * turns if hands_over else [])
    assert parts["engines"].sleeps == (turns if hands_over else 0)


def _scores(trainer, batch):
    """The rule score of every response of ``batch``, recomputed from its tokens."""
    truth = {tuple(r.prompt_token_ids): str(r.ground_truth) for r in trainer.prompts.data.dataset.batch(
        list(range(len(trainer.prompts.data.dataset))))}
    scores = []
    for tokens, prompt in zip(batch.tokens, batch.prompt_lengths):
        answer = trainer.prompts.data.tokenizer.decode(tokens[prompt:].tolist(), skip_special_tokens=True)
        scores.append(float(answer.strip() == truth[tuple(tokens[:prompt].tolist())]))
    return torch.tensor(scores)


def test_grpo_loop_calls_each_part_with_the_right_data(tmp_path, assets):
    trainer, parts = _trainer(tmp_path, assets, "algo=grpo", "rollout.temperature=0.7", "trainer.fuse_old_logprob=false",
                              "rollout.colocated_offload=always")
    assert trainer.fit() == 0
    actor, engines, job, reference = parts["actor"], parts["engines"], parts["job"], parts["reference"]
    assert len(actor.sft_batches) == 1 and actor.sft_batches[0][1] == trainer.config.trainer.sft_lr
    assert reference.copied == 1  # the reference is the warm-started actor
    assert actor.pushed == actor.checked == [0, 1, 2, 3]
    assert actor.connected == [[engines]]  # the weight sync is set up once, into the run's engines
    # Colocated: training offloaded while engines generate, its training state before each sync.
    assert job.offloads == ["training state"] + [True, False, "training state"] * STEPS
    assert [params.temperature for params in engines.calls] == [0.7] * STEPS
    assert len(actor.updates) == len(actor.logprob_batches) == STEPS and engines.shut_down and job.shut_down
    for scored, update in zip(actor.logprob_batches, actor.updates):
        assert scored.temperature == update.temperature == 0.7  # log-probs under the sampled distribution
        assert set(update.fields) == {"old_logp", "advantages", "ref_logp"}
        scores = _scores(trainer, update)
        assert 0 < scores.mean() < 1  # both right and wrong answers
        groups = torch.arange(len(update)) // N
        for advantage, score, group in zip(update.fields["advantages"], scores, groups):
            members = scores[groups == group]  # GRPO by hand: (s - mean) / (std + 1e-6) within the group
            want = (score - members.mean()) / (members.std() + 1e-6)
            torch.testing.assert_close(advantage, torch.full_like(advantage, float(want)), rtol=0, atol=1e-6)
        assert all(torch.equal(r, torch.full_like(r, ROLLOUT_LOGP + REF_SHIFT)) for r in update.fields["ref_logp"])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(row["mismatch/abs_log_prob_diff_max"] == 0.0 for row in rows)  # fake trainer == fake engine


def _token_rewards(update, scores, kl_per_token=0.0):
    """``[B, T]`` scores at each response's last token minus a constant per-token KL penalty, and the mask."""
    lengths = update.response_lengths
    mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    rewards = algos.place_scores_at_last_token(scores, mask) - kl_per_token * mask
    return rewards, mask


def test_one_step_batches_take_the_old_logprobs_from_the_update(tmp_path, assets):
    trainer, parts = _trainer(tmp_path, assets, "algo=grpo")  # one epoch, one mini-batch
    assert trainer.fit() == 0
    actor = parts["actor"]
    assert actor.logprob_batches == [] and len(actor.updates) == STEPS  # no separate old-log-prob pass
    assert all("old_logp" not in update.fields for update in actor.updates)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(row["mismatch/abs_log_prob_diff_max"] == 0.0 and "timing_s/old_log_prob" not in row for row in rows)
    filtered, parts = _trainer(tmp_path / "filtered", assets, "algo=grpo", "algorithm.filter_truncated=true")
    filtered.fit()
    assert parts["actor"].logprob_batches == []  # still fused, and the overlong filter's mask still reaches the loss
    assert all("response_mask" in update.fields for update in parts["actor"].updates)
    for index, needs_the_pass in enumerate(("actor.ppo_mini_batches=2", "algorithm.rollout_correction.rollout_is=token",
                                            "algorithm.kl_in_reward_coef=0.1")):
        separate, parts = _trainer(tmp_path / f"separate{index}", assets, "algo=grpo", needs_the_pass)
        separate.fit()
        assert len(parts["actor"].logprob_batches) == STEPS, needs_the_pass


def test_post_sync_check_at_its_cadence_and_always_first(tmp_path, assets):
    trainer, parts = _trainer(tmp_path, assets, "algo=grpo", "sync.check_every=2", "sync.post_sync_atol=0.2")
    trainer.fit()
    assert parts["actor"].checked == [0, 2]  # the first sync, then every second
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert ["sync/max_logprob_diff" in row for row in rows] == [False, True, False]


def test_ppo_loop_trains_the_critic_on_gae_returns(tmp_path, assets):
    trainer, parts = _trainer(tmp_path, assets, "algo=ppo")
    assert trainer.fit() == 0
    critic, actor = parts["critic"], parts["actor"]
    algorithm = trainer.config.algorithm
    assert len(critic.updates) == len(actor.updates) == STEPS
    for update, actor_update in zip(critic.updates, actor.updates):
        assert set(update.fields) == {"values", "returns"}
        scores = _scores(trainer, update)
        assert 0 < scores.mean() < 1  # both right and wrong answers
        rewards, mask = _token_rewards(update, scores)
        values = mask * 0.5  # the fake critic's values
        advantages, returns = algos.compute_gae_advantages(rewards, values, mask, gamma=algorithm.gamma,
                                                           lam=algorithm.lam)
        for row, (got, got_advantage) in enumerate(zip(update.fields["returns"], actor_update.fields["advantages"])):
            torch.testing.assert_close(got, returns[row, :got.numel()], rtol=0, atol=1e-6)
            torch.testing.assert_close(got_advantage, advantages[row, :got.numel()], rtol=0, atol=1e-5)
        # by hand for the last token: A = s - V there, so returns = s
        assert all(float(r[-1]) == float(s) for r, s in zip(update.fields["returns"], scores))


def test_reinforce_plus_plus_loop_puts_the_kl_in_the_reward(tmp_path, assets):
    trainer, parts = _trainer(tmp_path, assets, "algo=reinforce_plus_plus")
    assert trainer.fit() == 0
    coef = trainer.config.algorithm.kl_in_reward_coef
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isclose(row["critic/kl_token_mean"], -REF_SHIFT, rel_tol=1e-6) for row in rows)
    for update in parts["actor"].updates:
        assert "ref_logp" not in update.fields  # no KL loss: the reference is only for the reward
        rewards, mask = _token_rewards(update, _scores(trainer, update), kl_per_token=-REF_SHIFT * coef)
        expected, _ = algos.compute_reinforce_plus_plus_advantages(rewards, mask)
        for row, got in enumerate(update.fields["advantages"]):
            torch.testing.assert_close(got, expected[row, :got.numel()], rtol=0, atol=1e-5)


@pytest.mark.parametrize("estimator", sorted(algos.ADVANTAGE_ESTIMATORS))
def test_every_advantage_estimator_runs_through_config(tmp_path, assets, estimator):
    trainer, parts = _trainer(tmp_path, assets, "algo=grpo", f"algorithm.adv_estimator={estimator}")
    assert trainer.fit() == 0
    assert len(parts["actor"].updates) == STEPS
    assert (parts["critic"] is not None) == (estimator == "gae")
    greedy = [params for params in parts["engines"].calls if params.temperature == 0]
    assert len(greedy) == (STEPS if estimator == "remax" else 0)  # ReMax's baseline response
    for update in parts["actor"].updates:
        assert all(torch.isfinite(a).all() for a in update.fields["advantages"])


def test_rollout_correction_weights_and_masks_the_batch(tmp_path, assets):
    shift = 0.1  # the trainer finds every token e^0.1 times as likely as the engine did
    trainer, parts = _trainer(tmp_path, assets, "algo=grpo", "algorithm.rollout_correction.rollout_is=token",
                              shift=shift)
    trainer.fit()
    for update in parts["actor"].updates:
        assert all(torch.allclose(w, torch.full_like(w, math.exp(shift))) for w in update.fields["rollout_is_weights"])
        assert all(torch.equal(m, torch.ones_like(m)) for m in update.fields["response_mask"])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isclose(row["mismatch/abs_log_prob_diff_mean"], shift, rel_tol=1e-5) for row in rows)

    masked, parts = _trainer(tmp_path / "masked", assets, "algo=grpo", "algorithm.rollout_correction.rollout_rs=token",
                             "algorithm.rollout_correction.rollout_rs_threshold=1.05", shift=shift)
    masked.fit()
    for update in parts["actor"].updates:  # e^0.1 = 1.105 leaves the band [1/1.05, 1.05]: every token rejected
        assert all(not m.any() for m in update.fields["response_mask"])


def test_bypass_mode_trains_on_the_engine_log_probs(tmp_path, assets):
    trainer, parts = _trainer(tmp_path, assets, "algo=grpo", "algorithm.rollout_correction.bypass_mode=true")
    trainer.fit()
    assert parts["actor"].logprob_batches == []  # no separate old-log-prob pass
    for update in parts["actor"].updates:
        assert all(torch.equal(o, torch.full_like(o, ROLLOUT_LOGP)) for o in update.fields["old_logp"])


def test_bypass_mode_hands_the_correction_to_the_loss(tmp_path, assets):
    trainer, parts = _trainer(tmp_path, assets, "algo=grpo", "algorithm.rollout_correction.bypass_mode=true",
                              "algorithm.rollout_correction.rollout_is=token",
                              "algorithm.rollout_correction.rollout_rs=token_k1",
                              "algorithm.rollout_correction.rollout_rs_threshold=1.05")
    trainer.fit()
    for update in parts["actor"].updates:  # nothing corrected up front: the loss compares the current policy
        assert update.rollout_correction == trainer.config.algorithm.rollout_correction
        assert "rollout_is_weights" not in update.fields and "response_mask" not in update.fields


def test_rejection_reaches_the_advantages_unless_told_otherwise(tmp_path, assets):
    rejecting = ("algo=reinforce_plus_plus", "algorithm.rollout_correction.rollout_rs=token",
                 "algorithm.rollout_correction.rollout_rs_threshold=1.05")  # e^0.1 leaves the band: every token
    trainer, parts = _trainer(tmp_path, assets, *rejecting, shift=0.1)
    trainer.fit()
    for update in parts["actor"].updates:  # verl's order: no token is left to give an advantage
        assert all(not a.any() for a in update.fields["advantages"])
    trainer, parts = _trainer(tmp_path / "loss_only", assets, *rejecting,
                              "algorithm.rollout_correction.reject_before_advantages=false", shift=0.1)
    trainer.fit()
    for update in parts["actor"].updates:  # the advantages of the mask before rejection (the KL varies them)
        assert any(a.any() for a in update.fields["advantages"])
        assert all(not m.any() for m in update.fields["response_mask"])


def test_kl_in_reward_reaches_grpo_and_rloo_by_hand():
    scores = torch.tensor([1.0, 0.0, 1.0])
    old = [torch.tensor([-0.1, -0.2]), torch.tensor([-0.3]), torch.tensor([-0.5, -0.5])]
    ref = [torch.tensor([-0.3, -0.2]), torch.tensor([-0.1]), torch.tensor([-0.5, -0.1])]
    from rlmega.config.schema import AlgorithmConfig

    # k1 KL per token: old - ref = [0.2, 0], [-0.2], [0, -0.4]; returns with coef 0.1: the score minus 0.1 * sum.
    rewards = [1.0 - 0.1 * 0.2, 0.0 + 0.1 * 0.2, 1.0 + 0.1 * 0.4]  # 0.98, 0.02, 1.04
    for estimator in ("grpo", "rloo"):
        config = AlgorithmConfig(adv_estimator=estimator, kl_in_reward_coef=0.1)
        advantages, _, metrics = compute_advantages(config, scores, [2, 1, 2], [0, 0, 0], kl_estimator="k1",
                                                    old_logp=old, ref_logp=ref)
        mean = sum(rewards) / 3
        if estimator == "grpo":
            std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 2)
            expected = [(r - mean) / (std + 1e-6) for r in rewards]
        else:
            expected = [r - (sum(rewards) - r) / 2 for r in rewards]
        for advantage, want, length in zip(advantages, expected, [2, 1, 2]):
            torch.testing.assert_close(advantage, torch.full((length,), want), rtol=0, atol=1e-6)
        assert math.isclose(metrics["critic/rewards/mean"], mean, rel_tol=1e-6)


def test_run_hygiene_epochs_validation_samples_and_critic_warmup(tmp_path, assets):
    trainer, parts = _trainer(tmp_path, assets, "algo=ppo", "trainer.total_epochs=2", "trainer.val_every=4",
                              "trainer.val_before_train=false", "trainer.log_val_generations=2", "trainer.val_prompts=3",
                              "trainer.critic_warmup=2", "trainer.max_checkpoints_to_keep=3", "trainer.save_every=4")
    steps_per_epoch = len(trainer.prompts.data.dataset) // PROMPTS
    assert trainer.total_steps == 2 * steps_per_epoch == 32  # total_epochs decides, not total_steps
    assert trainer.fit() == 0
    assert len(parts["critic"].updates) == 32 and len(parts["actor"].updates) == 30  # two critic-only steps
    assert [extra["step"] for _, extra, _ in parts["job"].saved] == list(range(4, 33, 4))
    assert all(keep == 3 for _, _, keep in parts["job"].saved)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "val/accuracy" in row] == list(range(4, 33, 4))  # none before training
    samples = [json.loads(line) for line in (tmp_path / "generations.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 8 and samples[0]["step"] == 4
    assert samples[0]["score"] == 1.0 and samples[0]["response"] == samples[0]["ground_truth"]  # greedy is right
