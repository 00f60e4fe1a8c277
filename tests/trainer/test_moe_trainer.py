"""The trainer on a Qwen3-MoE model at expert parallelism: GRPO on the tiny addition task
(examples/grpo_addition_moe: 4 experts, top 2, policy TP1 x DP2 x EP2 on two Ray workers, embedded engines, router
replay on); and the same policy feeding a vLLM replica at rollout TP 2 on a pool of its own (each vLLM rank gets
half of every expert's width).

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
                 "trainer.val_every": 0,
                 # 60 of the example's 100 steps: reward per 10 steps 0.09 0.14 0.20 0.33 0.44 0.46 (2026-12-03)
                 "trainer.total_steps": 60}
    history = run(load_config(EXAMPLE, [f"{k}={v}" for k, v in overrides.items()]))
    rewards = [m["reward/mean"] for m in history]
    start, end = statistics.mean(rewards[:10]), statistics.mean(rewards[-20:])
    print(f"MoE GRPO reward: first 10 steps {start:.3f}, last 20 steps {end:.3f}")
    assert len(history) == 60 and end > start + 0.2
    assert all(m["rollout/logprob_abs_diff"] < 1e-5 for m in history)  # every engine holds the trained experts
    for m in history:
        assert 1.0 <= m["actor/moe_load_max"] <= 4.0 and 0.0 <= m["actor/moe_load_min"] <= 1.0
        assert m["actor/moe_load_balancing_loss"] > 0  # coefficient 0.001 in the example
        assert m["actor/moe_replay_mismatch"] == 0  # router replay: every token went to the rollout's experts
        # the update's second mini-batch runs after an optimizer step: its own choices drift from the rollout's
        assert 0.0 <= m["actor/moe_routing_disagreement"] <= 1.0


def test_moe_policy_feeds_vllm_at_rollout_tp2_on_its_own_pool(ray_cluster, tmp_path):
    """vLLM (CPU build, head_dim 32) as the MoE policy's rollout engine: one replica of TP 2 on a pool of two
    processes, fed by the two EP ranks over the weight link. Every step's rollout log-probs equal the training
    model's (so every vLLM rank holds its half of every updated expert; the plan's bytes are checked in
    tests/unit/test_resharding_moe.py), and vLLM's rows carry no routing (no replay on CPU)."""
    from megarl.config.train import load_config
    from megarl.testing.addition import make_task
    from megarl.trainer.trainer import run

    task = make_task(tmp_path / "task", num_experts=4, top_k=2, hidden_size=128)
    overrides = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
                 "trainer.output_dir": tmp_path / "run", "trainer.tensorboard": "false", "trainer.save_every": 0,
                 "trainer.val_every": 0, "trainer.total_steps": 4, "policy.router_replay": "false",
                 "rollout.engine.backend": "vllm", "rollout.engine.tp": 2, "rollout.engine.enforce_eager": "true",
                 "rollout.engine.kv_cache_mb": 64, "rollout.engine.max_model_len": 16,
                 "cluster.pools.gen.devices_per_node": 2, "cluster.pools.gen.tp": 2,
                 "cluster.placement.rollout": "gen"}
    history = run(load_config(EXAMPLE, [f"{k}={v}" for k, v in overrides.items()]))
    assert len(history) == 4
    assert all(m["rollout/logprob_abs_diff"] < 1e-5 and m["reshard/bytes_received"] > 0 for m in history)
    assert not any("moe_routing_disagreement" in k for k in history[0])
    assert all(m["actor/moe_load_balancing_loss"] > 0 for m in history)
