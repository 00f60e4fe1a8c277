"""Split placement of the roles beside the policy (issue #23, item 1, first part): the reference, or the
critic, on a pool of its own.

PPO with a GAE critic and the demo's KL loss to a reference (policy + its embedded rollout engine), run twice on
the test session's Ray cluster with the same seeds: colocated (one pool, one process hosting the roles) and split
(the reference and the critic each on a pool of its own, in a process of its own).
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


def test_reference_and_critic_on_pools_of_their_own_match_the_colocated_run(ray_cluster, tmp_path):
    """PPO with a GAE critic and the demo's KL loss to the reference: the reference's log-probs and the critic's
    values and updates come from two pools of their own, each in a process of its own."""
    from megarl.testing.addition import make_task

    task = make_task(tmp_path / "task", train_rows=64, val_rows=8)
    ppo = {"algorithm.advantage.estimator": "gae", "critic.optim.lr": "5e-3"}
    colocated, colocated_pids, colocated_placement = _train(task, tmp_path / "colocated", ppo)
    split, split_pids, split_placement = _train(task, tmp_path / "split", ppo | {
        "cluster.pools.ref.devices_per_node": 1, "cluster.placement.reference": "ref",
        "cluster.pools.values.devices_per_node": 1, "cluster.placement.critic": "values"})
    assert colocated_placement == {"policy": "main", "rollout": "main", "reference": "main", "critic": "main"}
    assert len(colocated_pids) == 1
    assert split_placement == {"policy": "main", "rollout": "main", "reference": "ref", "critic": "values"}
    assert set(split_pids) == {"main", "ref", "values"}
    assert len({pid for pids in split_pids.values() for pid in pids}) == 3  # three processes, one per pool
    assert len(colocated) == len(split) == 3
    for step, (ours, ref) in enumerate(zip(split, colocated, strict=True), start=1):
        keys = [k for k in ref if not k.startswith(NOT_COMPARED)]
        assert set(keys) <= set(ours)
        for k in keys:
            assert math.isclose(ours[k], ref[k], rel_tol=1e-5, abs_tol=1e-7), (step, k, ours[k], ref[k])
    assert split[-1]["actor/kl"] > 0  # the reference's log-probs reached the loss
    assert split[-1]["critic/vf_loss"] > 0


def test_packed_and_padded_grpo_runs_agree_step_for_step(ray_cluster, tmp_path):
    """Issue #46: the demo's GRPO with its KL loss to the reference, three steps, with the micro-batches packed (the
    default) and right-padded (``policy.packing=false``; the reference's engine is the policy's): every metric but
    timings and memory within 1e-5 relative, step for step (the rollouts stay the same: sampling sees weights that
    differ by rounding only); the training-vs-rollout log-prob gap and the mismatch metrics, measures of rounding
    themselves, within 1e-6."""
    from megarl.testing.addition import make_task

    task = make_task(tmp_path / "task", train_rows=64, val_rows=8)
    packed, _, _ = _train(task, tmp_path / "packed", {})
    padded, _, _ = _train(task, tmp_path / "padded", {"policy.packing": "false"})
    for step, (ours, ref) in enumerate(zip(packed, padded, strict=True), start=1):
        keys = [k for k in ref if not k.startswith(NOT_COMPARED)]
        assert set(keys) <= set(ours)
        for k in keys:
            if k.endswith("logprob_abs_diff") or k.startswith("mismatch/"):
                assert math.isclose(ours[k], ref[k], abs_tol=1e-6), (step, k, ours[k], ref[k])
            else:
                assert math.isclose(ours[k], ref[k], rel_tol=1e-5, abs_tol=1e-7), (step, k, ours[k], ref[k])
    assert packed[-1]["actor/kl"] > 0
