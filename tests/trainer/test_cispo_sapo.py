"""CISPO and SAPO policy losses in whole trainer runs of the tiny addition task (the GRPO demo, loss swapped).

The reference is the task itself, as in test_end_to_end.py: a random policy answers ~7% of prompts
correctly, and a loss that trains must lift the mean reward clearly within the demo's 100 steps.
The demo's two mini-batches per step make the second one off-policy (old log-probs recomputed), so
CISPO's weight clip and SAPO's gate act on ratios other than 1. Each run: ~40-60 s (local launcher).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.metrics.tracking import read_metrics

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "grpo_addition_tiny" / "config.yaml"
# one rank in the driver process (cluster.launcher=local): no worker start-up, both cores for one rank
LOCAL = {"cluster.launcher": "local", "cluster.pools.main.devices_per_node": 1, "cluster.pools.main.tp": 1}


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from megarl.testing.addition import make_task

    return make_task(tmp_path_factory.mktemp("addition"))


# Both at their defaults (CISPO: no floor, weight <= 5; SAPO: tau_pos 1.0, tau_neg 1.05) and the demo's lr.
@pytest.mark.parametrize("loss", ["cispo", "sapo"])
def test_loss_learns_addition(task, tmp_path, loss):
    out = tmp_path / loss
    overrides = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
                 "trainer.output_dir": out, "trainer.tensorboard": "false", "trainer.save_every": 0,
                 "trainer.val_every": 0, "algorithm.policy_loss.loss": loss, **LOCAL}
    cmd = [sys.executable, "-m", "megarl.train", str(EXAMPLE), *[f"{k}={v}" for k, v in overrides.items()]]
    proc = subprocess.run(cmd, cwd=ROOT, timeout=1200, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"loss: {loss}" in (out / "config.yaml").read_text()
    history = read_metrics(out)
    rewards = [m["reward/mean"] for m in history]
    start, end = statistics.mean(rewards[:10]), statistics.mean(rewards[-20:])
    clip = statistics.mean(m["actor/clip_frac"] for m in history)
    print(f"{loss.upper()} reward: first 10 steps {start:.3f}, last 20 steps {end:.3f}; mean clip_frac {clip:.4f}")
    assert len(history) == 100
    assert end >= start + 0.2
