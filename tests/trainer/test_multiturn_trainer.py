"""The trainer with multi-turn rollouts (issue #25): examples/multiturn_lookup_tiny, where an environment reveals a
digit drawn for each conversation after the model's first turn and scores the second turn against it, on the
session's Ray cluster (policy TP2 with its embedded rollout engines, reference colocated).

References: the task itself -- the digit is independent of everything the model sees before the reveal, so a
policy that ignores the observation earns at most 1/10 in expectation; a rise of 0.2 needs the observation -- and
the training model's own log-probs of every sampled token of every model turn (``rollout/logprob_abs_diff``).
"""

from __future__ import annotations

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
        # two model turns of at most 2 tokens and the reveal's observation between them
        assert 4.0 <= m["response/length_mean"] <= 8.0
        # the second turn's prompt starts with the first turn's prompt and response, whose KV its engine kept: at
        # most half of all prompt tokens (the first turn's are all new), and none reused would mean nothing kept
        assert 0.25 < m["multiturn/prompt_tokens_reused"] < 0.5


def test_ppo_with_a_critic_runs_and_resumes(ray_cluster, task, tmp_path):
    """GAE over the model tokens (observation tokens skipped), a critic trained on them; stopped after its step-4
    checkpoint and run again to step 6, it continues from there."""
    from megarl.metrics.tracking import read_metrics

    ppo = {"algorithm.advantage.estimator": "gae", "algorithm.kl_loss_coef": 0, "critic.optim.lr": "5e-3",
           "trainer.save_every": 2}
    first = _run(task, tmp_path / "ppo", **ppo, **{"trainer.total_steps": 4})
    second = _run(task, tmp_path / "ppo", **ppo, **{"trainer.total_steps": 6})
    assert len(first) == 4 and len(second) == 2
    assert [m["step"] for m in read_metrics(tmp_path / "ppo")] == [1, 2, 3, 4, 5, 6]
    for m in first + second:
        assert "critic/vf_loss" in m and m["rollout/logprob_abs_diff"] < 1e-5
