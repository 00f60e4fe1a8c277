"""Several reward functions with weights (``reward.functions``; TRL's ``reward_funcs`` + ``reward_weights``).

The trainer's reward stage (:class:`megarl.trainer.experience.Experience`) on a hand-made batch, without
workers: each function scored and logged apart, the reward their weighted sum (checked against a
hand computation), each function's failures under its own ``on_error`` policy. And the config: the
single ``reward.function`` still works, bad lists are refused with what to change.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from megarl.config.checks import check_config
from megarl.config.resolve import resolve
from megarl.config.train import TrainConfig, load_config
from megarl.data.batch import Batch
from megarl.data.prompts import PromptRecord
from megarl.errors import ConfigError
from megarl.rewards import RewardError, resolve_reward_function
from megarl.trainer.experience import Experience

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "grpo_addition_tiny" / "config.yaml"

# the responses, as the fake tokenizer decodes them (one token id per response: its index)
RESPONSES = ["7", "3+4 is 7", "8", "the answer is 7 I think", "boom"]
ROWS = [{"answer": 7}] * 5

LENGTH_FILE = '''
def brevity(prompt, response, row):
    if response == "boom":
        raise ValueError("cannot score this one")
    return len(response) / 10
'''


class _Tokenizer:
    pad_token_id = 0

    def batch_decode(self, ids, skip_special_tokens=True):
        return [RESPONSES[row[0]] for row in ids]


def _batch() -> Batch:
    n = len(RESPONSES)
    return Batch.from_dict({"input_ids": torch.tensor([[100, i] for i in range(n)]),
                            "response_mask": torch.tensor([[0, 1]] * n),
                            "prompt_uid": torch.zeros(n, dtype=torch.long)})


def _experience(cfg: TrainConfig) -> Experience:
    fns = {name: resolve_reward_function(spec.function, **spec.options)
           for name, spec in cfg.reward.named_functions().items()}  # what the Trainer builds
    return Experience(cfg, None, _Tokenizer(), fns, [], lambda stage, batch: None)


def _records() -> list[PromptRecord]:
    return [PromptRecord(0, "3+4=", "3+4=", [100], ROWS[0])]


def _cfg(tmp_path, *overrides) -> TrainConfig:
    (tmp_path / "len.py").write_text(LENGTH_FILE)
    return load_config(EXAMPLE, ["reward.function=null", *overrides])


def test_weighted_functions_scored_and_logged_apart(tmp_path):
    cfg = _cfg(tmp_path, "reward.functions.correct.function=integer_answer",
               "reward.functions.correct.options={match: last}",
               f"reward.functions.brevity.function={tmp_path / 'len.py'}:brevity",
               "reward.functions.brevity.function_weight=-0.5", "reward.functions.brevity.on_error=score",
               "reward.functions.brevity.error_score=-1")
    exp = _experience(cfg)
    batch = _batch()
    num_errors = exp.score(batch, _records())
    # by hand: "last integer == 7" and len/10 (the failing "boom" scores error_score -1)
    correct = [1.0, 1.0, 0.0, 1.0, 0.0]
    brevity = [0.1, 0.8, 0.1, 2.3, -1.0]
    expected = [c - 0.5 * b for c, b in zip(correct, brevity, strict=True)]
    assert num_errors == 1
    assert torch.allclose(batch["correct_scores"].double(), torch.tensor(correct, dtype=torch.float64))
    assert torch.allclose(batch["brevity_scores"].double(), torch.tensor(brevity, dtype=torch.float64), atol=1e-7)
    assert torch.allclose(batch["scores"].double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6)
    metrics = exp.reward_metrics(batch, "reward", num_errors)
    assert metrics["reward/correct_mean"] == pytest.approx(statistics.fmean(correct))
    assert metrics["reward/correct_std"] == pytest.approx(statistics.stdev(correct))
    assert metrics["reward/brevity_mean"] == pytest.approx(statistics.fmean(brevity), abs=1e-6)
    assert metrics["reward/brevity_std"] == pytest.approx(statistics.stdev(brevity), abs=1e-6)
    assert metrics["reward/mean"] == pytest.approx(statistics.fmean(expected), abs=1e-6)
    assert metrics["reward/num_errors"] == 1.0


def test_each_function_has_its_own_error_policy(tmp_path):
    cfg = _cfg(tmp_path, "reward.functions.correct.function=integer_answer",
               f"reward.functions.brevity.function={tmp_path / 'len.py'}:brevity")  # on_error: raise (default)
    with pytest.raises(RewardError, match="brevity failed on sample 4.*cannot score this one"):
        _experience(cfg).score(_batch(), _records())


def test_single_function_unchanged(tmp_path):
    cfg = load_config(EXAMPLE, ["reward.function_weight=2"])
    assert list(cfg.reward.named_functions()) == ["function"]
    batch = _batch()
    exp = _experience(cfg)
    exp.score(batch, _records())
    first = [1.0, 0.0, 0.0, 1.0, 0.0]  # integer_answer's default match: the first integer anywhere ("3" in "3+4")
    assert torch.equal(batch["function_scores"], torch.tensor(first))
    assert torch.equal(batch["scores"], 2 * torch.tensor(first))
    metrics = exp.reward_metrics(batch, "reward", 0)
    assert metrics["reward/function_mean"] == pytest.approx(0.4) and "reward/function_std" not in metrics


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from megarl.testing.addition import make_task

    return make_task(tmp_path_factory.mktemp("addition"), train_rows=16, val_rows=4)


def _load(task, *overrides) -> TrainConfig:
    base = [f"model.path={task / 'model'}", f"data.train={task / 'train.jsonl'}", f"data.val={task / 'val.jsonl'}"]
    return load_config(EXAMPLE, [*base, *overrides])


@pytest.mark.parametrize("overrides, match", [
    (["reward.functions.correct.function=integer_answer"],
     "reward.functions names \\['correct'\\] and reward.function is 'integer_answer' .* Set reward.function: null"),
    (["reward.function=null", "reward.functions.model.function=integer_answer"],
     "reward.functions.model: a reward function's name must be an identifier .* other than"),
    (["reward.function=null", "reward.functions.a-b.function=integer_answer"], "must be an identifier"),
    (["reward.function=null", "reward.functions.correct.function=null"], "reward.functions.correct.function is null"),
    (["reward.function=null", "reward.functions.correct.function_weight=.inf"],
     "reward.functions.correct.function_weight must be a finite number"),
    (["reward.function=null", "reward.functions.correct.weight=2"],
     "unknown config key 'reward.functions.correct.weight'; valid keys: .*'function_weight'"),
])
def test_bad_reward_functions_are_named(task, overrides, match):
    with pytest.raises(ConfigError, match=match):
        check_config(_load(task, *overrides))


def test_reward_functions_resolve_their_paths(task, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _load(task, "reward.function=null", "reward.functions.mine.function=rewards/mine.py:score",
                "reward.functions.builtin.function=gsm8k")
    check_config(cfg)
    r = resolve(cfg).reward
    assert r.functions["mine"].function == str(tmp_path / "rewards" / "mine.py") + ":score"
    assert r.functions["builtin"].function == "gsm8k" and r.function is None


def test_one_named_function_is_logged_by_its_name(tmp_path):
    cfg = _cfg(tmp_path, "reward.functions.correct.function=integer_answer")
    batch = _batch()
    exp = _experience(cfg)
    exp.score(batch, _records())
    metrics = exp.reward_metrics(batch, "reward", 0)
    assert metrics["reward/correct_mean"] == pytest.approx(0.4)  # first integer: "7", "3", "8", "7", none
    assert metrics["reward/correct_std"] == pytest.approx(statistics.stdev([1.0, 0.0, 0.0, 1.0, 0.0]))


def test_a_column_no_row_has_is_refused_before_any_worker_starts(task, tmp_path):
    """A keyword-style reward needing ``target`` on rows that hold only ``answer``: a ConfigError from the
    Trainer's constructor (before the run directory is locked or Ray imported), naming both."""
    from megarl.trainer.trainer import Trainer

    (tmp_path / "succ.py").write_text("def reward(prompt, response, *, target, **_):\n"
                                      "    return float(response == target)\n")
    cfg = _load(task, f"reward.function={tmp_path / 'succ.py'}:reward", f"trainer.output_dir={tmp_path / 'out'}")
    with pytest.raises(ConfigError, match=r"needs the column\(s\) \['target'\].* only \['answer'\]"):
        Trainer(cfg)
    assert not (tmp_path / "out").exists()
