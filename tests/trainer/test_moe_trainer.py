"""The trainer on a Qwen3-MoE model at expert parallelism: GRPO on the tiny addition task
(examples/grpo_addition_moe: 4 experts, top 2, policy TP1 x DP2 x EP2 on two Ray workers, embedded engines, router
replay on).

References: the task itself (a random policy answers correctly ~7% of the time: the reward must rise by 0.2),
the training model's own log-probs (every rollout token's log-prob equals the trainer's recomputation, so the
experts reached every rollout engine), and the router's load statistics (a share of routed tokens: between 0
and the number of experts, the largest at least 1).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "grpo_addition_moe" / "config.yaml"


def test_grpo_learns_addition_with_an_moe_policy_at_ep2(ray_cluster, tmp_path):
    from megarl.config.train import load_config
    from megarl.testing.addition import make_task
    from megarl.trainer.trainer import run

    task = make_task(tmp_path / "task", num_experts=4, top_k=2)
    overrides = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
                 "trainer.output_dir": tmp_path / "run", "trainer.tensorboard": "false", "trainer.save_every": 0,
                 "trainer.val_every": 0}
    history = run(load_config(EXAMPLE, [f"{k}={v}" for k, v in overrides.items()]))
    rewards = [m["reward/mean"] for m in history]
    start, end = statistics.mean(rewards[:10]), statistics.mean(rewards[-20:])
    print(f"MoE GRPO reward: first 10 steps {start:.3f}, last 20 steps {end:.3f}")
    assert len(history) == 100 and end > start + 0.2
    assert all(m["rollout/logprob_abs_diff"] < 1e-5 for m in history)  # every engine holds the trained experts
    for m in history:
        assert 1.0 <= m["actor/moe_load_max"] <= 4.0 and 0.0 <= m["actor/moe_load_min"] <= 1.0
        assert m["actor/moe_load_balancing_loss"] > 0  # coefficient 0.001 in the example
        assert m["actor/moe_replay_mismatch"] == 0  # router replay: every token went to the rollout's experts
        # the update's second mini-batch runs after an optimizer step: its own choices drift from the rollout's
        assert 0.0 <= m["actor/moe_routing_disagreement"] <= 1.0
