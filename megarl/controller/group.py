"""WorkerGroup: N ranked Ray actors on a resource pool forming one torch.distributed world.

Calls are typed: the driver passes a role's own method (``PolicyRole.compute_log_probs``), never a
name, and the three dispatch modes are explicit methods:

* :meth:`RoleHandle.all` - same arguments to every rank, every rank's result (rank order);
* :meth:`RoleHandle.one` - one rank;
* :meth:`RoleHandle.dp` - a :class:`Batch` cut into DP shards (filler rows only where needed),
  shard ``d`` put once in the object store and sent to every rank of DP rank ``d``; results
  collected from each DP rank's owner (last PP stage, TP rank 0), in sample order, filler removed.

Each has an ``*_async`` twin returning a :class:`PendingCall`, so calls on independent groups
overlap. A worker that raises makes the call raise :class:`WorkerError` naming role, rank and the
worker's traceback, after the whole group is killed: its peers may be blocked in a collective with
the failed rank and would otherwise hang forever. A call that exceeds its timeout does the same.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megarl.controller import dispatch
from megarl.controller.pools import ResourcePool
from megarl.controller.process import WorkerProcess
from megarl.controller.role import Role, WorkerContext
from megarl.data.batch import Batch
from megarl.errors import LayoutError, MegarlError
from megarl.parallel.layout import ParallelLayout

logger = logging.getLogger(__name__)

R = TypeVar("R", bound=Role)
T = TypeVar("T")


class WorkerError(MegarlError, RuntimeError):
    """A worker raised (or died, or timed out); the group has been torn down."""

    def __init__(self, message: str, *, role: str, rank: int | None) -> None:
        super().__init__(message)
        self.role = role
        self.rank = rank


@dataclasses.dataclass(frozen=True)
class GroupOptions:
    seed: int = 1234
    init_timeout_s: float = 300.0  # actor start-up + rendezvous
    call_timeout_s: float | None = 3600.0  # None: wait forever
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # extra environment for the workers


class PendingCall(Generic[T]):
    """Futures of one group call; :meth:`result` waits, fails fast on the first error."""

    def __init__(self, group: WorkerGroup, role: str, futures: dict[int, ray.ObjectRef],
                 finish: Callable[[dict[int, Any]], T]) -> None:
        self._group, self._role, self._futures, self._finish = group, role, futures, finish

    def result(self, timeout_s: float | None = ...) -> T:  # type: ignore[assignment]
        timeout = self._group.options.call_timeout_s if timeout_s is ... else timeout_s
        return self._finish(self._group._gather(self._role, self._futures, timeout))


class WorkerGroup:
    """The actors of one pool. Roles are attached with :meth:`add_role`."""

    def __init__(self, name: str, pool: ResourcePool, layout: ParallelLayout, options: GroupOptions = GroupOptions(),
                 *, connect: bool = True) -> None:
        if pool.world_size != layout.world_size:
            raise LayoutError(
                f"worker group {name!r}: layout {layout} needs {layout.world_size} ranks but pool {pool.name!r} has "
                f"{pool.world_size} device slots; make tp*pp*dp equal nodes*devices_per_node."
            )
        self.name, self.pool, self.layout, self.options = name, pool, layout, options
        self.alive = True
        env = {"MEGARL_WORKER_GROUP": name} | dict(options.env)
        self.actors = [
            WorkerProcess.options(
                num_cpus=pool.bundle["CPU"], num_gpus=pool.bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=idx),
                runtime_env={"env_vars": env},
            ).remote(rank, layout.world_size)
            for rank, (pg, idx) in enumerate(pool.bundles())
        ]
        self.contexts: list[WorkerContext] = []
        self.roles: dict[str, type[Role]] = {}
        if connect:
            self.connect()

    def connect(self) -> None:
        """Wait for the actors, rendezvous and initialise torch.distributed + megatron-core on every rank."""
        t = self.options.init_timeout_s
        hosts = self._gather("init", {r: a.host.remote() for r, a in enumerate(self.actors)}, t)
        port = self._gather("init", {0: self.actors[0].open_store.remote(t)}, t)[0]
        futures = {
            r: a.init_world.remote(hosts[0][0], port, self.layout, self.options.seed, t)
            for r, a in enumerate(self.actors)
        }
        self.contexts = [ctx for _, ctx in sorted(self._gather("init", futures, t).items())]
        logger.info("worker group %s: %d ranks, %s, %d node(s)", self.name, len(self.actors), self.layout,
                    len({c.node_id for c in self.contexts}))

    def add_role(self, name: str, role_cls: type[R], *args: Any, **kwargs: Any) -> RoleHandle[R]:
        """Construct ``role_cls(ctx, *args, **kwargs)`` on every rank; return its typed handle."""
        if name in self.roles:
            raise ValueError(f"role {name!r} is already hosted by worker group {self.name!r}")
        self._gather(name, {r: a.add_role.remote(name, role_cls, args, kwargs) for r, a in enumerate(self.actors)},
                     self.options.init_timeout_s)
        self.roles[name] = role_cls
        return RoleHandle(self, name, role_cls)

    # ------------------------------------------------------------------------------ internals

    def _submit(self, role: str, rank: int, method: Callable, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        if not self.alive:
            raise WorkerError(f"worker group {self.name!r} was torn down after an earlier failure",
                              role=role, rank=None)
        return self.actors[rank].call.remote(role, method, *args, **kwargs)

    def _gather(self, role: str, futures: dict[int, ray.ObjectRef], timeout_s: float | None) -> dict[int, Any]:
        """Results by rank; on the first failure or at the deadline, kill the group and raise."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        rank_of = {ref: rank for rank, ref in futures.items()}
        pending, results = list(futures.values()), {}
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not done:
                self.shutdown(kill=True)
                raise WorkerError(
                    f"{role} call on worker group {self.name!r} did not finish within {timeout_s:.0f} s "
                    f"(ranks still running: {sorted(rank_of[r] for r in pending)}); the group was torn down.",
                    role=role, rank=None,
                )
            ref = done[0]
            try:
                results[rank_of[ref]] = ray.get(ref)
            except (RayTaskError, RayActorError, GetTimeoutError) as e:
                rank = rank_of[ref]
                self.shutdown(kill=True)
                cause = getattr(e, "cause", None) or e
                raise WorkerError(
                    f"{role} failed on rank {rank} of worker group {self.name!r} ({self.layout}, coords "
                    f"{self.layout.coords(rank)._asdict()}): {type(cause).__name__}: {cause}\n"
                    f"worker traceback:\n{getattr(e, 'traceback_str', None) or e}\nthe group was torn down.",
                    role=role, rank=rank,
                ) from e
        return results

    def set_tracing(self, on: bool) -> None:
        """Turn span recording on or off in every rank (:mod:`megarl.metrics.trace`)."""
        self._gather("trace", {r: a.set_tracing.remote(on) for r, a in enumerate(self.actors)},
                     self.options.call_timeout_s)

    def drain_trace(self) -> list[list[dict[str, Any]]]:
        """Every rank's recorded spans since the last drain, by rank."""
        res = self._gather("trace", {r: a.drain_trace.remote() for r, a in enumerate(self.actors)},
                           self.options.call_timeout_s)
        return [res[r] for r in sorted(res)]

    def shutdown(self, kill: bool = False) -> None:
        """Stop every actor (``kill=True``: without waiting for them, e.g. when a peer is stuck)."""
        if not self.alive:
            return
        self.alive = False
        if not kill:
            try:
                ray.get([a.shutdown.remote() for a in self.actors], timeout=30)
            except Exception:  # noqa: BLE001 - best effort before the kill below
                logger.warning("worker group %s did not shut down cleanly; killing it", self.name)
        for a in self.actors:
            ray.kill(a, no_restart=True)


class RoleHandle(Generic[R]):
    """Typed calls on one role of a worker group. ``method`` is the role class's own function."""

    def __init__(self, group: WorkerGroup, name: str, role_cls: type[R]) -> None:
        self.group, self.name, self.role_cls = group, name, role_cls

    def all_async(self, method: Callable[..., T], *args: Any, **kwargs: Any) -> PendingCall[list[T]]:
        futures = {r: self.group._submit(self.name, r, method, *args, **kwargs) for r in range(len(self.group.actors))}
        return PendingCall(self.group, self.name, futures, lambda res: [res[r] for r in sorted(res)])

    def one_async(self, rank: int, method: Callable[..., T], *args: Any, **kwargs: Any) -> PendingCall[T]:
        futures = {rank: self.group._submit(self.name, rank, method, *args, **kwargs)}
        return PendingCall(self.group, self.name, futures, lambda res: res[rank])

    def dp_async(self, method: Callable[..., Batch], batch: Batch, *args: Any, **kwargs: Any) -> PendingCall[Batch]:
        layout = self.group.layout
        shards, pad = batch.shard(layout.dp)
        shard_refs = [ray.put(shard) for shard in shards]  # one object per DP rank
        futures = {
            rank: self.group._submit(self.name, rank, method, shard_refs[d], *args, **kwargs)
            for d, ranks in enumerate(dispatch.dp_members(layout))
            for rank in ranks
        }
        owners = dispatch.collect_ranks(layout)
        return PendingCall(self.group, self.name, futures,
                           lambda res: Batch.concat([res[r] for r in owners]).unpad(pad))

    def dp_split_async(self, method: Callable[..., T], batch: Batch, *args: Any, **kwargs: Any) -> PendingCall[list[T]]:
        """Like :meth:`dp_async` for calls that must not see filler rows (training steps): the batch is
        cut into ``dp`` equal shards (its size must divide) and each DP rank's owner result comes back."""
        layout = self.group.layout
        shard_refs = [ray.put(shard) for shard in batch.chunk(layout.dp)]
        futures = {
            rank: self.group._submit(self.name, rank, method, shard_refs[d], *args, **kwargs)
            for d, ranks in enumerate(dispatch.dp_members(layout))
            for rank in ranks
        }
        owners = dispatch.collect_ranks(layout)
        return PendingCall(self.group, self.name, futures, lambda res: [res[r] for r in owners])

    def dp_split(self, method: Callable[..., T], batch: Batch, *args: Any, **kwargs: Any) -> list[T]:
        return self.dp_split_async(method, batch, *args, **kwargs).result()

    def all(self, method: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]:
        return self.all_async(method, *args, **kwargs).result()

    def one(self, rank: int, method: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return self.one_async(rank, method, *args, **kwargs).result()

    def dp(self, method: Callable[..., Batch], batch: Batch, *args: Any, **kwargs: Any) -> Batch:
        return self.dp_async(method, batch, *args, **kwargs).result()


def wait_all(calls: Sequence[PendingCall[Any]]) -> list[Any]:
    """Results of several pending calls (on different groups, running concurrently), in order."""
    return [c.result() for c in calls]
