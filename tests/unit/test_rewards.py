"""megarl.rewards against hand-worked examples: answer extraction, scorers, user files, error policy."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from megarl.errors import ConfigError
from megarl.rewards import (
    BUILTIN_REWARDS,
    GSM8KReward,
    IntegerAnswerReward,
    IntegerMatch,
    MathBoxedReward,
    OnError,
    RewardError,
    WeightedReward,
    builtin_reward,
    extract_boxed,
    extract_gsm8k_answer,
    load_reward_function,
    normalize_math,
    resolve_reward_function,
    score_samples,
)

GSM8K_TRUTH = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether she sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
)


# ---- extraction ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is 1,234.", "1,234"),
        ("so 3 + 4 = 7\n#### 72", "72"),
        ("#### $1,234.50 total", "$1,234.50"),
        ("first 5 then 6, finally #### -3 and later 9", "-3"),
        ("It costs $18.", "$18"),
        ("no digits at all", None),
        ("12 apples\n#### none", "12"),  # a marker without a number: fall back to the last number
    ],
)
def test_extract_gsm8k_answer(text, expected):
    assert extract_gsm8k_answer(text) == expected


def test_gsm8k_scores():
    fn = GSM8KReward()
    row = {"answer": GSM8K_TRUTH}
    assert fn("q", "She sold 72 clips in total.", row) == 1.0
    assert fn("q", "48 + 24 = 72\n#### 72", row) == 1.0
    assert fn("q", "#### 72.0", row) == 1.0
    assert fn("q", "#### 71", row) == 0.0
    assert fn("q", "I do not know.", row) == 0.0
    assert fn("q", "The answer is 1,234.", {"answer": "#### 1234"}) == 1.0
    assert fn("q", "The answer is 1,234.", {"answer": "1234"}) == 1.0  # bare-number ground truth
    # last number wins without a marker: 72 appears first, 24 last
    assert fn("q", "72 is wrong, it is 24", row) == 0.0


def test_gsm8k_format_score_and_answer_key():
    fn = GSM8KReward(answer_key="solution", format_score=0.1)
    row = {"solution": "#### 72"}
    assert fn("q", "#### 70", row) == pytest.approx(0.1)  # marker used, wrong number
    assert fn("q", "it is 70", row) == 0.0  # no marker: no format credit
    assert fn("q", "#### 72", row) == 1.0
    with pytest.raises(KeyError, match="'solution'.*only \\['answer'\\]"):
        fn("q", "#### 72", {"answer": "#### 72"})
    with pytest.raises(ValueError, match="holds no number"):
        fn("q", "#### 72", {"solution": "seventy-two"})


# ---- boxed math ----------------------------------------------------------------------------------


def test_extract_boxed_nested_and_last():
    assert extract_boxed(r"so \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert extract_boxed(r"\boxed{1} no, \boxed{ {a}+\sqrt{b} }") == r" {a}+\sqrt{b} "
    assert extract_boxed(r"\fbox{3}") == "3"
    assert extract_boxed("no box") is None
    assert extract_boxed(r"\boxed{\frac{1}{2}") is None  # unbalanced


def test_normalize_math():
    assert normalize_math(r"$\left( 1, 2 \right)$.") == "(1,2)"
    assert normalize_math(r"\dfrac{1}{2}") == r"\frac{1}{2}"
    assert normalize_math(r"x \, = \! 3") == "x=3"


def test_math_boxed_scores():
    fn = MathBoxedReward(format_score=0.25)
    assert fn("q", r"Hence \boxed{\frac{1}{2}}.", {"answer": r"\frac{1}{2}"}) == 1.0
    assert fn("q", r"Hence \boxed{ \dfrac{1}{2} }", {"answer": r"$\frac{1}{2}$"}) == 1.0
    # ground truth that is a full solution: its boxed part is the answer
    assert fn("q", r"\boxed{\left(3,4\right)}", {"answer": r"We get \boxed{(3, 4)}."}) == 1.0
    assert fn("q", r"\boxed{\frac{1}{3}}", {"answer": r"\frac{1}{2}"}) == 0.25
    assert fn("q", r"the answer is 1/2", {"answer": r"\frac{1}{2}"}) == 0.0


# ---- integer answers -----------------------------------------------------------------------------


def test_integer_answer():
    fn = IntegerAnswerReward()
    assert fn("3+4=", "7", {"answer": 7}) == 1.0
    assert fn("3+4=", " 7 because 3+4", {"answer": "7"}) == 1.0
    assert fn("3+4=", "8", {"answer": 7}) == 0.0
    assert fn("3+4=", "seven", {"answer": 7}) == 0.0
    assert fn("3-9=", "-6", {"answer": -6}) == 1.0
    assert fn("3+4=", "17", {"answer": 7}) == 0.0  # whole integer, not a substring
    with pytest.raises(TypeError, match="integer answer"):
        fn("3+4=", "7", {"answer": 7.0})


@pytest.mark.parametrize("response, first, start, last", [
    ("7", 1, 1, 1),
    ("  7 because 3+4", 1, 1, 0),  # the last integer is 4
    ("3+4 is 7", 0, 0, 1),  # starts with 3, ends with 7
    ("The answer is 7.", 1, 0, 1),  # no integer at the start
    ("I think 8. No: 7", 0, 0, 1),
    ("-7", 0, 0, 0),  # (answer 7) the sign belongs to the integer
    ("17", 0, 0, 0),  # whole integers, not substrings
    ("", 0, 0, 0),
])
def test_integer_answer_match_options(response, first, start, last):
    """Hand-worked: which integer each ``match`` reads; ``first`` is the built-in's behaviour before the option."""
    row = {"answer": 7}
    assert IntegerAnswerReward()(None, response, row) == first  # the default: first
    for match, expected in (("first", first), ("start", start), ("last", last)):
        assert builtin_reward("integer_answer", match=match)("3+4=", response, row) == expected, match
    assert IntegerAnswerReward(match=IntegerMatch.LAST)("", "3 then 7", row) == 1.0


def test_integer_answer_bad_match_is_named():
    with pytest.raises(ConfigError, match=r"match='final': expected one of \['first', 'start', 'last'\]"):
        builtin_reward("integer_answer", match="final")


# ---- registry and user functions -----------------------------------------------------------------


def test_registry():
    assert sorted(BUILTIN_REWARDS) == ["gsm8k", "integer_answer", "math_boxed"]
    assert builtin_reward("gsm8k", answer_key="gt") == GSM8KReward(answer_key="gt")
    assert isinstance(resolve_reward_function("integer_answer"), IntegerAnswerReward)
    valid = r"\['gsm8k', 'integer_answer', 'math_boxed'\]"
    with pytest.raises(ConfigError, match=rf"'gsm8K'.*did you mean 'gsm8k'.*{valid}"):
        builtin_reward("gsm8K")
    with pytest.raises(ConfigError, match=r"no options \['answer_col'\]"):
        builtin_reward("gsm8k", answer_col="x")


def _write(tmp_path, name, source):
    path = tmp_path / name
    path.write_text(source)
    return path


def test_user_function_by_path_receives_extra_columns(tmp_path):
    path = _write(
        tmp_path,
        "my_reward.py",
        "CALLS = []\n"
        "def score(prompt, response, row):\n"
        "    CALLS.append((prompt, response, dict(row)))\n"
        "    return 0.5 if response == row['target'] else -1\n",
    )
    fn = load_reward_function(f"{path}:score")
    rows = [{"target": "a", "difficulty": 3}, {"target": "b", "difficulty": 5}]
    scores, info = score_samples(fn, ["p0", "p1"], ["a", "x"], rows)
    assert scores.dtype == torch.float32 and scores.tolist() == [0.5, -1.0]
    assert info.num_errors == 0
    calls = fn.fn.__globals__["CALLS"]  # fn: the user's function (row style) in its adapter
    assert calls == [("p0", "a", rows[0]), ("p1", "x", rows[1])]
    # the same file through the resolver; files with the same base name elsewhere do not clash
    other = tmp_path / "sub"
    other.mkdir()
    _write(other, "my_reward.py", "def score(prompt, response, row):\n    return 2.0\n")
    assert resolve_reward_function(f"{other / 'my_reward.py'}:score")("p", "r", {}) == 2.0
    assert load_reward_function(f"{path}:score")("p", "a", {"target": "a"}) == 0.5


def test_user_function_errors(tmp_path):
    path = _write(tmp_path, "r.py", "THRESHOLD = 3\ndef two_args(prompt, answer):\n    return 1.0\n"
                  "def good(prompt, response, row):\n    return 1.0\n")
    with pytest.raises(ConfigError, match="expected 'path/to/file.py:function_name'"):
        load_reward_function(str(path))
    with pytest.raises(ConfigError, match="does not exist"):
        load_reward_function(f"{tmp_path / 'missing.py'}:good")
    with pytest.raises(ConfigError, match=r"defines no 'bad'; its callables: \['good', 'two_args'\]"):
        load_reward_function(f"{path}:bad")
    with pytest.raises(ConfigError, match="'THRESHOLD' in r.py is a int, expected a function"):
        load_reward_function(f"{path}:THRESHOLD")
    with pytest.raises(ConfigError, match=r"signature \(prompt, answer\), which fits no calling convention"):
        load_reward_function(f"{path}:two_args")
    broken = _write(tmp_path, "broken.py", "import not_a_real_module_xyz\n")
    with pytest.raises(ConfigError, match="importing reward function file .*broken.py.* ModuleNotFoundError"):
        load_reward_function(f"{broken}:good")
    with pytest.raises(ConfigError, match="takes no options"):
        resolve_reward_function(f"{path}:good", answer_key="x")


# ---- combination ---------------------------------------------------------------------------------


def test_weighted_reward():
    def length(prompt, response, row):
        return len(response)

    fn = WeightedReward([(IntegerAnswerReward(), 2.0), (length, -0.5)])
    # 2 * 1.0 - 0.5 * 1 and 2 * 0.0 - 0.5 * 3
    assert fn("q", "7", {"answer": 7}) == pytest.approx(1.5)
    assert fn("q", "123", {"answer": 7}) == pytest.approx(-1.5)
    with pytest.raises(ConfigError, match="at least one"):
        WeightedReward([])
    with pytest.raises(ConfigError, match="term 0 .*finite weight, found nan"):
        WeightedReward([(length, math.nan)])
    with pytest.raises(ValueError, match="term .*nan_fn.*finite"):
        WeightedReward([(length, 1.0), (nan_fn, 1.0)])("q", "r", {})


def nan_fn(prompt, response, row):
    return math.nan


# ---- error policy --------------------------------------------------------------------------------


def _raise_on_b(prompt, response, row):
    if "b" in response:
        raise ZeroDivisionError("cannot score b")
    return 1.0


def test_raising_function_raise_policy():
    long_prompt = "P" * 500
    with pytest.raises(RewardError) as err:
        score_samples(_raise_on_b, ["p0", long_prompt], ["a", "bbb"], [{}, {}], OnError.RAISE)
    message = str(err.value)
    assert "_raise_on_b failed on sample 1" in message
    assert "'bbb'" in message and "ZeroDivisionError: cannot score b" in message
    assert "P" * 200 + "'...(+300 chars)" in message and "P" * 201 not in message
    assert isinstance(err.value.__cause__, ZeroDivisionError)


def test_raising_function_score_policy(caplog):
    with caplog.at_level(logging.WARNING, logger="megarl.rewards.base"):
        scores, info = score_samples(
            _raise_on_b, ["p0", "p1", "p2"], ["a", "b", "b2"], [{}, {}, {}], OnError.SCORE, error_score=-1.0
        )
    assert scores.tolist() == [1.0, -1.0, -1.0]
    assert info.num_errors == 2
    assert "sample 1" in info.first_error and "'b'" in info.first_error
    assert "2 of 3 samples could not be scored" in caplog.text and "sample 1" in caplog.text


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, None, "1.0", True, torch.tensor([1.0, 2.0])])
def test_non_finite_or_non_numeric_rejected(bad):
    def fn(prompt, response, row):
        return bad

    with pytest.raises(RewardError, match="sample 0"):
        score_samples(fn, ["p"], ["r"], [{}])
    scores, info = score_samples(fn, ["p"], ["r"], [{}], OnError.SCORE, error_score=0.0)
    assert scores.tolist() == [0.0] and info.num_errors == 1


def test_numeric_types_accepted():
    values = iter([1, 0.5, torch.tensor(2.0), __import__("numpy").float64(-3.0)])
    scores, _ = score_samples(lambda p, r, row: next(values), ["p"] * 4, ["r"] * 4, [{}] * 4)
    assert scores.tolist() == [1.0, 0.5, 2.0, -3.0]


def test_score_samples_argument_checks():
    with pytest.raises(ValueError, match="one prompt, response and row per sample"):
        score_samples(_raise_on_b, ["p"], ["r", "s"], [{}])
    with pytest.raises(ConfigError, match="on_error must be an OnError"):
        score_samples(_raise_on_b, ["p"], ["r"], [{}], on_error="score")
    with pytest.raises(ValueError, match="finite"):
        score_samples(_raise_on_b, ["p"], ["r"], [{}], OnError.SCORE, error_score=math.nan)
