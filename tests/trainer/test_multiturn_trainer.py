"""The trainer with multi-turn rollouts (issue #25): examples/multiturn_lookup_tiny, where an environment reveals a
digit drawn for each conversation after the model's first turn and scores the second turn against it, on the
session's Ray cluster (policy TP2 with its embedded rollout engines, reference colocated).

References: the task itself -- the digit is independent of everything the model sees before the reveal, so a
policy that ignores the observation earns at most 1/10 in expectation; a rise of 0.2 needs the observation -- and
the training model's own log-probs of every sampled token of every model turn (``rollout/logprob_abs_diff``). The
token counts by hand: a model turn is one or two tokens (a digit and ``<|end|>``), the reveal three
(``<|user|>``, the digit, ``<|assistant|>``) plus the ``<|end|>`` the template closes a cut turn with.

The PPO run talks to an environment that fails one environment call in ten (``on_env_error: score``): every
failure's text lands in ``env_errors.jsonl`` of the run directory, and the first of each kind in the log.
"""

from __future__ import annotations

import json
import logging
import re
import statistics
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "multiturn_lookup_tiny"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from megarl.testing.lookup import make_task

    return make_task(tmp_path_factory.mktemp("lookup"))


def _run(task, out, **extra):
    from megarl.config.train import load_config
    from megarl.trainer.trainer import run

    base = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
            "rollout.multi_turn.environment": f"{EXAMPLE / 'env.py'}:HiddenDigit", "trainer.output_dir": out,
            "trainer.tensorboard": "false", "trainer.save_every": 0, "trainer.val_every": 0}
    return run(load_config(EXAMPLE / "config.yaml", [f"{k}={v}" for k, v in (base | extra).items()]))


def test_grpo_learns_to_use_the_observation(ray_cluster, task, tmp_path):
    history = _run(task, tmp_path / "grpo", **{"trainer.total_steps": 40})
    rewards = [m["reward/mean"] for m in history]
    start, end = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
    print(f"multi-turn GRPO reward: first 10 steps {start:.3f}, last 10 {end:.3f}")
    assert len(history) == 40 and end > start + 0.2 and end > 0.3  # above what ignoring the digit can earn (0.1)
    for m in history:
        assert m["rollout/logprob_abs_diff"] < 1e-5  # every model turn's rollout log-probs are the trainer's
        assert m["multiturn/turns_mean"] == 2.0 and m["multiturn/env_errors"] == 0.0
        # the model's tokens: two turns of one or two; the environment's: the reveal, 3 tokens (4 after a cut turn)
        assert 2.0 <= m["response/length_mean"] <= m["response/length_max"] <= 4.0
        assert 3.0 <= m["response/env_tokens_mean"] <= m["response/env_tokens_max"] <= 4.0
        assert m["rollout/num_tokens"] == m["response/length_mean"] * 256  # 16 prompts x 16 conversations
        # the second turn's prompt starts with the first turn's prompt and response, whose KV its engine kept: at
        # most half of all prompt tokens (the first turn's are all new), and none reused would mean nothing kept
        assert 0.25 < m["multiturn/prompt_tokens_reused"] < 0.5


FLAKY_ENV = """
import random

from megarl.multiturn import Step


class FlakyDigit:  # examples/multiturn_lookup_tiny/env.py's HiddenDigit, failing one call in ten
    made = 0

    def __init__(self):
        FlakyDigit.made += 1
        self.k, self.turns = FlakyDigit.made, 0
        self.digit = str(random.Random(self.k).randrange(10))

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        self.turns += 1
        if self.turns == 1:
            if self.k % 10 == 3:
                raise KeyError(f"no digit for conversation {self.k}")
            return Step([{"role": "user", "content": self.digit}])
        first = next((c for c in text if c.isdigit()), None)
        return Step([], reward=float("nan") if self.k % 10 == 7 else float(first == self.digit), done=True)
"""


def test_ppo_with_a_critic_runs_and_resumes(ray_cluster, task, tmp_path, caplog):
    """GAE over the model tokens (observation tokens skipped), a critic trained on them; stopped after its step-4
    checkpoint and run again to step 6, it continues from there. Conversations 3, 13, 23, ... fail in their first
    environment step (KeyError) and 7, 17, ... in their second (a NaN reward): 2 of 19 calls."""
    from megarl.metrics.tracking import read_metrics

    env = tmp_path / "flaky_env.py"
    env.write_text(FLAKY_ENV)
    ppo = {"algorithm.advantage.estimator": "gae", "algorithm.kl_loss_coef": 0, "critic.optim.lr": "5e-3",
           "trainer.save_every": 2, "rollout.multi_turn.environment": f"{env}:FlakyDigit",
           "rollout.multi_turn.on_env_error": "score"}
    out = tmp_path / "ppo"
    with caplog.at_level(logging.WARNING, logger="megarl.multiturn.errors"):
        first = _run(task, out, **ppo, **{"trainer.total_steps": 4})
        second = _run(task, out, **ppo, **{"trainer.total_steps": 6})
    assert len(first) == 4 and len(second) == 2
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4, 5, 6]
    for m in first + second:
        assert "critic/vf_loss" in m and m["rollout/logprob_abs_diff"] < 1e-5

    kinds = {"KeyError in FlakyDigit.step": (1, r"FlakyDigit.step \(row \d+, turn 1\) raised KeyError: 'no digit "
                                                r"for conversation (\d+)'"),
             "invalid result from FlakyDigit.step": (2, r"FlakyDigit.step \(row \d+, turn 2\) returned the reward "
                                                       r"nan; expected a finite number")}
    lines = [json.loads(line) for line in (out / "env_errors.jsonl").read_text().splitlines()]
    counts = {}  # (step, kind) -> failures
    for r in lines:
        turn, message = kinds[r["kind"]]
        assert r["phase"] == "train" and r["turn"] == turn and r["ended"], r
        match = re.fullmatch(message, r["message"])
        assert match and (turn == 2 or int(match[1]) % 10 == 3), r
        assert ("KeyError: 'no digit" in r["traceback"]) == (turn == 1)
        counts[r["step"], r["kind"]] = r["kind_count"]
    assert sorted(counts) == [(step, kind) for step in range(1, 7) for kind in sorted(kinds)]
    for step, m in enumerate(first + second, start=1):  # every failure of the step, under its kind; ~1 call in 10
        failed = [counts[step, kind] for kind in kinds]
        assert sum(failed) == m["multiturn/env_errors"]
        assert 0.09 < sum(failed) / (256 + 256 - failed[0]) < 0.12  # 256 first calls, a second for those that passed
        # the model's tokens: one or two turns of one or two; the environment's: one reveal (3-4) unless the first
        # step failed
        assert 1.0 <= m["response/length_mean"] <= m["response/length_max"] <= 4.0
        assert 3.0 * (1 - failed[0] / 256) <= m["response/env_tokens_mean"] <= m["response/env_tokens_max"] <= 4.0
    # the first of each kind in the log, once per run (two runs), naming the file
    firsts = sorted(r.getMessage() for r in caplog.records if r.getMessage().startswith("multi-turn: first"))
    assert [w.split(" (")[0] for w in firsts] == sorted(2 * [f"multi-turn: first {kind}" for kind in kinds])
    assert all(f"every one's text goes to {out / 'env_errors.jsonl'}" in w for w in firsts)
