"""One Ray cluster for the whole test run: a head node and a second simulated node (two raylets on
this machine, `ray.cluster_utils.Cluster`), so multi-node placement is real."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray 2.60 token auth: not for a local test cluster
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

HEAD_CPUS = 6  # logical CPUs: worker slots are fractional, the machine has 2 cores
WORKER_CPUS = 2


@pytest.fixture(scope="session")
def ray_cluster():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": HEAD_CPUS, "object_store_memory": 400 * 1024**2, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=WORKER_CPUS, object_store_memory=300 * 1024**2)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()
