"""A node lost mid-run while the cluster still has room (issue #21, item 5): the run replaces its workers on
the remaining node and finishes.

A private three-node Ray cluster (``ray.cluster_utils.Cluster``: a head with no CPUs for workers, and two
nodes of 2 CPUs) stands in for a Slurm allocation with a spare node. ``megarl train`` joins it
(``cluster.ray_address``); once it has logged 3 steps, the node hosting its worker is removed: every
process of that node (raylet, object store, the worker) dies, as when a machine goes away. References:
the run's own step count, its incident log, and the surviving node hosting the fresh worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.metrics.tracking import read_metrics

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "grpo_addition_tiny" / "config.yaml"


def _hosts_worker(node) -> bool:
    """Whether a Ray worker process of the run (``ray::WorkerProcess``) runs under this node's raylet."""
    import psutil

    raylet = node.all_processes["raylet"][0].process.pid
    try:
        children = psutil.Process(raylet).children(recursive=True)
    except psutil.NoSuchProcess:
        return False
    names = []
    for child in children:
        try:
            names.append(" ".join(child.cmdline()))
        except psutil.Error:
            continue
    return any(name.startswith("ray::WorkerProcess") for name in names)


@pytest.fixture
def spare_node_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 0, "object_store_memory": 100 * 2**20, "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=2, object_store_memory=100 * 2**20) for _ in range(2)]
    cluster.wait_for_nodes()
    yield cluster, nodes
    cluster.shutdown()


def test_a_lost_node_is_replaced_by_the_spare_and_the_run_finishes(spare_node_cluster, tmp_path):
    from megarl.testing.addition import make_task

    cluster, nodes = spare_node_cluster
    task = make_task(tmp_path / "task", train_rows=64, val_rows=8)
    out = tmp_path / "run"
    overrides = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
                 "trainer.output_dir": out, "trainer.tensorboard": "false", "trainer.total_steps": 8,
                 "trainer.save_every": 2, "trainer.val_every": 0, "trainer.max_restarts": 1, "data.batch_size": 4,
                 "rollout.sampling.n": 4, "cluster.pools.main.devices_per_node": 1, "cluster.pools.main.tp": 1,
                 "cluster.ray_address": cluster.address}
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_TMPDIR")}
    log = tmp_path / "run.log"
    proc = subprocess.Popen([sys.executable, "-m", "megarl.train", str(EXAMPLE),
                             *[f"{k}={v}" for k, v in overrides.items()]], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=log.open("w"), start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        hosting = [n for n in nodes if _hosts_worker(n)]
        assert len(hosting) == 1, "the run's one worker should run on exactly one of the two nodes"
        lost, spare = hosting[0], next(n for n in nodes if n is not hosting[0])
        cluster.remove_node(lost, allow_graceful=False)
        replaced = False  # a fresh worker seen on the spare node while the run goes on
        while proc.poll() is None and time.monotonic() < deadline:
            replaced = replaced or _hosts_worker(spare)
            time.sleep(0.2)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert replaced
    finally:
        if proc.poll() is None:
            proc.kill()
    history = read_metrics(out)
    assert [m["step"] for m in history] == list(range(1, 9))
    incidents = [json.loads(line) for line in (out / "incidents.jsonl").read_text().splitlines()]
    assert len(incidents) == 1 and incidents[0]["kind"] == "worker_lost", incidents
    assert history[-1]["run/restarts"] == 1.0
