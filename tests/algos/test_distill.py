"""On-policy distillation's estimators, advantage term and top-k term against values written out by hand."""

import math

import pytest
import torch

from rlmega.algos.distill import (
    DistillConfig,
    apply_distill_advantage,
    distill_token_kl,
    teacher_kl_metrics,
    top_k_distill_loss,
    top_k_reverse_kl,
)

LOGP = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, 0.0]])
TEACHER = torch.tensor([[-1.5, -1.0, -0.5], [-0.7, -2.0, float("nan")]])  # the masked slot holds nan padding
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ADVANTAGES = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, 9.0]])
# k3 at d = teacher - student = -0.5 and +1: exp(d) - d - 1.
K3_LOW, K3_HIGH = math.exp(-0.5) + 0.5 - 1, math.e - 2


def test_k1_and_k3_per_token():
    torch.testing.assert_close(distill_token_kl(LOGP, TEACHER, MASK, "k1"),
                               torch.tensor([[0.5, -1.0, 0.0], [0.5, -1.0, 0.0]]))
    torch.testing.assert_close(distill_token_kl(LOGP, TEACHER, MASK, "k3"),
                               torch.tensor([[K3_LOW, K3_HIGH, 0.0], [K3_LOW, K3_HIGH, 0.0]]))
    with pytest.raises(ValueError, match="sampled-token distillation estimator 'top_k' is not one of k1, k3"):
        distill_token_kl(LOGP, TEACHER, MASK, "top_k")


def test_advantage_term_mixes_with_the_reward_advantage():
    mixed = apply_distill_advantage(ADVANTAGES, LOGP, TEACHER, MASK, coef=0.1, estimator="k1")
    torch.testing.assert_close(mixed, torch.tensor([[0.95, 1.1, 1.0], [-0.55, -0.4, 0.0]]))
    pure = apply_distill_advantage(ADVANTAGES, LOGP, TEACHER, MASK, coef=0.1, estimator="k1", reward_weight=0.0)
    torch.testing.assert_close(pure, torch.tensor([[-0.05, 0.1, 0.0], [-0.05, 0.1, 0.0]]))
    halved = apply_distill_advantage(ADVANTAGES, LOGP, TEACHER, MASK, coef=0.1, estimator="k3", reward_weight=0.5)
    torch.testing.assert_close(halved, torch.tensor([[0.5 - 0.1 * K3_LOW, 0.5 - 0.1 * K3_HIGH, 0.5],
                                                     [-0.25 - 0.1 * K3_LOW, -0.25 - 0.1 * K3_HIGH, 0.0]]))


def test_teacher_metrics_average_over_valid_tokens():
    metrics = teacher_kl_metrics(LOGP, TEACHER, MASK)
    torch.testing.assert_close(metrics["teacher_kl"], torch.tensor((0.5 - 1.0 + 0.0 + 0.5 - 1.0) / 5))
    torch.testing.assert_close(metrics["teacher_kl_k3"], torch.tensor(2 * (K3_LOW + K3_HIGH) / 5))
    torch.testing.assert_close(metrics["teacher_logp"], torch.tensor((-1.5 - 1.0 - 0.5 - 0.7 - 2.0) / 5))


def test_top_k_reverse_kl_renormalises_both_over_the_k_tokens():
    # Student 0.6 / 0.2 on the two ids (0.75 / 0.25 within them), teacher 0.3 / 0.3 (0.5 / 0.5).
    student = torch.tensor([[math.log(0.6), math.log(0.2)], [math.log(0.1), math.log(0.3)]])
    teacher = torch.tensor([[math.log(0.3), math.log(0.3)], [math.log(0.2), math.log(0.6)]])
    expected = [0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5), 0.0]  # the second row agrees within K
    torch.testing.assert_close(top_k_reverse_kl(student, teacher), torch.tensor(expected))


def test_top_k_loss_is_coef_times_the_aggregated_term():
    student = torch.tensor([[[math.log(0.6), math.log(0.2)], [0.0, 0.0]],
                            [[math.log(0.5), math.log(0.5)], [float("nan"), 0.0]]], requires_grad=True)
    teacher = torch.log(torch.tensor([[[0.3, 0.3], [0.9, 0.1]], [[0.5, 0.5], [0.5, 0.5]]]))
    mask = torch.tensor([[1, 1], [1, 0]])
    first = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    second = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    loss, metrics = top_k_distill_loss(student, teacher, mask, coef=0.2)
    torch.testing.assert_close(loss, torch.tensor(0.2 * (first + second) / 3))
    torch.testing.assert_close(metrics["top_k_kl"], torch.tensor((first + second) / 3))
    seq_mean, _ = top_k_distill_loss(student, teacher, mask, coef=0.2, loss_agg_mode="seq-mean-token-mean")
    torch.testing.assert_close(seq_mean, torch.tensor(0.2 * ((first + second) / 2 + 0.0) / 2))
    loss.backward()
    assert torch.isfinite(student.grad).all() and student.grad[1, 1].eq(0).all()  # padding gets no gradient


@pytest.mark.parametrize("settings, teacher, problem", [
    (dict(coef=-0.1), (True, 0), ("coef", "must be >= 0 (0: off), got -0.1")),
    (dict(coef=1.0), (False, 0), ("coef", "1.0 distills from a teacher: set teacher.enable=true and teacher.path, "
                                          "or algorithm.distill.coef=0")),
    (dict(coef=1.0, estimator="top_k", top_k=8), (True, 4),
     ("top_k", "8 needs the teacher's 8 most likely tokens: set teacher.top_k >= 8 (it is 4)")),
    (dict(coef=1.0, estimator="top_k", top_k=0), (True, 4), ("top_k", "must be >= 1, got 0")),
    (dict(coef=1.0, reward_weight=-1.0), (True, 0), ("reward_weight", "must be >= 0 (0: pure distillation), got -1.0")),
    (dict(reward_weight=0.0), (False, 0), ("reward_weight", "applies only with algorithm.distill.coef > 0; set coef, "
                                                           "or leave reward_weight at 1")),
])
def test_settings_that_cannot_work_are_named(settings, teacher, problem):
    assert DistillConfig(**settings).problems(*teacher) == [problem]


def test_settings_that_work():
    assert DistillConfig().problems(False, 0) == []
    assert DistillConfig(coef=1.0, reward_weight=0.0).problems(True, 0) == []
    assert DistillConfig(coef=1.0, estimator="top_k", top_k=4).problems(True, 4) == []
