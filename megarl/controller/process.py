"""WorkerProcess: the Ray actor that is one rank of a worker group.

It owns the process-level state: the torch.distributed world (rendezvous through a TCPStore that
rank 0 opens on a free port, so no port is ever hard-coded or raced for), megatron-core parallel
state, and the roles hosted here. The driver never calls roles by name: it sends the role's own
method (a function object) and this actor applies it to the hosted instance.

Process titles: Ray titles a worker ``ray::<class name>`` while idle and ``ray::<task name>`` during a call,
and sets both again around every task (``_raylet.execute_task``: the idle title is read from the actor's class
name as each task starts), so a title set with ``setproctitle`` lasts only until the current call ends. The
driver names each call after its rank (:func:`process_title`, the task name) and :meth:`WorkerProcess.retitle`
swaps this actor's class for a subclass named after the rank, which Ray then uses as the idle title: ``ps`` shows
``ray::WorkerProcess megarl[run] policy+reference rank 1 (tp 1 pp 0 dp 0)``, from the end of the call after
the retitle on (the prefix ``ray::WorkerProcess`` stays: tools and tests look for it).
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable
from typing import Any

import ray

from megarl.controller.role import Role, WorkerContext, call_role, close_roles
from megarl.controller.spec import Timeouts
from megarl.metrics import trace
from megarl.parallel.layout import ParallelLayout


def process_title(run: str, roles: list[str], rank: int, layout: ParallelLayout) -> str:
    """What ``ps`` shows of a rank (after Ray's ``ray::WorkerProcess``): ``megarl[run] policy+reference rank 1
    (tp 1 pp 0 dp 0)`` (``cp`` after ``tp`` with context parallelism); ``run`` names the run (its output directory),
    ``roles`` the roles the process hosts."""
    hosted = "+".join(roles) or "no role yet"
    c = layout.coords(rank)
    cp = f" cp {c.cp}" if layout.cp > 1 else ""
    return f"megarl{f'[{run}]' if run else ''} {hosted} rank {rank} (tp {c.tp}{cp} pp {c.pp} dp {c.dp})"


@ray.remote
class WorkerProcess:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.roles: dict[str, Role] = {}
        self.ctx: WorkerContext | None = None
        self._store = None
        self._actor_class = type(self)  # Ray's class of this actor: retitle's subclasses derive from it

    def host(self) -> tuple[str, int, str, str]:
        """(node IP, pid, Ray node id, host name) of this rank."""
        return (ray.util.get_node_ip_address(), os.getpid(), ray.get_runtime_context().get_node_id(),
                socket.gethostname())

    def retitle(self, title: str) -> None:
        """Make Ray title this process ``ray::WorkerProcess <title>`` between calls, from the end of the next
        call on (module docstring): Ray reads the idle title from the class name, so the class is swapped for an
        empty subclass of that name (methods, state and Ray's own attributes unchanged)."""
        self.__class__ = type(f"WorkerProcess {title}", (self._actor_class,), {})

    def open_store(self, timeout_s: float) -> int:
        """Rank 0: open the rendezvous TCPStore on a free port (the OS picks it) and return the port."""
        import torch.distributed as dist

        self._store = dist.TCPStore(
            ray.util.get_node_ip_address(), 0, self.world_size, is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
        )
        return self._store.port

    def init_world(self, master_addr: str, port: int, layout: ParallelLayout, seed: int,
                   timeouts: Timeouts) -> WorkerContext:
        """Join the group's torch.distributed world and initialise megatron-core for ``layout``: the rendezvous
        waits ``timeouts.init_s``, a collective of the world or of megatron-core's groups ``timeouts.collective_s``
        (a rank may wait in one through a peer's generation, checkpoint or model load)."""
        import torch
        import torch.distributed as dist

        from megarl.parallel.init import default_backend, init_distributed

        if self._store is None:
            self._store = dist.TCPStore(master_addr, port, self.world_size, is_master=False,
                                        timeout=datetime.timedelta(seconds=timeouts.init_s))
        if torch.cuda.is_available():
            torch.cuda.set_device(0)  # Ray exposes this actor's GPU as device 0
        dist.init_process_group(default_backend(), store=self._store, rank=self.rank, world_size=self.world_size,
                                timeout=datetime.timedelta(seconds=timeouts.collective_s))
        init_distributed(layout, seed=seed, collective_timeout_s=timeouts.collective_s)
        self.ctx = WorkerContext(
            rank=self.rank, world_size=self.world_size, layout=layout, coords=layout.coords(self.rank),
            node_ip=ray.util.get_node_ip_address(), node_id=ray.get_runtime_context().get_node_id(), pid=os.getpid(),
            device="cuda:0" if torch.cuda.is_available() else "cpu",
        )
        return self.ctx

    def add_role(self, name: str, role_cls: type[Role], args: tuple, kwargs: dict) -> None:
        if name in self.roles:
            raise ValueError(f"role {name!r} is already hosted by rank {self.rank}")
        self.roles[name] = role_cls(self.ctx, *args, **kwargs)

    def call(self, role: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Apply ``method`` (a function of the role's class) to the hosted role instance."""
        return call_role(self.roles, role, method, *args, **kwargs)

    def set_tracing(self, on: bool) -> None:
        trace.enable(on)

    def drain_trace(self) -> list[dict[str, Any]]:
        """This process's trace spans since the last drain (see :mod:`megarl.metrics.trace`)."""
        return trace.drain()

    def shutdown(self) -> None:
        from megarl.parallel.init import destroy_distributed

        close_roles(self.roles)
        destroy_distributed()
