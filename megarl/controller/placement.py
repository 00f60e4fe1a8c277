"""Placement: named pools (devices + the parallel layout their processes use) and roles mapped to them.

Roles mapped to the same pool are colocated: they live in the same worker processes (one actor
hosts e.g. policy + reference + rollout) and share its layout, so colocation never multiplies
processes or device contexts. Roles on different pools are split. Pools start concurrently.

``local=True`` hosts the (single, one-device) pool in the driver process instead of Ray actors
(:mod:`megarl.controller.local`); Ray is then never imported (it costs a one-rank run ~30 MB).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Concatenate, ParamSpec, TypeVar

from megarl.controller.handles import RoleHandle
from megarl.controller.local import LocalGroup
from megarl.controller.role import Role, WorkerContext
from megarl.controller.spec import GroupOptions, PlacementConfig
from megarl.errors import ConfigError

if TYPE_CHECKING:
    from megarl.controller.group import WorkerGroup
    from megarl.controller.pools import ResourcePool

R = TypeVar("R", bound=Role)
P = ParamSpec("P")


class Placement:
    """The running pools and worker groups of a placement config."""

    def __init__(self, config: PlacementConfig, options: GroupOptions | None = None, *, local: bool = False,
                 run: str = "") -> None:
        """``run``: the run's name in its worker processes' titles (``ps``: ``megarl[run] policy+reference rank 0
        ...``), e.g. its output directory's name."""
        self.config = config
        options = options or GroupOptions()
        self.pools: dict[str, ResourcePool] = {}
        self.groups: dict[str, WorkerGroup | LocalGroup] = {}
        if local:
            if len(config.pools) != 1:
                raise ConfigError(f"local placement hosts one pool in the driver process, found {sorted(config.pools)}")
            (name, spec), = config.pools.items()
            self.groups[name] = LocalGroup(name, spec.layout(), options)
            return
        from megarl.controller.group import WorkerGroup  # Ray
        from megarl.controller.pools import ResourcePool

        try:
            for name, spec in config.pools.items():
                self.pools[name] = ResourcePool(name, spec)
            for name, spec in config.pools.items():  # launch every group's actors, then connect them
                self.groups[name] = WorkerGroup(name, self.pools[name], spec.layout(), options, connect=False,
                                                run=run)
            for group in self.groups.values():
                group.connect()
        except BaseException:
            self.shutdown()
            raise

    def add_role(self, role: str, role_cls: Callable[Concatenate[WorkerContext, P], R], *args: P.args,
                 **kwargs: P.kwargs) -> RoleHandle[R]:
        if role not in self.config.roles:
            raise ConfigError(f"role {role!r} has no placement; placed roles: {sorted(self.config.roles)}")
        return self.groups[self.config.roles[role]].add_role(role, role_cls, *args, **kwargs)

    def shutdown(self, kill: bool = False) -> None:
        """Stop every group (``kill=True``: without waiting for calls in flight, e.g. ranks blocked on a lost peer)
        and release the pools."""
        for group in self.groups.values():
            group.shutdown(kill=kill)
        for pool in self.pools.values():
            pool.release()
