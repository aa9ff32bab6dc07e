"""Hand-made right, wrong and malformed cases for every rule scorer, and the data_source registry."""

from fractions import Fraction

import pytest

from rlmega.data import ARITHMETIC_DATA_SOURCE
from rlmega.rewards import (
    RULE_SCORERS,
    arithmetic_score,
    countdown_score,
    exact_match_score,
    get_rule_scorer,
    gsm8k_score,
    math_score,
)
from rlmega.rewards.countdown import InvalidEquation, evaluate_equation
from rlmega.rewards.math import last_boxed, math_answers_match, normalize_math_answer


@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{3} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{x^{2}+\{1\}}", r"x^{2}+\{1\}"),
    (r"\fbox{7}", "7"),
    (r"the answer is $\boxed 5$.", "5"),
    (r"\boxed{unclosed", None),
    ("no box here", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize("predicted, truth", [
    (r"\frac{1}{2}", "1/2"),
    (r"\dfrac{1}{2}", "0.5"),
    (r"\frac12", ".5"),
    ("2.0", "2"),
    ("2.", "2"),
    (r"\left( 1, 2 \right)", "(1,2)"),
    (r"5\text{ cm}", "5"),
    (r"\text{(B)}", "(B)"),
    ("x = 3", "3"),
    ("1,000", "1000"),
    (r"\$2.00", "2"),
    ("$7$", "7"),
    (r"90^\circ", "90"),
    (r"50\%", "50"),
    (r"\sqrt2", r"\sqrt{2}"),
    (r"\frac{\sqrt{3}}{2}", r"\dfrac{\sqrt{3}}{2}"),
])
def test_math_answers_that_match(predicted, truth):
    assert math_answers_match(predicted, truth), (normalize_math_answer(predicted), normalize_math_answer(truth))


@pytest.mark.parametrize("predicted, truth", [
    ("3", "4"), ("(1,2)", "(2,1)"), ("1/3", "0.333"), (r"\frac{1}{0}", "0"), ("x+1", "x-1"), ("12", "1,2"),
])
def test_math_answers_that_differ(predicted, truth):
    assert not math_answers_match(predicted, truth)


def test_math_score():
    assert math_score(r"We get $\boxed{\dfrac{3}{4}}$.", "3/4") == 1.0
    assert math_score(r"We get $\boxed{\dfrac{3}{4}}$.", r"The answer is \boxed{0.75}") == 1.0
    assert math_score(r"\boxed{1} no wait \boxed{2}", "1") == 0.0
    assert math_score("The answer is 3/4", "3/4") == 0.0  # not boxed
    assert math_score(r"\boxed{3/4", "3/4") == 0.0  # malformed


def test_gsm8k_score():
    assert gsm8k_score("5 + 3 = 8 apples.\n#### 8", "8") == 1.0
    assert gsm8k_score("#### $1,000", "1000") == 1.0
    assert gsm8k_score("#### 1000.00", "1,000") == 1.0
    assert gsm8k_score("#### 12.5", "12.50") == 1.0
    assert gsm8k_score("#### -3", "-3") == 1.0
    assert gsm8k_score("#### 7\nfix: #### 8", "8") == 1.0  # the last answer counts
    assert gsm8k_score("Natalia sold 48+24 = 72 clips.\n#### 72", "She sold 72.\n#### 72") == 1.0
    assert gsm8k_score("#### 9", "8") == 0.0
    assert gsm8k_score("The answer is 8", "8") == 0.0  # strict: no ####
    assert gsm8k_score("The answer is 8.", "8", strict=False) == 1.0
    assert gsm8k_score("#### eight", "8") == 0.0
    assert gsm8k_score("", "8") == 0.0


COUNTDOWN_TRUTH = {"target": 16, "numbers": [3, 4, 6, 1]}


@pytest.mark.parametrize("response, expected", [
    ("Let me think. <answer>(6 - 3 + 1) * 4</answer>", 1.0),
    ("<answer>3*4*(6/3)</answer>", 0.0),  # 3 used twice, 1 unused
    ("<answer>6*4*1*3/3</answer>", 0.0),
    ("<answer>(6 - 3 + 1) * 4 = 16</answer>", 1.0),  # "= target" is ignored
    ("<answer>6*4</answer>", 0.0),  # not every number used
    ("<answer>6*4+3-1</answer>", 0.0),  # wrong value
    ("<answer>(3-1)*6*4/2</answer>", 0.0),  # 2 not given
    ("<answer>1</answer><answer>(6-3+1)*4</answer>", 1.0),  # the last block counts
    ("(6 - 3 + 1) * 4", 0.0),  # no answer tags
    ("<answer>__import__('os').system('true')</answer>", 0.0),
    ("<answer>6**4</answer>", 0.0),
    ("<answer>-3+6*4+1+2</answer>", 0.0),
    ("<answer>6/(4-4)</answer>", 0.0),
    ("<answer>" + "(" * 300 + "1" + ")" * 300 + "</answer>", 0.0),
])
def test_countdown_score(response, expected):
    assert countdown_score(response, COUNTDOWN_TRUTH) == expected


def test_countdown_fractions_are_exact_and_format_score():
    assert countdown_score("<answer>6 / (1 - 3/4)</answer>", {"target": 24, "numbers": [3, 4, 6, 1]}) == 1.0
    assert countdown_score("<answer>3+4+6+1</answer>", COUNTDOWN_TRUTH, format_score=0.1) == 0.1
    assert countdown_score("<answer>nope</answer>", COUNTDOWN_TRUTH, format_score=0.1) == 0.0
    assert evaluate_equation("(6 - 3 + 1) * 4") == (16, [6, 3, 1, 4])
    assert evaluate_equation("7/2") == (Fraction(7, 2), [7, 2])
    with pytest.raises(InvalidEquation, match="Call is not allowed"):
        evaluate_equation("(1)(2)")
    with pytest.raises(ValueError, match="countdown ground_truth must be"):
        countdown_score("<answer>1</answer>", "24")


def test_exact_match_and_arithmetic():
    assert exact_match_score("  Paris\n", "Paris") == 1.0
    assert exact_match_score("paris", "Paris") == 0.0
    assert exact_match_score("B", ["A", "B"]) == 1.0
    assert arithmetic_score("19", "19") == 1.0
    assert arithmetic_score(" 19 ", "19") == 1.0
    assert arithmetic_score("19 19", "19") == 0.0
    assert arithmetic_score("", "19") == 0.0


def test_registry_by_data_source():
    assert get_rule_scorer("openai/gsm8k") is gsm8k_score
    assert get_rule_scorer("lighteval/MATH") is math_score
    assert get_rule_scorer("DigitalLearningGmbH/MATH-lighteval") is math_score
    assert get_rule_scorer("countdown") is countdown_score
    assert get_rule_scorer(ARITHMETIC_DATA_SOURCE) is arithmetic_score
    with pytest.raises(ValueError, match=r"no rule scorer for data_source 'nope'; valid: \[.*'openai/gsm8k'"):
        get_rule_scorer("nope")
    assert all(callable(scorer) for scorer in RULE_SCORERS.values())
