"""Placement: named pools (devices + the parallel layout their processes use) and roles mapped to them.

Roles mapped to the same pool are colocated: they live in the same worker processes (one actor
hosts e.g. policy + reference + rollout) and share its layout, so colocation never multiplies
processes or device contexts. Roles on different pools are split. Pools start concurrently.

``local=True`` hosts the (single, one-device) pool in the driver process instead of Ray actors
(:mod:`megarl.controller.local`); Ray is then never imported (it costs a one-rank run ~30 MB).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import TYPE_CHECKING, Any

from megarl.controller.handles import GroupOptions, RoleHandle
from megarl.controller.local import LocalGroup
from megarl.controller.pools import Device, PoolConfig
from megarl.controller.role import Role
from megarl.errors import ConfigError
from megarl.parallel.layout import ParallelLayout

if TYPE_CHECKING:
    from megarl.controller.group import WorkerGroup
    from megarl.controller.pools import ResourcePool


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """A pool of devices and the megatron layout of the worker group on it (dp fills the pool)."""

    nodes: int = 1
    devices_per_node: int = 1
    device: Device = Device.AUTO
    cpus_per_device: float = 1.0
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ready_timeout_s: float = 60.0

    def pool_config(self) -> PoolConfig:
        return PoolConfig(nodes=self.nodes, devices_per_node=self.devices_per_node, device=self.device,
                          cpus_per_device=self.cpus_per_device, ready_timeout_s=self.ready_timeout_s)

    def layout(self) -> ParallelLayout:
        return ParallelLayout.for_world(self.nodes * self.devices_per_node, tp=self.tp, pp=self.pp, vpp=self.vpp)


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    pools: dict[str, PoolSpec]
    roles: dict[str, str]  # role name -> pool name

    def __post_init__(self) -> None:
        for role, pool in self.roles.items():
            if pool not in self.pools:
                near = difflib.get_close_matches(pool, list(self.pools), n=1)
                raise ConfigError(
                    f"role {role!r} is placed on pool {pool!r}, which is not defined"
                    + (f"; did you mean {near[0]!r}?" if near else f"; defined pools: {sorted(self.pools)}")
                )
        unused = sorted(set(self.pools) - set(self.roles.values()))
        if unused:
            raise ConfigError(f"pools {unused} host no role; remove them or place a role on them.")
        for spec in self.pools.values():
            spec.layout()  # raises LayoutError when tp*pp does not divide the pool


class Placement:
    """The running pools and worker groups of a placement config."""

    def __init__(self, config: PlacementConfig, options: GroupOptions | None = None, *, local: bool = False) -> None:
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
                self.pools[name] = ResourcePool(name, spec.pool_config())
            for name, spec in config.pools.items():  # launch every group's actors, then connect them
                self.groups[name] = WorkerGroup(name, self.pools[name], spec.layout(), options, connect=False)
            for group in self.groups.values():
                group.connect()
        except BaseException:
            self.shutdown()
            raise

    def add_role(self, role: str, role_cls: type[Role], *args: Any, **kwargs: Any) -> RoleHandle:
        if role not in self.config.roles:
            raise ConfigError(f"role {role!r} has no placement; placed roles: {sorted(self.config.roles)}")
        return self.groups[self.config.roles[role]].add_role(role, role_cls, *args, **kwargs)

    def shutdown(self) -> None:
        for group in self.groups.values():
            group.shutdown()
        for pool in self.pools.values():
            pool.release()
