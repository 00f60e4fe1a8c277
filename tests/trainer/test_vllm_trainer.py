"""The trainer on the vLLM backend (vLLM's CPU build) end to end, on the session's Ray cluster: GRPO learns the
addition task with vLLM generating, and PPO with a critic runs its whole loop with two vLLM replicas on a
rollout pool of their own.

References: the task itself (a random policy answers ~7% right; what counts is a clear rise) and the
training model's own log-probs of every sampled token (``rollout/logprob_abs_diff``): after every update
the weights vLLM samples with must be the updated ones.
"""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.dist, pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (make install brings its CPU build)"),
]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_addition_tiny_vllm" / "config.yaml"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from megarl.testing.addition import make_task

    return make_task(tmp_path_factory.mktemp("addition_vllm"), hidden_size=128)  # head_dim 32 (vLLM's CPU attention)


def _run(task, out, **extra):
    from megarl.config.train import load_config
    from megarl.trainer.trainer import run

    base = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
            "trainer.output_dir": out, "trainer.tensorboard": "false", "trainer.save_every": 0}
    return run(load_config(EXAMPLE, [f"{k}={v}" for k, v in (base | extra).items()]))


def _shared_memory() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir()}


def test_grpo_on_vllm_learns_addition(ray_cluster, task, tmp_path):
    before = _shared_memory()
    # 70 of the example's 100 steps: the reward per 10 steps was 0.12 0.16 0.21 0.30 0.34 0.38 0.54 (2026-12-03)
    history = _run(task, tmp_path / "grpo", **{"trainer.total_steps": 70})
    # vLLM's TP-group message queue and CPU communicator segments are released when the workers shut down
    assert not {n for n in _shared_memory() - before if n.startswith("psm_") or "cpushm" in n}
    rewards = [m["reward/mean"] for m in history]
    start, end = statistics.mean(rewards[:10]), statistics.mean(rewards[-20:])
    print("GRPO on vLLM, mean reward per 10 steps:",
          " ".join(f"{statistics.mean(rewards[i:i + 10]):.2f}" for i in range(0, len(rewards), 10)))
    assert len(history) == 70 and end >= start + 0.2, (start, end)
    assert all(m["rollout/logprob_abs_diff"] < 1e-5 for m in history)
    assert all(m["rollout/sleep_frees_memory"] == 0.0 for m in history)  # vLLM cannot sleep on CPU
    assert "val/reward/mean" in history[24]  # greedy validation through vLLM


def test_ppo_with_critic_on_a_vllm_rollout_pool(ray_cluster, task, tmp_path):
    """Two vLLM replicas (rollout tp 1) on a pool of their own, fed by the TP2 policy over the weight link
    (full-shape tensors, each rank's slice filled); the training model's log-probs equal vLLM's after every
    update, on the step's rows and on every push's parity probe."""
    history = _run(task, tmp_path / "ppo", **{"rollout.engine.tp": 1, "algorithm.advantage.estimator": "gae",
                                               "algorithm.kl_loss_coef": 0, "trainer.total_steps": 5,
                                               "trainer.val_every": 0, "cluster.pools.gen.devices_per_node": 2,
                                               "cluster.placement.rollout": "gen"})
    assert len(history) == 5 and "critic/vf_loss" in history[0]
    assert all(m["rollout/logprob_abs_diff"] < 1e-5 for m in history)
    assert all(m["reshard/bytes_received"] > 0 and m["reshard/bytes_kept"] == 0 for m in history)
    # every push's probe (megarl/rollout/parity.py) on both vLLM replicas, at the sampling temperature
    assert all(m["rollout/push_logprob_abs_diff"] < 1e-5 for m in history)
