"""A LoRA policy trained with GRPO while vLLM generates with its adapter (``rollout.engine.lora_sync=adapter``), end to
end: the addition task, LoRA rank 4 / alpha 8 on every linear, lr 2e-3, one rank in a process of its own (the local
launcher: the policy and its vLLM engine at rollout tp 1 in one process, which is what lets the test sabotage the
engine between steps).

- it learns: the reward rises by more than 0.2 in 50 steps (the same run to 150 steps: 0.10 0.24 0.28 0.42 0.46 0.40
  0.46 0.56 0.55 0.59 0.56 0.65 0.61 0.61 0.65 per 10 steps, 68 s, 2026-12-05);
- at every step vLLM's log-probs of its samples equal the training model's with adapters (``rollout/logprob_abs_diff``
  < 1e-5, the other vLLM tests' tolerance);
- the first sync streams the base weights, every later one the adapter alone (``reshard/*`` bytes);
- sabotage after step 50: the next versions reuse the adapter name and id vLLM holds (verl#7495), so vLLM keeps
  serving step 50's adapter with no error of its own; the run stops at step 51 with the rollout check's error, which
  names the stale adapter.

The task needs ``init_std=0.2``: with the frozen output layer of the default 0.02 init the logits stay too flat
for an adapter to move the reward.
"""

from __future__ import annotations

import importlib.util
import statistics

import pytest

from megarl.testing.dist import run_world

pytestmark = [
    pytest.mark.dist, pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (make install brings its CPU build)"),
]

STEPS = 50  # honest steps, then one sabotaged
KEYS = ("reward/mean", "rollout/logprob_abs_diff", "reshard/bytes_kept", "reshard/bytes_received",
        "reshard/adapter_bytes")


def _run(rank, world_size, task, out):
    """The run, in this forked process (the local launcher hosts the policy and vLLM here)."""
    from pathlib import Path

    from megarl.config.train import load_config
    from megarl.rollout.vllm_lora import AdapterVersions
    from megarl.trainer.trainer import run

    example = Path(__file__).resolve().parents[2] / "examples" / "grpo_addition_tiny_vllm" / "config.yaml"
    overrides = {"model.path": f"{task}/model", "data.train": f"{task}/train.jsonl", "data.val": f"{task}/val.jsonl",
                 "trainer.output_dir": out, "trainer.tensorboard": "false", "trainer.save_every": 0,
                 "trainer.val_every": 0, "trainer.total_steps": STEPS + 2, "policy.lora.rank": 4,
                 "policy.lora.alpha": 8, "policy.optim.lr": 2e-3, "rollout.engine.lora_sync": "adapter",
                 "rollout.engine.max_logprob_abs_diff": 1e-4, "cluster.launcher": "local",
                 "cluster.pools.main.devices_per_node": 1, "cluster.pools.main.tp": 1, "rollout.engine.tp": 1}
    history = []

    def reusing(self, tensors, config, version, add, held):
        """The sabotage: a new version under the name and id of the adapter vLLM holds."""
        add(self.current)
        return self.current

    class Sabotage:
        def on_stage_end(self, stage, step, batch):
            pass

        def on_step_end(self, step, metrics):
            history.append({k: metrics[k] for k in KEYS})
            if step == STEPS:
                AdapterVersions.load = reusing

    try:
        run(load_config(example, [f"{k}={v}" for k, v in overrides.items()]), callbacks=(Sabotage(),))
        error = ""
    except Exception as e:  # noqa: BLE001 - the run must stop; the test reads why
        error = f"{type(e).__name__}: {e}"
    return {"history": history, "error": error}


def test_grpo_with_adapter_sync_learns_keeps_parity_and_stops_on_a_stale_adapter(tmp_path):
    from megarl.testing.addition import make_task

    task = make_task(tmp_path / "task", hidden_size=128, init_std=0.2)  # head_dim 32 (vLLM's CPU attention)
    result = run_world(_run, 1, str(task), str(tmp_path / "run"), timeout_s=600)[0]
    history, error = result["history"], result["error"]
    rewards = [m["reward/mean"] for m in history]
    print("GRPO + LoRA, adapter sync on vLLM, mean reward per 10 steps:",
          " ".join(f"{statistics.mean(rewards[i:i + 10]):.2f}" for i in range(0, len(rewards), 10)))
    print("stopped:", error)
    assert len(history) == STEPS, error  # stopped at the sabotaged step, not before, not after
    assert statistics.mean(rewards[-10:]) >= statistics.mean(rewards[:10]) + 0.2
    assert max(m["rollout/logprob_abs_diff"] for m in history) < 1e-5
    first, later = history[0], history[1:]
    assert first["reshard/bytes_kept"] + first["reshard/bytes_received"] > 0
    assert all(m["reshard/bytes_kept"] + m["reshard/bytes_received"] == 0 for m in later)
    assert all(m["reshard/adapter_bytes"] == first["reshard/adapter_bytes"] > 0 for m in later)
    assert "RolloutMismatchError" in error and "lora_sync=adapter" in error and "reused" in error, error


def test_adapter_sync_to_a_rollout_pool_of_its_own(ray_cluster, tmp_path):
    """Split placement (docs/async.md): the policy on one process, one vLLM replica on a pool of its own; the first
    push streams the base weights over the weight link, every push the adapter, sent by training rank 0. Every
    push's parity probe (megarl/rollout/parity.py) and every step's rows equal the training model's."""
    from pathlib import Path

    from megarl.config.train import load_config
    from megarl.testing.addition import make_task
    from megarl.trainer.trainer import run

    task = make_task(tmp_path / "task", hidden_size=128, init_std=0.2)
    example = Path(__file__).resolve().parents[2] / "examples" / "grpo_addition_tiny_vllm" / "config.yaml"
    overrides = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
                 "trainer.output_dir": tmp_path / "run", "trainer.tensorboard": "false", "trainer.save_every": 0,
                 "trainer.val_every": 0, "trainer.total_steps": 3, "policy.lora.rank": 4, "policy.lora.alpha": 8,
                 "policy.optim.lr": 2e-3, "rollout.engine.lora_sync": "adapter", "rollout.engine.tp": 1,
                 "cluster.pools.main.devices_per_node": 1, "cluster.pools.main.tp": 1,
                 "cluster.pools.gen.devices_per_node": 1, "cluster.placement.rollout": "gen"}
    history = run(load_config(example, [f"{k}={v}" for k, v in overrides.items()]))
    assert len(history) == 3
    assert all(m["rollout/push_logprob_abs_diff"] < 1e-5 and m["rollout/logprob_abs_diff"] < 1e-5 for m in history)
    assert history[0]["reshard/bytes_received"] > 0 and all(m["reshard/bytes_received"] == 0 for m in history[1:])
    assert all(m["reshard/adapter_bytes"] == history[0]["reshard/adapter_bytes"] > 0 for m in history)
