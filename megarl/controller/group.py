"""WorkerGroup: N ranked Ray actors on a resource pool forming one torch.distributed world.

Calls are typed: the driver passes a role's own method (``PolicyRole.compute_log_probs``), never a
name, through a :class:`~megarl.controller.handles.RoleHandle` (dispatch modes all / one / dp);
shards are put once in the object store. A worker that raises makes the call raise
:class:`WorkerError` naming role, rank and the worker's traceback, after the whole group is killed:
its peers may be blocked in a collective with the failed rank and would otherwise hang forever. A
call that exceeds its timeout does the same. The error also names what the failed process hosted (every
role of the group: colocated roles share its processes), its host name, node IP and pid.

Each rank's process is titled after the run, its roles and its coordinates (``ps``:
``ray::WorkerProcess megarl[run] policy+reference rank 1 (tp 1 pp 0 dp 0)``; during a call
``ray::WorkerProcess.call <the same>: policy.generate``), see :mod:`megarl.controller.process`.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

import ray
from ray.exceptions import GetTimeoutError, OutOfMemoryError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megarl.controller.handles import RoleHandle, WorkerError
from megarl.controller.pools import ResourcePool
from megarl.controller.process import WorkerProcess, process_title
from megarl.controller.role import Role, WorkerContext
from megarl.controller.spec import GroupOptions
from megarl.errors import LayoutError, MegarlError
from megarl.parallel.layout import ParallelLayout

logger = logging.getLogger(__name__)

R = TypeVar("R", bound=Role)
P = ParamSpec("P")


class WorkerGroup:
    """The actors of one pool. Roles are attached with :meth:`add_role`."""

    def __init__(self, name: str, pool: ResourcePool, layout: ParallelLayout, options: GroupOptions | None = None,
                 *, connect: bool = True, run: str = "") -> None:
        """``run``: the run's name in the workers' process titles (its output directory's)."""
        options = options or GroupOptions()
        if pool.world_size != layout.world_size:
            raise LayoutError(
                f"worker group {name!r}: layout {layout} needs {layout.world_size} ranks but pool {pool.name!r} has "
                f"{pool.world_size} device slots; make tp*pp*cp*dp equal nodes*devices_per_node."
            )
        self.name, self.pool, self.layout, self.options, self.run = name, pool, layout, options, run
        self.alive = True
        env = {"MEGARL_WORKER_GROUP": name} | dict(options.env) | pool.env  # a CPU pool's hide the GPUs, always
        self.actors = [
            WorkerProcess.options(
                num_cpus=pool.bundle["CPU"], num_gpus=pool.bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=idx),
                runtime_env={"env_vars": env},
            ).remote(rank, layout.world_size)
            for rank, (pg, idx) in enumerate(pool.bundles())
        ]
        self.contexts: list[WorkerContext] = []
        self.hosts: dict[int, tuple[str, int, str, str]] = {}  # rank -> (node IP, pid, node id, host name)
        self.roles: dict[str, type[Role]] = {}
        if connect:
            self.connect()

    def connect(self) -> None:
        """Wait for the actors, rendezvous and initialise torch.distributed + megatron-core on every rank."""
        t = self.options.timeouts.init_s
        self.hosts = self.gather("init", {r: a.host.remote() for r, a in enumerate(self.actors)}, t)
        port = self.gather("init", {0: self.actors[0].open_store.remote(t)}, t)[0]
        futures = {
            r: a.init_world.remote(self.hosts[0][0], port, self.layout, self.options.seed, self.options.timeouts)
            for r, a in enumerate(self.actors)
        }
        self.contexts = [ctx for _, ctx in sorted(self.gather("init", futures, t).items())]
        logger.info("worker group %s: %d ranks, %s, %d node(s)", self.name, len(self.actors), self.layout,
                    len({c.node_id for c in self.contexts}))

    def add_role(self, name: str, role_cls: Callable[Concatenate[WorkerContext, P], R], *args: P.args,
                 **kwargs: P.kwargs) -> RoleHandle[R]:
        """Construct ``role_cls(ctx, *args, **kwargs)`` on every rank; return its typed handle."""
        if name in self.roles:
            raise ValueError(f"role {name!r} is already hosted by worker group {self.name!r}")
        futures = {}
        for r, a in enumerate(self.actors):  # retitled first: the add_role call after it ends with the new title
            title = process_title(self.run, [*self.roles, name], r, self.layout)
            a.retitle.remote(title)  # its failure shows in the add_role call after it
            futures[r] = a.add_role.options(name=f"WorkerProcess.add_role {title}").remote(name, role_cls, args,
                                                                                           kwargs)
        self.gather(name, futures, self.options.timeouts.init_s)
        self.roles[name] = role_cls
        return RoleHandle(self, name, role_cls)

    @property
    def world_size(self) -> int:
        return len(self.actors)

    # ------------------------------------------------------------------------------ internals

    def put(self, obj: Any) -> ray.ObjectRef:
        return ray.put(obj)

    def submit(self, role: str, rank: int, method: Callable, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        if not self.alive:
            raise WorkerError(f"worker group {self.name!r} was torn down after an earlier failure",
                              role=role, rank=None, roles=tuple(self.roles))
        title = process_title(self.run, list(self.roles), rank, self.layout)
        return self.actors[rank].call.options(name=f"WorkerProcess.call {title}: {role}.{method.__name__}").remote(
            role, method, *args, **kwargs)

    def gather(self, role: str, futures: dict[int, ray.ObjectRef], timeout_s: float | None) -> dict[int, Any]:
        """Results by rank; on the first failure or at the deadline, kill the group and raise."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        rank_of = {ref: rank for rank, ref in futures.items()}
        pending, results = list(futures.values()), {}
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not done:
                self.shutdown(kill=True)
                running = sorted(rank_of[r] for r in pending)
                raise WorkerError(
                    f"{role} call on worker group {self.name!r} did not finish within {timeout_s:.0f} s "
                    f"(ranks still running: {running}; {self._hosted(running)}); the group was torn down.",
                    role=role, rank=None, lost=True, roles=tuple(self.roles),
                )
            ref = done[0]
            try:
                results[rank_of[ref]] = ray.get(ref)
            except (RayTaskError, RayActorError, GetTimeoutError, OutOfMemoryError) as e:
                rank = rank_of[ref]
                self.shutdown(kill=True)
                cause = getattr(e, "cause", None) or e
                # a MegarlError already says what to change: its message is the paragraph, no traceback
                trace = "" if isinstance(cause, MegarlError) else (
                    f"\nworker traceback:\n{getattr(e, 'traceback_str', None) or e}\n")
                detail = _memory_monitor_kill(e) or f"{type(cause).__name__}: {cause}{trace}"
                ip, pid, _, hostname = self.hosts.get(rank, (None, None, None, None))
                raise WorkerError(
                    f"{role} failed on rank {rank} of worker group {self.name!r} ({self.layout}, coords "
                    f"{self.layout.coords(rank)._asdict()}; {self._hosted([rank])}): {detail} The group was torn "
                    "down.",
                    role=role, rank=rank,
                    lost=isinstance(e, (RayActorError, OutOfMemoryError)) and not isinstance(e, RayTaskError),
                    roles=tuple(self.roles), host=hostname, node_ip=ip, pid=pid,
                ) from e
        return results

    def _hosted(self, ranks: list[int]) -> str:
        """What the processes of ``ranks`` hosted and where: ``"the process hosted policy+reference: pid 4242 on
        node-3 (10.0.0.3)"``."""
        where = [f"pid {self.hosts[r][1]} on {self.hosts[r][3]} ({self.hosts[r][0]})" for r in ranks
                 if r in self.hosts]
        return (f"the process{'es' if len(ranks) > 1 else ''} hosted {'+'.join(self.roles) or 'no role yet'}"
                + (f": {', '.join(where)}" if where else ""))

    def finished(self, futures: dict[int, ray.ObjectRef]) -> list[int]:
        done, _ = ray.wait(list(futures.values()), num_returns=len(futures), timeout=0)
        done_refs = set(done)
        return [rank for rank, ref in futures.items() if ref in done_refs]

    def set_tracing(self, on: bool) -> None:
        """Turn span recording on or off in every rank (:mod:`megarl.metrics.trace`)."""
        self.gather("trace", {r: a.set_tracing.remote(on) for r, a in enumerate(self.actors)},
                    self.options.timeouts.call_s)

    def drain_trace(self) -> list[list[dict[str, Any]]]:
        """Every rank's recorded spans since the last drain, by rank."""
        res = self.gather("trace", {r: a.drain_trace.remote() for r, a in enumerate(self.actors)},
                          self.options.timeouts.call_s)
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


_MEMORY = re.compile(r"Memory on the node \(IP: ([^,]+),.*? was ([\d.]+GB)(?: used)? / ([\d.]+GB)")
_THRESHOLD = re.compile(r"threshold of (?:\d+B \()?(\d+(?:\.\d+)?%?)")


def _memory_monitor_kill(e: Exception) -> str | None:
    """One line for a worker that Ray's memory monitor killed (Ray's report, ~40 lines, goes to the DEBUG log);
    None for any other failure."""
    text = str(e)
    if not isinstance(e, OutOfMemoryError) and "running low on memory" not in text:
        return None
    logger.debug("Ray's report of the worker it killed:\n%s", text)
    memory, threshold = _MEMORY.search(text), _THRESHOLD.search(text)
    node = f": memory on node {memory[1]} was {memory[2]} used of {memory[3]}" if memory else ""
    over = f" (over Ray's threshold of {threshold[1]})" if memory and threshold else ""
    return (f"killed by Ray's memory monitor{node}{over}; give the run more memory or raise "
            "RAY_memory_usage_threshold (Ray's report: MEGARL_LOG_LEVEL=DEBUG).")
