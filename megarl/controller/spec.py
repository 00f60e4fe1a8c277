"""What a run asks of the cluster, as typed data: launchers, pools, role placement, group options.

These are the controller's own configuration types, nested as they are in the run's YAML
(``cluster:`` in :mod:`megarl.config.train`); each default lives here once. Pure module: no Ray,
no torch.distributed (the driver validates a config without starting anything).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
from typing import ClassVar

from megarl.errors import ConfigError
from megarl.parallel.layout import Auto, ParallelLayout


class Launcher(enum.Enum):
    RAY = "ray"  # Ray worker processes host the pools (any size)
    LOCAL = "local"  # the driver process hosts one pool of one rank itself (no Ray, no worker processes)


class Device(enum.Enum):
    AUTO = "auto"  # GPU if the cluster has GPUs, else CPU slots
    GPU = "gpu"
    CPU = "cpu"


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """Device slots reserved as Ray placement groups (:class:`megarl.controller.pools.ResourcePool`)."""

    nodes: int = 1  # machines in the pool
    devices_per_node: int = 1  # GPUs (or CPU slots) per machine; one rank each
    device: Device = Device.AUTO  # auto: GPUs if the cluster has them, else CPU slots (whose workers see no GPU)
    cpus_per_device: float = 1.0  # CPU slot size (CPU pools) or CPUs reserved beside each GPU
    ready_timeout_s: float = 60.0  # a reservation still pending after this (resources held by others) fails
    # memory of one device, decimal GB, for a layout size set to auto (docs/planner.md §13); null: read from the
    # driver's GPU when auto needs it
    device_memory_gb: float | None = None

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.devices_per_node < 1:
            raise ConfigError(f"a pool needs nodes >= 1 and devices_per_node >= 1, found {self.nodes}, "
                              f"{self.devices_per_node}")
        if self.cpus_per_device <= 0:
            raise ConfigError(f"cpus_per_device must be > 0, found {self.cpus_per_device}")
        if self.device_memory_gb is not None and not self.device_memory_gb > 0:
            raise ConfigError(f"device_memory_gb must be > 0 (decimal GB per device) or null, found "
                              f"{self.device_memory_gb}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node


@dataclasses.dataclass(frozen=True)
class PoolSpec(PoolConfig):
    """A pool of devices and the megatron-core layout of the worker group on it (dp fills the pool)."""

    tp: int | Auto = 1  # tensor-parallel size of the roles on this pool; auto: the planner's (docs/planner.md §13)
    pp: int | Auto = 1  # pipeline-parallel size (dp = devices / (tp x pp x cp)); auto: the planner's
    vpp: int | None = None  # virtual pipeline stages per rank (interleaved schedule); null: none
    cp: int = 1  # context-parallel size: every packed sequence split over cp ranks holding the same weights
    # expert-parallel size of its MoE models (the experts split over ep of a stage's tp x cp x dp ranks); auto:
    # the planner's choice
    ep: int | Auto = 1
    # written by megarl when it decided auto sizes of this pool (and rollout.engine.tp): the layout chosen and why
    # (a record: nothing reads it, a reloaded config.yaml keeps it)
    auto_reason: str | None = None

    AUTO_SIZES: ClassVar[tuple[str, ...]] = ("tp", "pp", "ep")

    @property
    def auto_sizes(self) -> tuple[str, ...]:
        """The layout sizes left to megarl (``auto``), of those that may be (:attr:`AUTO_SIZES`)."""
        return tuple(name for name in self.AUTO_SIZES if getattr(self, name) is Auto.AUTO)

    def layout(self) -> ParallelLayout:
        if self.auto_sizes:  # megarl.config.auto decides them before anything reads the layout
            raise ConfigError(f"the pool's {', '.join(self.auto_sizes)} are auto, not yet decided: "
                              "megarl.config.auto.decide_layout(cfg) decides them (megarl.config.resolve does).")
        return ParallelLayout.for_world(self.world_size, tp=self.tp, pp=self.pp, vpp=self.vpp, cp=self.cp, ep=self.ep)


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
            spec.layout()  # raises LayoutError when tp*pp*cp does not divide the pool


@dataclasses.dataclass(frozen=True)
class Timeouts:
    init_s: float = 300.0  # worker start-up, rendezvous and role construction (model loading)
    call_s: float | None = 3600.0  # one call on a worker group (a generation, an update); null: wait forever
    # one collective's wait before it is aborted (NCCL's watchdog) in the worker groups' worlds, megatron-core's
    # groups and the weight link; must outlast what a rank may wait through there: a peer's generation,
    # checkpoint or model load (an async weight push waits behind a generation). init_s bounds the rendezvous
    collective_s: float = 3600.0
    # a weight push to a rollout pool (cluster.placement.rollout), counted from the moment every rollout rank has
    # run the calls queued before it (under async the generation in flight: one chunk with partial rollouts, else
    # whole responses; call_s bounds that wait) to the end of the transfer on both pools; past it the push fails as
    # a lost worker (a rank stopped or its link hung) and the run restarts its workers and resumes
    # (trainer.max_restarts). Set it above the longest transfer plus load into the engines. null: call_s bounds it
    push_s: float | None = 600.0

    def __post_init__(self) -> None:
        if self.push_s is not None and not self.push_s > 0:
            raise ConfigError(f"cluster.timeouts.push_s must be > 0 seconds (null: no deadline of its own); found "
                              f"{self.push_s}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupOptions:
    """How a worker group is started and called."""

    seed: int = 0  # torch/numpy/python seeds of every rank (offset by rank where megatron-core does)
    timeouts: Timeouts = Timeouts()
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # extra environment for the workers
