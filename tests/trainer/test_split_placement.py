"""Split placement of the roles beside the policy (issue #23, item 1, first part): the reference, or the
critic, on a pool of its own.

The demo's GRPO (policy + its embedded rollout engine, KL loss to a reference), and PPO with a GAE critic,
each run twice on the test session's Ray cluster with the same seeds: colocated (one pool, one process
hosting the roles) and split (the reference or the critic on a second pool, in a process of its own).
Reference: the colocated run, step for step (every metric but timings and memory within 1e-5 relative),
and the worker processes each role ran in.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_addition_tiny" / "config.yaml"
NOT_COMPARED = ("timing/", "throughput/", "memory/")


def _train(task, out, extra):
    from megarl.config.train import load_config
    from megarl.trainer.trainer import Trainer

    overrides = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
                 "trainer.output_dir": out, "trainer.tensorboard": "false", "trainer.total_steps": 3,
                 "trainer.save_every": 0, "trainer.val_every": 0, "data.batch_size": 4, "rollout.sampling.n": 4,
                 "cluster.pools.main.devices_per_node": 1, "cluster.pools.main.tp": 1} | extra
    trainer = Trainer(load_config(EXAMPLE, [f"{k}={v}" for k, v in overrides.items()]))
    try:
        history = trainer.fit()
        pids = {name: [ctx.pid for ctx in group.contexts] for name, group in trainer.cluster.placement.groups.items()}
        placement = dict(trainer.cfg.cluster.placement)
    finally:
        trainer.close()
    return history, pids, placement


def test_reference_on_its_own_pool_matches_the_colocated_run(ray_cluster, tmp_path):
    from megarl.testing.addition import make_task

    task = make_task(tmp_path / "task", train_rows=64, val_rows=8)
    colocated, colocated_pids, colocated_placement = _train(task, tmp_path / "colocated", {})
    split, split_pids, split_placement = _train(task, tmp_path / "split", {
        "cluster.pools.ref.devices_per_node": 1, "cluster.placement.reference": "ref"})
    assert colocated_placement == {"policy": "main", "rollout": "main", "reference": "main"}
    assert len(colocated_pids) == 1
    assert split_placement == {"policy": "main", "rollout": "main", "reference": "ref"}
    assert set(split_pids) == {"main", "ref"} and not set(split_pids["main"]) & set(split_pids["ref"])
    assert len(colocated) == len(split) == 3
    for step, (ours, ref) in enumerate(zip(split, colocated, strict=True), start=1):
        keys = [k for k in ref if not k.startswith(NOT_COMPARED)]
        assert set(keys) <= set(ours)
        for k in keys:
            assert math.isclose(ours[k], ref[k], rel_tol=1e-5, abs_tol=1e-7), (step, k, ours[k], ref[k])
    assert split[-1]["actor/kl"] > 0  # the reference's log-probs reached the loss


def test_critic_on_its_own_pool_matches_the_colocated_run(ray_cluster, tmp_path):
    """PPO with a GAE critic: the critic's values and updates come from a pool of its own."""
    from megarl.testing.addition import make_task

    task = make_task(tmp_path / "task", train_rows=64, val_rows=8)
    ppo = {"algorithm.advantage.estimator": "gae", "algorithm.kl_loss_coef": 0, "critic.optim.lr": "5e-3"}
    colocated, _, _ = _train(task, tmp_path / "colocated", ppo)
    split, pids, placement = _train(task, tmp_path / "split", ppo | {
        "cluster.pools.values.devices_per_node": 1, "cluster.placement.critic": "values"})
    assert placement == {"policy": "main", "rollout": "main", "critic": "values"}
    assert not set(pids["main"]) & set(pids["values"])
    for step, (ours, ref) in enumerate(zip(split, colocated, strict=True), start=1):
        for k in (k for k in ref if not k.startswith(NOT_COMPARED)):
            assert math.isclose(ours[k], ref[k], rel_tol=1e-5, abs_tol=1e-7), (step, k, ours[k], ref[k])
    assert split[-1]["critic/vf_loss"] > 0
