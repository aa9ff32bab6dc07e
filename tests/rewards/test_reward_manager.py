"""The reward manager on hand-made batches: weights per data source, per-component metrics, failing
components and items counted and scored 0, normalisation and clipping, the judge's text through its
parser (a fake engine and the tiny real HF engine), and the reward model's input (the policy's ids
when the tokenizers agree)."""

import math

import pytest

from rlmega.rewards import (
    JudgeScorer, Outcome, RewardConfig, RewardManager, RewardModelScorer, RewardWeights, ScoreItem, ScoreTransform,
    first_number,
)


class Fixed:
    """A component that answers each item with ``scores[solution_str]`` (an Outcome, or raises)."""

    def __init__(self, scores, fail=False):
        self.scores, self.fail, self.calls, self.closed = scores, fail, [], False

    def score_items(self, items):
        self.calls.append([item.solution_str for item in items])
        if self.fail:
            raise RuntimeError("the model is down")
        return [self.scores[item.solution_str] for item in items]

    def close(self):
        self.closed = True


def ok(score):
    return Outcome("ok", score=score)


ITEMS = [ScoreItem("math", "a", "1"), ScoreItem("math", "b", "1"), ScoreItem("chat", "c", None),
         ScoreItem("chat", "d", None)]


def manager(weights=None, by_source=None, val=None, monitor=(), rm_fail=False, transforms=None):
    rule = Fixed({"a": ok(1.0), "b": Outcome("error", message="no answer"), "c": ok(0.0), "d": ok(1.0)})
    model = Fixed({"a": ok(2.0), "b": ok(-1.0), "c": ok(0.5), "d": ok(4.0)}, fail=rm_fail)
    judge = Fixed({"a": ok(0.9), "b": Outcome("error", message="parser"), "c": ok(0.1), "d": ok(0.3)})
    config = RewardConfig(weights=weights or {}, data_source_weights=by_source or {}, val_weights=val or {},
                          monitor=list(monitor))
    parts = {"rule": rule, "reward_model": model, "judge": judge}
    return RewardManager(config, parts, transforms), parts


def test_weights_per_data_source_combine_the_components_and_each_reports_its_metrics():
    rewards, parts = manager(weights={"rule": 1.0, "reward_model": 0.5},
                             by_source={"chat": {"rule": 0.0, "judge": 2.0}})
    scores, metrics = rewards.score_batch(ITEMS)
    # math: rule + 0.5 rm (b's rule failed: 0); chat: 0.5 rm + 2 judge, no rule
    assert scores == pytest.approx([1.0 + 1.0, 0.0 - 0.5, 0.25 + 0.2, 2.0 + 0.6])
    assert parts["rule"].calls == [["a", "b"]] and parts["judge"].calls == [["c", "d"]]
    assert parts["reward_model"].calls == [["a", "b", "c", "d"]]
    assert metrics["reward/rule/mean"] == pytest.approx(0.5) and metrics["reward/rule/errors"] == 1
    assert metrics["reward/reward_model/mean"] == pytest.approx(5.5 / 4)
    assert metrics["reward/judge/mean"] == pytest.approx(0.2) and metrics["reward/judge/errors"] == 0
    assert metrics["reward/mean"] == pytest.approx(sum(scores) / 4)
    assert metrics["reward/errors"] == 1 and metrics["reward/timeouts"] == 0
    assert metrics["timing_s/reward_model"] >= 0 and metrics["timing_s/judge"] >= 0
    assert "timing_s/rule" not in metrics


def test_automatic_weights_validation_weights_and_monitored_components():
    rewards, parts = manager(val={"rule": 1.0}, monitor=["rule"])
    scores, metrics = rewards.score_batch(ITEMS)  # automatic: the model components at 1 each
    assert scores == pytest.approx([2.9, -1.0, 0.6, 4.3])
    assert metrics["reward/rule/mean"] == pytest.approx(0.5)  # monitored: computed, weighted 0
    val_scores, _ = rewards.score_batch(ITEMS, validation=True)
    assert val_scores == [1.0, 0.0, 0.0, 1.0]
    assert len(parts["reward_model"].calls) == 1  # validation did not need the reward model
    assert RewardWeights(RewardConfig(), ["rule", "user_function"]).default == {"user_function": 1.0}
    assert RewardWeights(RewardConfig(), ["rule"]).default == {"rule": 1.0}


def test_a_component_that_raises_fails_its_items_and_the_batch_goes_on():
    rewards, _ = manager(weights={"rule": 1.0, "reward_model": 1.0}, rm_fail=True)
    scores, metrics = rewards.score_batch(ITEMS)
    assert scores == [1.0, 0.0, 0.0, 1.0]
    assert metrics["reward/reward_model/errors"] == 4 and metrics["reward/reward_model/mean"] == 0.0
    assert metrics["reward/errors"] == 5


def test_model_scores_are_normalised_and_clipped_on_request():
    batch = ScoreTransform("batch", clip_range=(-1.0, 1.0))
    values = batch([2.0, -1.0, 0.5, 4.0], [True] * 4)
    mean, std = 1.375, math.sqrt(sum((v - 1.375) ** 2 for v in [2.0, -1.0, 0.5, 4.0]) / 4)
    assert values == pytest.approx([max(-1.0, min(1.0, (v - mean) / std)) for v in [2.0, -1.0, 0.5, 4.0]], abs=1e-5)
    assert batch([3.0, 7.0], [True, False]) == [0.0, 0.0]  # failed items stay 0; one score normalises to 0
    running = ScoreTransform("running")
    running([0.0, 2.0], [True, True])
    assert running([4.0], [True]) == pytest.approx([(4.0 - 2.0) / math.sqrt(8 / 3)], abs=1e-5)
    assert running([4.0], [True], update=False) == pytest.approx([(4.0 - 2.0) / math.sqrt(8 / 3)], abs=1e-5)
    assert running.count == 3  # validation calls read the running statistics without adding to them
    rewards, _ = manager(weights={"reward_model": 1.0}, transforms={"reward_model": ScoreTransform("batch")})
    scores, metrics = rewards.score_batch(ITEMS)
    assert sum(scores) == pytest.approx(0.0, abs=1e-5)
    assert metrics["reward/reward_model/raw_mean"] == pytest.approx(5.5 / 4)


@pytest.mark.parametrize("config, enabled, message", [
    (RewardConfig(weights={"rm": 1.0}), ["rule"], "reward.weights.rm: 'rm' is not a reward component"),
    (RewardConfig(weights={"judge": 1.0}), ["rule"], "reward.weights.judge: the run has no judge component"),
    (RewardConfig(data_source_weights={"gsm8k": {"reward_model": 0.5}}), ["rule"],
     "reward.data_source_weights.gsm8k.reward_model: the run has no reward_model"),
    (RewardConfig(val_weights={"rule": float("nan")}), ["rule"],
     "reward.val_weights.rule: the weight must be a finite number"),
    (RewardConfig(monitor=["user_function"]), ["rule"], "reward.monitor[0]: the run has no user_function"),
])
def test_weights_that_cannot_work_are_refused_by_field(config, enabled, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        RewardWeights(config, enabled).check()
    RewardWeights(RewardConfig(weights={"judge": 0.0}), ["rule"]).check()  # a 0 weight needs no component


# ---- the judge ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    from rlmega.data import build_char_tokenizer

    return build_char_tokenizer()


class ScriptedEngine:
    """Answers prompt i with ``answers[i]`` (then end of text), and keeps the prompts it was given."""

    def __init__(self, tokenizer, answers):
        self.tokenizer, self.answers, self.prompts, self.params, self.shut_down = tokenizer, answers, [], None, False

    def generate(self, prompts, params):
        from rlmega.rollout.protocol import Generation

        self.prompts, self.params = prompts, params
        return [Generation(i, self.tokenizer.encode(answer, add_special_tokens=False) + [self.tokenizer.eos_token_id],
                           [0.0] * (len(answer) + 1), "stop", 0) for i, answer in enumerate(self.answers)]

    def shutdown(self):
        self.shut_down = True


def strict_parser(text):
    if "score" not in text:
        raise ValueError(f"unparseable: {text!r}")
    return first_number(text)


def test_judge_scores_come_from_the_engines_text_through_the_parser(tokenizer):
    items = [ScoreItem("math", "12", "12", messages=[{"role": "user", "content": "5+7="}]),
             ScoreItem("math", "3", "4", messages=[{"role": "user", "content": "2+2="}]),
             ScoreItem("math", "x", "9", messages=[{"role": "user", "content": "4+5="}])]
    engine = ScriptedEngine(tokenizer, ["score 0.75", "I think score: 0.25", "no idea"])
    judge = JudgeScorer(engine, tokenizer, template="Q {question} A {response} ref {ground_truth}",
                        parser=strict_parser, max_new_tokens=12)
    rewards = RewardManager(RewardConfig(weights={"judge": 1.0}), {"judge": judge})
    scores, metrics = rewards.score_batch(items)
    assert scores == [0.75, 0.25, 0.0]  # the parser raised on the third answer: 0, counted
    assert metrics["reward/judge/errors"] == 1 and metrics["timing_s/judge"] >= 0
    first = tokenizer.decode(engine.prompts[0], skip_special_tokens=False)
    assert first == "<bos><|user|>Q 5+7= A 12 ref 12<eos><|assistant|>"  # the template, in the chat template
    assert engine.params.temperature == 0.0 and engine.params.max_new_tokens == 12
    assert engine.params.stop_token_ids == (tokenizer.eos_token_id,)
    rewards.close()
    assert engine.shut_down


def test_judge_with_the_tiny_real_engine(tmp_path, tokenizer):
    """The hf engine's own greedy answer, decoded and parsed, is the judge's score; a parser that raises
    on every answer scores 0 and counts every item."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from rlmega.rollout.hf_engine import HFEngine
    from rlmega.rollout.protocol import SamplingParams
    from rlmega.trainer.assets import TINY_MODEL

    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **TINY_MODEL)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    engine = HFEngine(str(tmp_path))
    items = [ScoreItem("rlmega/arithmetic", str(n), str(n), messages=[{"role": "user", "content": f"{n}+0="}])
             for n in range(4)]
    judge = JudgeScorer(engine, tokenizer, template="{question}{response}", parser=len, max_new_tokens=5)
    outcomes = judge.score_items(items)
    greedy = engine.generate([judge.prompt_ids(item) for item in items], SamplingParams(
        temperature=0.0, max_new_tokens=5, stop_token_ids=(tokenizer.eos_token_id,)))
    texts = [tokenizer.decode(g.response_token_ids, skip_special_tokens=True) for g in greedy]
    assert judge.last_texts == texts
    assert [o.score for o in outcomes] == [float(len(text)) for text in texts]
    raising = JudgeScorer(engine, tokenizer, template="{question}", parser=lambda text: 1 / 0, max_new_tokens=5)
    scores, metrics = RewardManager(RewardConfig(weights={"judge": 1.0}), {"judge": raising}).score_batch(items)
    assert scores == [0.0] * 4 and metrics["reward/judge/errors"] == 4


def test_first_number_and_template_fields():
    from rlmega.rewards.judge import check_template

    assert first_number("Score: 0.8 out of 1") == 0.8 and first_number("-3") == -3.0
    with pytest.raises(ValueError, match="no number"):
        first_number("none")
    check_template("{question} {response} {ground_truth} {data_source} {{literal}}")
    with pytest.raises(ValueError, match=r"unknown field \{answer\}"):
        check_template("{answer}")


# ---- the reward model's input -----------------------------------------------------------------

class Recorder:
    def __init__(self):
        self.batches = []

    def score(self, batch):
        import torch

        self.batches.append(batch)
        return torch.arange(len(batch), dtype=torch.float32)

    def shutdown(self):
        pass


def test_reward_model_scores_the_policys_ids_when_the_tokenizers_agree(tokenizer):
    from rlmega.rewards import same_tokenization

    assert same_tokenization(tokenizer, tokenizer)
    recorder = Recorder()
    scorer = RewardModelScorer(recorder, tokenizer, retokenize=False)
    items = [ScoreItem("math", "7", "7", prompt_token_ids=[1, 5, 6], response_token_ids=[30, 2]),
             ScoreItem("math", "", "7", prompt_token_ids=[1], response_token_ids=[]),  # 1 token: fails alone
             ScoreItem("math", "8", "8", prompt_token_ids=[1, 9], response_token_ids=[31])]
    outcomes = scorer.score_items(items)
    assert [o.status for o in outcomes] == ["ok", "error", "ok"] and [outcomes[0].score, outcomes[2].score] == [0, 1]
    assert [t.tolist() for t in recorder.batches[0].tokens] == [[1, 5, 6, 30, 2], [1, 9, 31]]
