"""GRPO with LoRA through the trainer (issue #45): examples/grpo_lora_addition_tiny (rank-4 adapters on every linear,
policy TP2 on the session's Ray cluster, merged weights synced into the embedded rollout engines, the base model as
the KL loss's reference).

References: the task (a clear rise of the reward), the rollout-parity metric at every step (the engines' log-probs
are the trained policy's, adapters included), and a sabotaged sync (the engines given the base weights without the
adapter) that must stop the run at the first step whose rollout follows an update.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "grpo_lora_addition_tiny" / "config.yaml"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from megarl.testing.addition import make_task

    return make_task(tmp_path_factory.mktemp("lora_addition"), init_std=0.2)


def _overrides(task, out, **extra):
    base = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
            "trainer.output_dir": out, "trainer.tensorboard": "false"}
    return [f"{k}={v}" for k, v in (base | extra).items()]


def test_grpo_with_lora_learns_with_merged_sync(ray_cluster, task, tmp_path):
    from megarl.config.train import load_config
    from megarl.trainer.trainer import run

    cfg = load_config(EXAMPLE, _overrides(task, tmp_path / "run", **{"trainer.total_steps": 60,
                                                                       "trainer.val_every": 0}))
    assert [r.value for r in cfg.roles()] == ["policy", "rollout"]  # the base model is the reference: no role
    history = run(cfg)
    rewards = [m["reward/mean"] for m in history]
    start, end = statistics.mean(rewards[:10]), statistics.mean(rewards[-20:])
    print(f"GRPO + LoRA reward: first 10 steps {start:.3f}, last 20 steps {end:.3f}")
    assert end > start + 0.2
    # rollout parity every step: the engines sampled from the trained policy, adapters included
    assert max(m["rollout/logprob_abs_diff"] for m in history) < 1e-5
    # the KL loss's reference is the base model: 0 before the first update (B = 0), then the adapters' distance
    assert history[0]["actor/kl"] == pytest.approx(0.0, abs=1e-7) and history[-1]["actor/kl"] > 1e-3
    # the weight sync moved whole (merged) weights, not factors: as many bytes as a full fine-tuning run's
    assert history[-1]["reshard/bytes_kept"] + history[-1]["reshard/bytes_received"] > 0


def test_a_sync_without_the_adapter_stops_the_run(task, tmp_path, monkeypatch):
    """The engines get the base weights without the adapter (a sync that lost it): the run stops at step 2, the
    first rollout after an update, with the parity error (at step 1 the adapter is zero: the weights are equal)."""
    from megarl.config.train import load_config
    from megarl.engine.engine import MegatronEngine
    from megarl.metrics.tracking import read_metrics
    from megarl.models.provider import global_named_parameters
    from megarl.rollout.mismatch import RolloutMismatchError
    from megarl.trainer.trainer import run

    def unmerged(engine):
        return {n: p for c in engine.chunks for n, p in global_named_parameters(c) if "lora_" not in n}

    monkeypatch.setattr(MegatronEngine, "weights", unmerged)
    local = {"cluster.launcher": "local", "cluster.pools.main.devices_per_node": 1, "cluster.pools.main.tp": 1}
    out = tmp_path / "sabotaged"
    cfg = load_config(EXAMPLE, _overrides(task, out, **{"trainer.total_steps": 5, "trainer.val_every": 0,
                                                        "trainer.save_every": 0, **local}))
    with pytest.raises(RolloutMismatchError, match="weight sync"):
        run(cfg)
    assert [m["step"] for m in read_metrics(out)] == [1]


def test_grpo_with_lora_learns_asynchronously_on_a_rollout_pool(ray_cluster, task, tmp_path):
    """The fully asynchronous schedule with the rollout engines on a pool of their own: merged weights pushed over
    the cross-pool link, every push checked by the probe (the replica's log-probs against the trained policy's,
    adapters included), the base model the KL loss's reference on the policy's workers."""
    from megarl.config.train import load_config
    from megarl.trainer.trainer import run

    extra = {"cluster.pools.main.devices_per_node": 1, "cluster.pools.main.tp": 1,
             "cluster.pools.gen.devices_per_node": 1, "cluster.placement.rollout": "gen",
             "rollout.schedule": "async", "trainer.total_steps": 60, "trainer.save_every": 0, "trainer.val_every": 0}
    history = run(load_config(EXAMPLE, _overrides(task, tmp_path / "async", **extra)))
    rewards = [m["reward/mean"] for m in history]
    start, end = statistics.mean(rewards[:10]), statistics.mean(rewards[-20:])
    print(f"async GRPO + LoRA reward: first 10 steps {start:.3f}, last 20 steps {end:.3f}")
    assert end > start + 0.2
    assert max(m["rollout/push_logprob_abs_diff"] for m in history) < 1e-5
    assert max(m["async/version_lag_max"] for m in history) >= 1  # the rows were sampled by older adapters
