"""LocalGroup: a worker group of one rank hosted by the driver process itself (no Ray, no worker process).

For runs on one device (one GPU, or the CPU cores of one machine): the driver joins a torch.distributed
world of one, initialises megatron-core and constructs the roles in-process, so a call costs a function
call instead of a Ray round trip and a pickled batch, and the run holds one Python process instead of a
driver, Ray's daemons and a worker. The roles are the same classes, called through the same
:class:`~megarl.controller.handles.RoleHandle`; only hosting differs. A role that raises makes the call
raise :class:`~megarl.controller.handles.WorkerError` like a Ray worker's would (the group stays usable:
there are no peers to unblock). Arguments are passed by reference, not copied through an object store,
so roles must not modify their inputs in place (none does; results are new objects either way).
"""

from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

from megarl.controller.handles import RoleHandle, WorkerError
from megarl.controller.role import Role, WorkerContext, call_role, close_roles
from megarl.controller.spec import GroupOptions
from megarl.errors import LayoutError
from megarl.metrics import trace
from megarl.parallel.layout import ParallelLayout

logger = logging.getLogger(__name__)

R = TypeVar("R", bound=Role)
P = ParamSpec("P")


class _Done:
    """A finished call: its result or the exception it raised (with the traceback text)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.value, self.error, self.tb = None, None, ""
        try:
            self.value = fn()
        except Exception as e:  # noqa: BLE001 - re-raised by LocalGroup.gather as a WorkerError
            self.error, self.tb = e, traceback.format_exc()


class LocalGroup:
    """Rank 0 of a world of one, in this process. Roles are attached with :meth:`add_role`."""

    def __init__(self, name: str, layout: ParallelLayout, options: GroupOptions | None = None) -> None:
        if layout.world_size != 1:
            raise LayoutError(f"worker group {name!r} runs in the driver process (cluster.launcher: local), which is "
                              f"one rank, but layout {layout} needs {layout.world_size}; use cluster.launcher: ray "
                              "for several devices.")
        import torch

        from megarl.parallel.init import init_distributed

        self.name, self.layout, self.options = name, layout, options or GroupOptions()
        self.alive = True
        init_distributed(layout, seed=self.options.seed, collective_timeout_s=self.options.timeouts.collective_s)
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
        self.contexts = [WorkerContext(0, 1, layout, layout.coords(0), "127.0.0.1", "local", os.getpid(), device)]
        self.roles: dict[str, Role] = {}
        logger.info("worker group %s: in the driver process (pid %d), %s, device %s", name, os.getpid(), layout,
                    device)

    @property
    def world_size(self) -> int:
        return 1

    def add_role(self, name: str, role_cls: Callable[Concatenate[WorkerContext, P], R], *args: P.args,
                 **kwargs: P.kwargs) -> RoleHandle[R]:
        """Construct ``role_cls(ctx, *args, **kwargs)`` here; return its typed handle."""
        if name in self.roles:
            raise ValueError(f"role {name!r} is already hosted by worker group {self.name!r}")
        done = _Done(lambda: role_cls(self.contexts[0], *args, **kwargs))
        self.roles[name] = self.gather(name, {0: done}, None)[0]
        return RoleHandle(self, name, role_cls)

    def put(self, obj: Any) -> Any:
        return obj

    def submit(self, role: str, rank: int, method: Callable, *args: Any, **kwargs: Any) -> _Done:
        if not self.alive:
            raise WorkerError(f"worker group {self.name!r} was shut down", role=role, rank=None)
        return _Done(lambda: call_role(self.roles, role, method, *args, **kwargs))

    def gather(self, role: str, futures: dict[int, _Done], timeout_s: float | None) -> dict[int, Any]:
        for rank, done in futures.items():
            if done.error is not None:
                e = done.error
                raise WorkerError(f"{role} failed in worker group {self.name!r} (in the driver process, "
                                  f"{self.layout}): {type(e).__name__}: {e}\ntraceback:\n{done.tb}",
                                  role=role, rank=rank) from e
        return {rank: done.value for rank, done in futures.items()}

    def finished(self, futures: dict[int, _Done]) -> list[int]:
        return list(futures)  # a local call is done when submitted

    def set_tracing(self, on: bool) -> None:
        trace.enable(on)

    def drain_trace(self) -> list[list[dict[str, Any]]]:
        """The spans recorded in this process since the last drain. In local mode the driver's spans and
        the roles' share one recorder, so the driver's come back here too."""
        return [trace.drain()]

    def shutdown(self, kill: bool = False) -> None:
        if not self.alive:
            return
        from megarl.parallel.init import destroy_distributed

        self.alive = False
        close_roles(self.roles)
        destroy_distributed()
