"""Reward functions in megarl's and TRL's calling conventions, against hand-worked scores.

Each function is loaded from a file by path, as ``reward.function: file.py:fn`` loads it, and scored by
:func:`score_samples`. The negative control is the bug this adapter fixes: a TRL-style keyword function
called the old way (the row as its third argument) scores 0 on every sample. Also: the ConfigErrors for
signatures that fit no convention or read columns the rows lack, and the one warning for a function whose
scores never vary (:class:`RewardMonitor`); and the trainer's reward stage running all of it.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from megarl.config.train import load_config
from megarl.data.batch import Batch
from megarl.data.prompts import PromptRecord
from megarl.errors import ConfigError
from megarl.rewards import (
    BatchUserReward,
    Convention,
    IntegerAnswerReward,
    OnError,
    RewardError,
    RewardMonitor,
    ScoreInfo,
    WeightedReward,
    load_reward_function,
    resolve_reward_function,
    score_samples,
)
from megarl.trainer.experience import Experience

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_addition_tiny" / "config.yaml"

PROMPTS = ["1+1=", "2+2=", "3+3="]
RESPONSES = ["2", "5", "6"]
ROWS = [{"target": "2", "level": 1}, {"target": "4", "level": 2}, {"target": "6", "level": 3}]
MATCHES = [1.0, 0.0, 1.0]  # response == target, by hand

FUNCTIONS = '''
CALLS = []

def row_style(prompt, response, row):
    return float(response == row["target"])

def legacy_names(p, r, extra):
    return float(r == extra["target"])

def trl_keywords(prompt, response, target=None, **_):
    return float(response == target)

def only_named(response, target):  # no **kwargs: gets no other column (level would be a TypeError)
    return float(response == target)

def completion_alias(completion, target, **kwargs):
    return float(completion == target) + 10 * ("response" in kwargs)

def trl_batch(prompts, completions, target, **kwargs):
    CALLS.append((list(prompts), list(completions), list(target), sorted(kwargs)))
    return [float(c == t) for c, t in zip(completions, target)]

def trl_batch_completions_only(completions, **kwargs):
    return [len(c) + len(kwargs["prompts"][i]) for i, c in enumerate(completions)]

def batch_wrong_count(prompts, completions, **kwargs):
    return [1.0]

def batch_one_none(prompts, completions, **kwargs):
    return [1.0, None, 0.5]

def batch_scalar(prompts, completions, **kwargs):
    return 1.0

def constant(prompt, response, row):
    return 0.0

SEEN = [0]

def across_batches(prompt, response, row):  # equal within a batch of 3, but 0 in the first batch, 1 later
    SEEN[0] += 1
    return float(SEEN[0] > 3)

def two_positional(x, y):
    return 1.0

def both_names(prompt, response=None, completion=None):
    return 1.0

def row_keyword_only(prompt, response, *, row):
    return 1.0

def row_first(row, prompt, response):
    return 1.0

def needs_ids(prompts, completions, completion_ids):
    return [1.0]

def positional_only(prompt, response, /, **kw):
    return 1.0

def batch_no_completions(prompts, target):
    return [1.0]

def row_named_like_column(prompt, response, target):
    return float(response == target)

def misspelt_column(prompt, response, answer=None, **_):
    return float(response == answer)
'''


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    file = tmp_path_factory.mktemp("rewards") / "fns.py"
    file.write_text(FUNCTIONS)
    return file


def _load(path, name):
    return load_reward_function(f"{path}:{name}")


def _scores(fn, **kwargs):
    scores, info = score_samples(fn, PROMPTS, RESPONSES, ROWS, **kwargs)
    return scores.tolist(), info


@pytest.mark.parametrize("name, convention", [
    ("row_style", Convention.ROW), ("legacy_names", Convention.ROW), ("row_named_like_column", Convention.ROW),
    ("trl_keywords", Convention.KEYWORDS), ("only_named", Convention.KEYWORDS),
    ("completion_alias", Convention.KEYWORDS), ("misspelt_column", Convention.KEYWORDS),
    ("trl_batch", Convention.BATCH), ("trl_batch_completions_only", Convention.BATCH),
])
def test_convention_detected_from_the_signature(path, name, convention):
    fn = _load(path, name)
    assert fn.convention is convention
    assert isinstance(fn, BatchUserReward) is (convention is Convention.BATCH)


@pytest.mark.parametrize("name", ["row_style", "legacy_names", "trl_keywords", "only_named", "trl_batch"])
def test_each_convention_scores_the_matching_samples(path, name):
    scores, info = _scores(_load(path, name))
    assert scores == MATCHES and info.num_errors == 0


def test_keyword_function_called_the_old_way_scores_zero(path):
    """The negative control: the TRL-style function gets the whole row as ``target`` and never matches."""
    raw = _load(path, "trl_keywords").fn
    assert [raw(p, r, row) for p, r, row in zip(PROMPTS, RESPONSES, ROWS, strict=True)] == [0.0, 0.0, 0.0]


def test_completion_is_another_name_for_response(path):
    scores, _ = _scores(_load(path, "completion_alias"))
    assert scores == MATCHES  # and no 'response' keyword besides (it would add 10)


def test_taken_names_are_not_passed_as_columns(path):
    rows = [{**row, "response": "reference answer", "prompts": "x"} for row in ROWS]
    scores, _ = score_samples(_load(path, "completion_alias"), PROMPTS, RESPONSES, rows)
    assert scores.tolist() == MATCHES


def test_batch_style_is_called_once_with_columns_as_lists(path):
    fn = _load(path, "trl_batch")
    calls = fn.fn.__globals__["CALLS"]
    calls.clear()
    rows = [ROWS[0], {"target": "4"}, ROWS[2]]  # the second row lacks 'level': None in its place
    scores, _ = score_samples(fn, PROMPTS, RESPONSES, rows)
    assert scores.tolist() == MATCHES
    assert calls == [(PROMPTS, RESPONSES, ["2", "4", "6"], ["level"])]
    # len(completion) + len(prompt), prompts reaching **kwargs as TRL passes them
    scores, _ = _scores(_load(path, "trl_batch_completions_only"))
    assert scores == [5.0, 5.0, 5.0]


def test_batch_failures(path):
    with pytest.raises(RewardError, match=r"batch_wrong_count failed on the batch of 3 samples.*returned 1 scores "
                                          r"for 3 completions"):
        _scores(_load(path, "batch_wrong_count"))
    scores, info = _scores(_load(path, "batch_wrong_count"), on_error=OnError.SCORE, error_score=-1.0)
    assert scores == [-1.0, -1.0, -1.0] and info.num_errors == 3 and info.failed == (0, 1, 2)
    with pytest.raises(RewardError, match=r"returned 1.0 \(float\); a batch-style reward function returns one score "
                                          r"per completion, a list of 3 numbers"):
        _scores(_load(path, "batch_scalar"))
    # a value that is not a number fails its own sample only
    scores, info = _scores(_load(path, "batch_one_none"), on_error=OnError.SCORE, error_score=-1.0)
    assert scores == [1.0, -1.0, 0.5] and info.failed == (1,) and "sample 1" in info.first_error


def test_weighted_mix_of_conventions(path):
    fn = WeightedReward([(_load(path, "row_style"), 1.0), (_load(path, "trl_keywords"), 2.0),
                         (_load(path, "trl_batch"), -0.5), (IntegerAnswerReward(answer_key="target"), 0.25)])
    scores, info = _scores(fn)
    assert scores == pytest.approx([m * (1 + 2 - 0.5 + 0.25) for m in MATCHES]) and info.num_errors == 0


@pytest.mark.parametrize("name, match", [
    ("two_positional", r"signature \(x, y\), which fits no calling convention .*expected one of: \(prompt, "
                       r"response, row\).*Rename its parameters"),
    ("both_names", r"read as keywords style; it takes both 'response' and 'completion', so megarl cannot tell"),
    ("row_keyword_only", r"read as megarl's row convention .* cannot be called as \(prompt, response, row\)"),
    ("row_first", r"its parameter 'row' is not the third positional one, .*\('response' gets it\)"),
    ("needs_ids", r"'completion_ids' is required but megarl never passes it.*Give such parameters a default"),
    ("positional_only", r"'prompt' is positional-only; 'response' is positional-only"),
    ("batch_no_completions", r"read as batch style; it takes no 'completions' and no \*\*kwargs"),
])
def test_signatures_that_fit_no_convention(path, name, match):
    with pytest.raises(ConfigError, match=match):
        _load(path, name)


def test_columns_checked_against_the_rows(path, caplog):
    only_named = _load(path, "only_named")
    assert only_named.check_columns({"target", "level"}) == []
    with pytest.raises(ConfigError, match=r"only_named' \(response, target\) is called keywords style and needs the "
                                          r"column\(s\) \['target'\].*rows have only \['answer'\]. Rename"):
        only_named.check_columns({"answer"})
    with pytest.raises(ConfigError, match=r"third parameter 'target' receives the whole row .* also has a column "
                                          r"'target'.*Rename the parameter to 'row'"):
        _load(path, "row_named_like_column").check_columns({"target"})
    assert _load(path, "legacy_names").check_columns({"target", "extra_info"}) == []  # 'extra' is no column
    warnings = _load(path, "misspelt_column").check_columns({"target"})
    assert len(warnings) == 1 and "['answer'] name no column of the dataset (['target'])" in warnings[0]
    # through the monitor: once per column set
    monitor = RewardMonitor()
    with caplog.at_level(logging.WARNING, logger="megarl.rewards.monitor"):
        for _ in range(3):
            monitor.check_columns("function", _load(path, "misspelt_column"), ROWS)
    assert caplog.text.count("name no column") == 1
    with pytest.raises(ConfigError, match="needs the column"):
        monitor.check_columns("other", only_named, [{"answer": 1}])


def test_missing_column_in_a_row_fails_that_sample(path):
    rows = [ROWS[0], {"level": 2}, ROWS[2]]
    scores, info = score_samples(_load(path, "only_named"), PROMPTS, RESPONSES, rows, OnError.SCORE, -1.0)
    assert scores.tolist() == [1.0, -1.0, 1.0]
    assert "needs the column(s) ['target'], which this row lacks; its columns: ['level']" in info.first_error


def test_builtins_and_row_functions_unchanged(path):
    assert isinstance(resolve_reward_function("integer_answer"), IntegerAnswerReward)
    assert _load(path, "row_style")("p", "2", {"target": "2"}) == 1.0


# ---- constant scores ----------------------------------------------------------------------------


def _observe(monitor, name, spec, fn, batches, caplog):
    warned = []
    with caplog.at_level(logging.WARNING, logger="megarl.rewards.monitor"):
        for _ in range(batches):
            monitor.check_columns(name, fn, ROWS)
            scores, info = score_samples(fn, PROMPTS, RESPONSES, ROWS)
            warned.append(monitor.observe(name, spec, fn, scores, info))
    return warned


def test_constant_scores_warned_once_naming_the_function(path, caplog):
    monitor, spec = RewardMonitor(), f"{path}:constant"
    warned = _observe(monitor, "function", spec, load_reward_function(spec), 6, caplog)
    assert warned == [False, False, True, False, False, False]
    records = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(records) == 1
    text = records[0].getMessage()
    assert repr(spec) in text and "same score 0" in text and "9 samples of its first 3 scored batches" in text
    assert "wrong calling convention" in text and "constant(prompt, response, row)" in text
    assert "wrong column name (the rows have ['level', 'target'])" in text and "format it parses" in text


@pytest.mark.parametrize("name", ["row_style", "across_batches"])  # 1, 0, 1 in a batch; 0, 0, 0 then 1, 1, 1
def test_varying_scores_not_warned(path, caplog, name):
    assert _observe(RewardMonitor(), "function", f"fns.py:{name}", _load(path, name), 5, caplog) == [False] * 5
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_constant_watch_per_named_function_and_failed_samples_left_out(path, caplog):
    monitor = RewardMonitor()
    varying, constant = _load(path, "row_style"), _load(path, "constant")
    with caplog.at_level(logging.WARNING, logger="megarl.rewards.monitor"):
        for _ in range(3):
            for name, fn in (("correct", varying), ("format", constant)):
                scores, info = score_samples(fn, PROMPTS, RESPONSES, ROWS)
                monitor.observe(name, f"fns.py:{fn.name}", fn, scores, info)
        # a batch whose samples all failed does not count; the failed sample's error_score does not vary it
        assert not monitor.observe("flaky", "x.py:f", constant, torch.tensor([-1.0] * 3), ScoreInfo(3, "e", (0, 1, 2)))
        for _ in range(3):
            assert monitor.observe("flaky", "x.py:f", constant, torch.tensor([0.0, -1.0]), ScoreInfo(1, "e", (1,))) \
                is (_ == 2)
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 2
    assert messages[0].startswith("reward function 'format' ('fns.py:constant') gave every one of the 9 samples")
    assert messages[1].startswith("reward function 'flaky' ('x.py:f') gave every one of the 3 samples")


# ---- the trainer's reward stage ---------------------------------------------------------------------


class _Tokenizer:
    pad_token_id = 0

    def batch_decode(self, ids, skip_special_tokens=True):
        return [RESPONSES[row[0]] for row in ids]  # one token per response: its index


def _reward_stage(path, *overrides):
    """:class:`Experience` (what the trainer's reward stage runs) on a hand-made batch of RESPONSES, no workers."""
    cfg = load_config(EXAMPLE, ["reward.function=null", *overrides])
    fns = {name: resolve_reward_function(spec.function, **spec.options)
           for name, spec in cfg.reward.named_functions().items()}  # what the Trainer builds
    exp = Experience(cfg, None, _Tokenizer(), fns, [], lambda stage, batch: None)
    batch = Batch.from_dict({"input_ids": torch.tensor([[100, i] for i in range(3)]),
                             "response_mask": torch.tensor([[0, 1]] * 3), "prompt_uid": torch.arange(3)})
    records = [PromptRecord(i, p, p, [100], row) for i, (p, row) in enumerate(zip(PROMPTS, ROWS, strict=True))]
    return exp, batch, records


def test_reward_stage_mixes_conventions_checks_columns_and_warns(path, caplog):
    exp, batch, records = _reward_stage(
        path, f"reward.functions.kw.function={path}:trl_keywords", f"reward.functions.batch.function={path}:trl_batch",
        "reward.functions.batch.function_weight=0.5", f"reward.functions.flat.function={path}:constant")
    with caplog.at_level(logging.WARNING, logger="megarl.rewards.monitor"):
        for _ in range(4):
            exp.score(batch, records)
    assert batch["kw_scores"].tolist() == MATCHES and batch["batch_scores"].tolist() == MATCHES
    assert batch["scores"].tolist() == [1.5 * m for m in MATCHES]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("reward function 'flat' (")
    exp, batch, records = _reward_stage(path, f"reward.functions.kw.function={path}:only_named")
    records = [dataclasses.replace(r, row={"answer": r.row["target"]}) for r in records]
    with pytest.raises(ConfigError, match=r"needs the column\(s\) \['target'\].*rows have only \['answer'\]"):
        exp.score(batch, records)
