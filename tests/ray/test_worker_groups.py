"""The single controller on a real local Ray cluster (head + one simulated node, shared per session).

Each check compares what the workers report (megatron-core's own parallel_state, real collectives,
real pids and Ray node ids) with hand-worked expectations.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from megarl.controller.group import WorkerGroup
from megarl.controller.handles import WorkerError, wait_all
from megarl.controller.placement import Placement
from megarl.controller.pools import ResourcePool
from megarl.controller.spec import Device, GroupOptions, PlacementConfig, PoolConfig, PoolSpec, Timeouts
from megarl.data.batch import Batch
from megarl.errors import ConfigError
from megarl.host import allocator
from megarl.parallel.layout import ParallelLayout
from megarl.testing.roles import EchoRole

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def placement(ray_cluster):
    config = PlacementConfig(
        pools={
            "main": PoolSpec(devices_per_node=4, cpus_per_device=0.5, tp=2, pp=2),  # TP2xPP2
            "critic": PoolSpec(devices_per_node=4, cpus_per_device=0.5, tp=2),  # TP2xDP2
        },
        roles={"policy": "main", "reference": "main", "critic": "critic"},
    )
    options = GroupOptions(timeouts=Timeouts(call_s=120, collective_s=2400),
                           env=allocator.preload_env(allocator.Allocator.AUTO))
    p = Placement(config, options)
    handles = {
        "policy": p.add_role("policy", EchoRole, scale=2.0),
        "reference": p.add_role("reference", EchoRole, scale=3.0),
        "critic": p.add_role("critic", EchoRole, scale=-1.0),
    }
    yield p, handles
    p.shutdown()


# (rank -> (tp, pp, dp)) for megatron's default order, worked by hand
TP2PP2 = {0: (0, 0, 0), 1: (1, 0, 0), 2: (0, 1, 0), 3: (1, 1, 0)}
TP2DP2 = {0: (0, 0, 0), 1: (1, 0, 0), 2: (0, 0, 1), 3: (1, 0, 1)}


@pytest.mark.parametrize("role, expected", [("policy", TP2PP2), ("critic", TP2DP2)])
def test_ranks_and_collectives(placement, role, expected):
    _, handles = placement
    reports = handles[role].all(EchoRole.report)
    assert [r.rank for r in reports] == [0, 1, 2, 3]
    for r in reports:
        assert (r.tp, r.pp, r.dp) == expected[r.rank]
        assert (r.mcore_tp, r.mcore_pp, r.mcore_dp) == expected[r.rank]  # megatron-core agrees
        assert r.cp == r.mcore_cp == 0
    sums = handles[role].all(EchoRole.all_reduce, 0.5)
    for rank, s in enumerate(sums):
        assert s["world"] == 0.5 * (1 + 2 + 3 + 4)
        tp_peers = [q for q, c in expected.items() if (c[1], c[2]) == expected[rank][1:]]
        dp_peers = [q for q, c in expected.items() if (c[0], c[1]) == expected[rank][:2]]
        assert s["tp"] == 0.5 * sum(q + 1 for q in tp_peers)
        assert s["dp"] == 0.5 * sum(q + 1 for q in dp_peers)


def test_collectives_wait_collective_s_and_only_the_rendezvous_init_s(placement):
    """A rank may wait in a collective through a peer's generation, checkpoint or model load: the world group and
    megatron-core's groups get cluster.timeouts.collective_s (2400 s here), not init_s (300 s)."""
    _, handles = placement
    for role in ("policy", "critic"):
        for report in handles[role].all(EchoRole.report):
            assert report.group_timeouts_s == {"world": 2400.0, "tp": 2400.0, "pp": 2400.0, "dp": 2400.0}


def test_workers_of_a_pool_without_gpus_see_none(placement):
    """Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone for zero-GPU actors (on a GPU node they would see every GPU): the
    pools here have no GPU (device: auto on a CPU cluster), so each worker runs with it empty."""
    _, handles = placement
    for role in ("policy", "critic"):
        assert [r.visible_gpus for r in handles[role].all(EchoRole.report)] == [""] * 4


def test_colocated_roles_share_processes_split_roles_do_not(placement):
    _, handles = placement
    policy = [r.pid for r in handles["policy"].all(EchoRole.report)]
    reference = [r.pid for r in handles["reference"].all(EchoRole.report)]
    critic = [r.pid for r in handles["critic"].all(EchoRole.report)]
    assert policy == reference
    assert len(set(policy)) == 4 and not set(policy) & set(critic)


def test_workers_start_with_the_configured_allocator(placement):
    """cluster.allocator reaches Ray workers as LD_PRELOAD: the library is mapped into every worker."""
    _, handles = placement
    _, lib = allocator.resolve(allocator.Allocator.AUTO)  # jemalloc / tcmalloc if installed here, else glibc
    for report in handles["policy"].all(EchoRole.report) + handles["critic"].all(EchoRole.report):
        if lib is None:
            assert not any("jemalloc" in n or "tcmalloc" in n for n in report.malloc_libs), report.malloc_libs
        else:
            assert lib.resolve().name in report.malloc_libs, report.malloc_libs  # maps name the real file


@pytest.mark.parametrize("n", [1, 5, 6, 8])
@pytest.mark.parametrize("role", ["critic", "policy"])  # DP2 and DP1
def test_dp_split_collect_keeps_order_and_drops_padding(placement, role, n):
    _, handles = placement
    x = torch.randn(n, 3, generator=torch.Generator().manual_seed(n))
    batch = Batch.from_dict({"x": x}, {"id": [f"s{i}" for i in range(n)]})
    out = handles[role].dp(EchoRole.scale_batch, batch)
    scale = {"critic": -1.0, "policy": 2.0}[role]
    assert out["id"] == [f"s{i}" for i in range(n)]
    assert torch.equal(out["y"], scale * x)
    dp = 2 if role == "critic" else 1
    per_rank = -(-n // dp)  # padded batch split evenly: the first ceil(n/dp) samples go to DP rank 0
    assert out["dp_rank"].tolist() == [i // per_rank for i in range(n)]


def test_async_calls_on_independent_groups_overlap(placement):
    _, handles = placement
    start = time.monotonic()
    calls = [handles["policy"].all_async(EchoRole.sleep, 3.0), handles["critic"].all_async(EchoRole.sleep, 3.0)]
    results = wait_all(calls)
    assert results == [[3.0] * 4, [3.0] * 4]
    assert time.monotonic() - start < 5.5  # sequential would take >= 6 s


@contextlib.contextmanager
def _dp_group(name: str, role: str, **pool_kwargs):
    """A DP group (2 ranks unless the pool says otherwise) on its own pool (0.5 CPU per rank), released
    afterwards."""
    pool = ResourcePool(name, PoolConfig(cpus_per_device=0.5, **pool_kwargs))
    layout = ParallelLayout(dp=pool.world_size)
    group = WorkerGroup(name, pool, layout, GroupOptions(timeouts=Timeouts(call_s=120)))
    try:
        yield group, group.add_role(role, EchoRole)
    finally:
        group.shutdown()
        pool.release()


def test_strict_spread_pool_spans_two_nodes(ray_cluster):
    import ray

    with _dp_group("spread", "echo", nodes=2, devices_per_node=1) as (_, handle):
        reports = handle.all(EchoRole.report)
        assert len({r.node_id for r in reports}) == 2
        assert {r.node_id for r in reports} == {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert [s["world"] for s in handle.all(EchoRole.all_reduce, 1.0)] == [3.0, 3.0]


def test_worker_exception_names_role_and_rank_and_tears_down(ray_cluster):
    with _dp_group("fail", "critic", devices_per_node=2) as (_, handle):
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"critic failed on rank 1 .*ValueError: deliberate failure") as info:
            handle.all(EchoRole.fail, 1)  # rank 0 blocks in a barrier that rank 1 never joins
        assert time.monotonic() - start < 30
        assert (info.value.role, info.value.rank) == ("critic", 1)
        assert "process.py" in str(info.value)  # the worker's traceback is included
        with pytest.raises(WorkerError, match="torn down"):
            handle.all(EchoRole.noop)


def test_call_timeout_tears_down_instead_of_hanging(ray_cluster):
    with _dp_group("slow", "policy", devices_per_node=2) as (group, handle):
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"did not finish within 2 s .*ranks still running: \[0, 1\]"):
            handle.all_async(EchoRole.sleep, 60.0).result(timeout_s=2)
        assert time.monotonic() - start < 10 and not group.alive


def test_waiting_on_two_groups_fails_at_the_first_failure(ray_cluster):
    # a weight sync across pools: one group's ranks wait (here: sleep) on a peer of another group that fails;
    # the wait must raise the failure at once, not after the waiting group's call
    with _dp_group("waiting", "policy") as (group, waiting), _dp_group("failing", "rollout") as (_, failing):
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"rollout failed on rank 0 .*deliberate failure"):
            wait_all([waiting.all_async(EchoRole.sleep, 60.0), failing.all_async(EchoRole.fail, 0)])
        assert time.monotonic() - start < 20
        group.shutdown(kill=True)  # its ranks still sleep: what the trainer's restart does (a stop request would queue)
        assert time.monotonic() - start < 25


def test_unsatisfiable_pools_fail_fast(ray_cluster):
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"needs 1 node\(s\) x 64 bundle\(s\) of CPU=1.*can never provide"):
        ResourcePool("huge", PoolConfig(devices_per_node=64))
    with pytest.raises(ConfigError, match=r"needs 3 node\(s\).*can never provide"):
        ResourcePool("three_nodes", PoolConfig(nodes=3, cpus_per_device=0.5))
    with pytest.raises(ConfigError, match="asks for GPUs .* has none"):
        ResourcePool("gpu", PoolConfig(device=Device.GPU))
    assert time.monotonic() - start < 5
