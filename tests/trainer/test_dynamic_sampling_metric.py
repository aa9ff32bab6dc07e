"""DAPO's dynamic sampling on any per-response number the reward returns: the groups kept are the ones verl's
``filter_groups`` keeps (its DAPO reward manager's ``acc``, ``score`` and ``seq_reward``), and a step of the
synchronous loop filters on the metric the config names."""

import random
from collections import defaultdict

import numpy as np
import pytest
import torch

from rlmega.algos import dynamic_sampling_filter
from rlmega.config import load_config
from rlmega.errors import UserError
from rlmega.rewards import as_score
from rlmega.rollout.protocol import Generation
from rlmega.trainer.prompt_side import build_prompt_side
from rlmega.trainer.scoring import ScoredResponses, dynamic_sampling_values

from .fakes import FakeEngines


def verl_kept(uids: list[int], results: list, penalties: list[float], metric: str) -> list[bool]:
    """verl's DAPO trainer (recipe/dapo/dapo_ray_trainer.py) and reward manager (workers/reward_manager/dapo.py):
    a dict result's keys become per-sample infos, a number's is ``acc``; ``seq_reward`` sums the token scores
    (score + overlong penalty); groups are kept whose metric has ``np.std > 0``, or hold one sample."""
    infos: dict[str, list] = defaultdict(list)
    seq_reward = []
    for result, penalty in zip(results, penalties):
        if isinstance(result, dict):
            score = result["score"]
            for key, value in result.items():
                infos[key].append(value)
        else:
            score = result
            infos["acc"].append(score)
        seq_reward.append(score + penalty)
    values = seq_reward if metric == "seq_reward" else infos[metric]
    by_uid = defaultdict(list)
    for uid, value in zip(uids, values, strict=True):
        by_uid[uid].append(value)
    kept = {uid for uid, group in by_uid.items() if np.std(group) > 0 or len(group) == 1}
    return [uid in kept for uid in uids]


def rlmega_kept(uids: list[int], results: list, penalties: list[float], metric: str) -> list[bool]:
    scored = [as_score(result) for result in results]
    raw = torch.tensor([score for score, _ in scored])
    responses = ScoredResponses(raw, [extras for _, extras in scored], [False] * len(results), {})
    shaped = raw + torch.tensor(penalties)
    records = [None]
    generations = [Generation(0, [1], [0.0], "stop", 0) for _ in results]
    values = dynamic_sampling_values(metric, responses, shaped, records, generations)
    return dynamic_sampling_filter(torch.tensor(uids), values).keep_mask.tolist()


RLMEGA_NAMES = {"acc": "acc", "score": "score", "seq_reward": "shaped_score"}


# verl's DAPO manager records no "score" for a plain-number reward (filtering on it is a KeyError there).
@pytest.mark.parametrize("metric, reward", [("acc", "dict"), ("score", "dict"), ("seq_reward", "dict"),
                                            ("acc", "number"), ("seq_reward", "number")])
@pytest.mark.parametrize("seed", range(8))
def test_the_groups_kept_are_the_ones_verl_keeps(metric, reward, seed):
    rng = random.Random(seed)
    n, groups = rng.choice([2, 4, 16]), rng.randint(1, 12)
    uids = [group for group in range(groups) for _ in range(n)]
    rng.shuffle(uids)
    results, penalties = [], []
    for _ in uids:
        correct = rng.random() < 0.5
        if reward == "dict":  # math_dapo's answer: score +-1, acc a bool, pred a string
            results.append({"score": 1.0 if correct else -1.0, "acc": correct, "pred": "42"})
        else:
            results.append(float(correct))
        penalties.append(-rng.choice([0.0, 0.0, 0.25, 1.0]))  # overlong shaping of some responses
    assert rlmega_kept(uids, results, penalties, RLMEGA_NAMES[metric]) == verl_kept(uids, results, penalties, metric)


def test_a_metric_the_reward_does_not_give_is_named_with_what_it_gave():
    scored = ScoredResponses(torch.tensor([1.0, 0.0]), [{"acc": 1.0}, {"acc": 0.0}], [False, False], {})
    records = [type("Record", (), {"data_source": "math_dapo"})()]
    generations = [Generation(0, [1], [0.0], "stop", 0)] * 2
    with pytest.raises(UserError, match=r"^algorithm\.dynamic_sampling_metric=pred_len: the reward of a response to a "
                                        r"'math_dapo' prompt gave no 'pred_len' \(it gave acc\); name one of those"):
        dynamic_sampling_values("pred_len", scored, torch.zeros(2), records, generations)
    failed = ScoredResponses(torch.tensor([0.0, 0.0]), [{"pred_len": 3.0}, {}], [False, True], {})
    assert dynamic_sampling_values("pred_len", failed, torch.zeros(2), records, generations).tolist() == [3.0, 0.0]


@pytest.fixture(scope="module")
def assets(tiny_assets):
    return tiny_assets(num_train=32, num_val=8)


REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    correct = solution_str.strip() == str(ground_truth)
    # acc moves only on prompts with an even sum; on the others it is 1 whatever the answer
    return {"score": float(correct), "acc": float(correct) if int(ground_truth) % 2 == 0 else 1.0}
'''


def _step(tmp_path, assets, *overrides):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "assets").symlink_to(assets)
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    config = load_config("tiny_cpu", [
        f"run_dir={tmp_path}", "trainer.prompts_per_step=4", "rollout.n=2", "trainer.val_every=0",
        "reward.num_workers=1", f"reward.user_function={reward}:compute_score", "algorithm.dynamic_sampling=true",
        "algorithm.max_generation_rounds=6", *overrides])
    prompts = build_prompt_side(config)
    try:
        engines = FakeEngines(prompts.data.tokenizer, prompts.generator.stop_token_ids[0])  # right, wrong, right...
        rollouts = prompts.step_rollouts.take(engines, step=1)
        kept_sums = [int(record.ground_truth) for record in prompts.data.dataset.batch(rollouts.prompt_indices)]
        return rollouts, kept_sums
    finally:
        prompts.close()


def test_a_step_filters_on_the_accuracy_the_reward_returns(tmp_path, assets):
    rollouts, kept_sums = _step(tmp_path, assets, "algorithm.dynamic_sampling_metric=acc")
    assert len(kept_sums) == 4 and all(total % 2 == 0 for total in kept_sums)  # constant acc: dropped
    assert rollouts.metrics["batch/dropped_groups"] > 0
    rollouts, kept_sums = _step(tmp_path / "by_score", assets)  # the shaped score moves in every group
    assert rollouts.metrics["batch/dropped_groups"] == 0 and rollouts.metrics["batch/generation_rounds"] == 1


def test_a_step_stops_on_a_metric_the_reward_does_not_give(tmp_path, assets):
    with pytest.raises(UserError, match="gave no 'pred_len' \\(it gave acc\\)"):
        _step(tmp_path, assets, "algorithm.dynamic_sampling_metric=pred_len")
