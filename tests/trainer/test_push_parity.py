"""Parity at every weight push and the push deadline (issue #42), sabotaged on purpose, on the test session's Ray
cluster: the demo's GRPO on the addition task under the async schedule (the trained rows are older than the weights,
so the step's own log-prob check never sees a bad push), the policy on one process, two embedded rollout replicas
on a pool of their own; one run of a few steps, two faults:

* after step 2, rollout rank 1 stops itself (SIGSTOP) at its first bucket of the next push (version 2), while the
  policy and the other rank wait in the link: the push fails after ``cluster.timeouts.push_s`` (5 s, against the
  3600 s call limit) as a lost worker; the run replaces its workers, resumes from step 2's checkpoint (one incident in
  incidents.jsonl, steps 3 and 4 logged once, by the resumed run) and goes on;
* after step 4, on the fresh workers, replica 1 silently keeps its old weights (its engine takes part in the
  transfer and loads nothing): the run stops at that push (version 4, counted by hand from the schedule) with an
  error naming replica 1 and the version, and replica 0's gap;
* every push that returned, before and after the restart (versions 0-3, each pushed by the trainer or the
  producer's start), matched the training model on both replicas (< 1e-5, fp32), as the step metrics show.

The sabotage runs inside the rollout worker, installed between steps through the group's call mechanism (a
function of the role instance, as tests/trainer/test_rollout_pool.py reads the engines' weights); production code
has no fault hook. Before the probe and the deadline (checked on the parent commit of both): the stale replica
trained on to the last step (DID NOT RAISE), and the stalled push waited for ``call_s`` (3600 s; 60 s when set so).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_addition_tiny" / "config.yaml"
SPLIT = {"cluster.pools.main.devices_per_node": 1, "cluster.pools.main.tp": 1, "cluster.pools.gen.devices_per_node": 2,
         "cluster.placement.rollout": "gen", "data.batch_size": 4, "rollout.sampling.n": 4,
         "trainer.tensorboard": "false", "trainer.val_every": 0, "trainer.save_every": 1,
         "algorithm.kl_loss_coef": 0}  # no reference model: one model less to build at each start


def _config(task, out, extra):
    from megarl.config.train import load_config

    overrides = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
                 "trainer.output_dir": out} | SPLIT | extra
    return load_config(EXAMPLE, [f"{k}={v}" for k, v in overrides.items()])


# ------------------------------------------------------------------- run inside the rollout worker (by value)


def _keep_old_weights(role) -> None:
    """From the next push on, this replica's engine takes part in the transfer but loads nothing."""
    engine = role.engine
    engine.wake_up = engine.finish_weight_update = lambda: None
    engine.update_weights = lambda bucket: set()
    engine.weight_buffer = lambda name, shape, dtype, device: None  # nor is anything received into its parameters


def _stop_mid_push(role) -> int:
    """At its first bucket of the next push, this process stops (SIGSTOP) as a hung host would; its pid."""

    def stop(bucket):
        os.kill(os.getpid(), signal.SIGSTOP)

    role.engine.update_weights = stop
    return os.getpid()


# --------------------------------------------------------------------------------------------- driver side


class _Pushes:
    """Records every push's parity (``Cluster.sync_weights``' result, whatever schedule called it) and, at the end
    of each step of ``sabotage``, runs its function on rollout rank 1 (its result by step)."""

    def __init__(self, sabotage) -> None:
        self.sabotage, self.results = sabotage, {}
        self.trainer, self.parity = None, []

    def attach(self, trainer) -> None:
        self.trainer = trainer
        sync = trainer.cluster.sync_weights  # the same Cluster object across restarts

        def recorded(version=0):
            out = sync(version)
            self.parity.append(out.parity)
            return out

        trainer.cluster.sync_weights = recorded

    def on_stage_end(self, stage, step, batch):
        pass

    def on_step_end(self, step, metrics):
        if step in self.sabotage and step not in self.results:
            from megarl.roles.split import RolloutRole  # noqa: F401 - the role the function runs on

            cluster = self.trainer.cluster
            with cluster._rollout_calls:  # ordered with the asynchronous producer's calls
                call = cluster.rollout.one_async(1, self.sabotage[step])
            self.results[step] = call.result()


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_every_push_is_probed_a_stalled_push_recovers_a_stale_replica_stops_the_run(ray_cluster, tmp_path):
    from ray import cloudpickle

    from megarl.rollout.parity import PushMismatchError
    from megarl.testing.addition import make_task
    from megarl.trainer.trainer import Trainer

    task = make_task(tmp_path / "task", train_rows=64, val_rows=8)
    out = tmp_path / "run"
    cfg = _config(task, out, {"rollout.schedule": "async", "trainer.total_steps": 8, "cluster.timeouts.push_s": 5,
                              "trainer.max_restarts": 1, "rollout.engine.max_logprob_abs_diff": 1e-4})
    # after step 2 rollout rank 1 stops at its next push (version 2, in step 3); after step 4 (on the fresh
    # workers) it keeps its old weights from its next push on (version 4, in step 5)
    pushes = _Pushes({2: _stop_mid_push, 4: _keep_old_weights})
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module
    trainer = Trainer(cfg, (pushes,))
    pushes.attach(trainer)
    start = time.monotonic()
    try:
        with pytest.raises(PushMismatchError) as info:
            trainer.fit()
    finally:
        trainer.close()
        stopped = pushes.results.get(2)
        if stopped is not None and _alive(stopped):  # never left behind, whatever happened
            os.kill(stopped, signal.SIGKILL)
            pytest.fail(f"the stopped rollout worker {stopped} outlived the run's restart")
    assert time.monotonic() - start < 300  # the stalled push did not wait for call_s (3600 s)

    # (b) the stalled push: a lost worker after push_s, replaced; the run resumed from step 2 and went on
    incidents = [json.loads(line) for line in (out / "incidents.jsonl").read_text().splitlines()]
    assert len(incidents) == 1, incidents
    incident = incidents[0]
    assert (incident["kind"], incident["failed_step"], incident["resumed_from_step"]) == ("worker_lost", 3, 2)
    assert "the weight push of version 2 to the rollout pool did not finish within 5 s" in incident["error"]
    assert "rollout ranks [" in incident["error"] and "rollout" in incident["roles"], incident
    logged = _metrics(out)
    assert [m["step"] for m in logged] == [1, 2, 3, 4]  # step 3 once: the resumed run's
    assert [m["run/restarts"] for m in logged] == [0.0, 0.0, 1.0, 1.0]

    # (a) the stale replica: the run stops at the push of version 4 naming replica 1 (its rows would have been
    # one version old when trained, where the step's own check never looks)
    message = str(info.value)
    assert "rollout replica 1 " in message and "version 4 " in message and "replica 0: " in message, message

    # every push that returned reached both replicas exactly: 0 (the producer's start), 1, then after the
    # resume 2 (the producer's start again, the checkpoint's weights) and 3; 2 stalled and 4 raised
    assert [p.version for p in pushes.parity] == [0, 1, 2, 3], [p.version for p in pushes.parity]
    assert all(len(p.per_replica) == 2 for p in pushes.parity)
    assert max(max(p.per_replica) for p in pushes.parity) < 1e-5, [p.per_replica for p in pushes.parity]
    # and the metrics: each step's push (steps 2 and 4 push inside the step; 1 and 3 start the producer)
    assert all(m["rollout/push_logprob_abs_diff"] < 1e-5 for m in logged if "rollout/push_logprob_abs_diff" in m)
    assert (logged[1]["rollout/push_version"], logged[3]["rollout/push_version"]) == (1.0, 3.0)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
