"""What runs inside a worker process: the per-rank context and the Role base class.

A role (policy, critic, reference, reward model; test roles) is a plain class constructed inside a
worker process with a :class:`WorkerContext` as its first argument. Several roles placed on one pool
live in the same processes and share its torch.distributed world and megatron-core parallel state.
No Ray here: roles must not depend on how they are hosted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from megarl.metrics import trace
from megarl.parallel import cpu_compat
from megarl.parallel.layout import ParallelLayout, RankCoords


@dataclasses.dataclass(frozen=True)
class WorkerContext:
    rank: int
    world_size: int
    layout: ParallelLayout
    coords: RankCoords
    node_ip: str
    node_id: str  # Ray node id (several simulated nodes can share one IP)
    pid: int
    device: str  # "cuda:0" or "cpu"

    @property
    def is_collect_rank(self) -> bool:
        """The rank whose result stands for its data-parallel rank (last PP stage, TP and CP rank 0)."""
        return self.coords.tp == 0 and self.coords.cp == 0 and self.coords.pp == self.layout.pp - 1


class Role:
    """Base class of everything hosted in a worker process."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx

    def close(self) -> None:
        """Release what outlives the object (engines' process groups, shared memory); called once at shutdown."""


def close_roles(roles: dict[str, Role]) -> None:
    """Close and drop every hosted role (the worker's shutdown, before its process group goes)."""
    for role in roles.values():
        role.close()
    roles.clear()


def call_role(roles: dict[str, Role], role: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Apply ``method`` (a function of the role's class) to the hosted instance, as a traced span.

    A role's methods are megarl's code: on a machine without CUDA they run without megatron-core's per-op
    CUDA -> CPU redirection, which the engine re-enters where it calls megatron-core
    (:mod:`megarl.parallel.cpu_compat`)."""
    with cpu_compat.suspended(), trace.span(f"{role}.{method.__name__}", cat="call"):
        return method(roles[role], *args, **kwargs)
