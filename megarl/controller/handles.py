"""What the driver holds of a worker group, whatever hosts it: typed role handles, pending calls,
the group options and the error a failed call raises. No Ray here.

A group (``WorkerGroup``: Ray actors; ``LocalGroup``: this process) provides ``layout``, ``options``,
``world_size``, ``_submit(role, rank, method, *args)`` -> a future, ``_gather(role, futures, timeout)``
-> results by rank (raising :class:`WorkerError`), and ``_put(obj)`` -> what ``_submit`` accepts for a
shared argument (a Ray object reference, or the object itself).

Dispatch modes of :class:`RoleHandle`:

* :meth:`RoleHandle.all` - same arguments to every rank, every rank's result (rank order);
* :meth:`RoleHandle.one` - one rank;
* :meth:`RoleHandle.dp` - a :class:`Batch` cut into DP shards (filler rows only where needed),
  shard ``d`` put once and sent to every rank of DP rank ``d``; results collected from each DP
  rank's owner (last PP stage, TP rank 0), in sample order, filler removed.

Each has an ``*_async`` twin returning a :class:`PendingCall`, so calls on independent groups overlap.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from megarl.controller import dispatch
from megarl.controller.role import Role
from megarl.data.batch import Batch
from megarl.errors import MegarlError

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

    def __init__(self, group: Any, role: str, futures: dict[int, Any],
                 finish: Callable[[dict[int, Any]], T]) -> None:
        self._group, self._role, self._futures, self._finish = group, role, futures, finish

    def result(self, timeout_s: float | None = ...) -> T:  # type: ignore[assignment]
        timeout = self._group.options.call_timeout_s if timeout_s is ... else timeout_s
        return self._finish(self._group._gather(self._role, self._futures, timeout))


class RoleHandle(Generic[R]):
    """Typed calls on one role of a worker group. ``method`` is the role class's own function."""

    def __init__(self, group: Any, name: str, role_cls: type[R]) -> None:
        self.group, self.name, self.role_cls = group, name, role_cls

    def all_async(self, method: Callable[..., T], *args: Any, **kwargs: Any) -> PendingCall[list[T]]:
        futures = {r: self.group._submit(self.name, r, method, *args, **kwargs) for r in range(self.group.world_size)}
        return PendingCall(self.group, self.name, futures, lambda res: [res[r] for r in sorted(res)])

    def one_async(self, rank: int, method: Callable[..., T], *args: Any, **kwargs: Any) -> PendingCall[T]:
        futures = {rank: self.group._submit(self.name, rank, method, *args, **kwargs)}
        return PendingCall(self.group, self.name, futures, lambda res: res[rank])

    def dp_async(self, method: Callable[..., Batch], batch: Batch, *args: Any, **kwargs: Any) -> PendingCall[Batch]:
        layout = self.group.layout
        shards, pad = batch.shard(layout.dp)
        futures = self._submit_shards(method, shards, args, kwargs)
        owners = dispatch.collect_ranks(layout)
        return PendingCall(self.group, self.name, futures,
                           lambda res: Batch.concat([res[r] for r in owners]).unpad(pad))

    def dp_split_async(self, method: Callable[..., T], batch: Batch, *args: Any, **kwargs: Any) -> PendingCall[list[T]]:
        """Like :meth:`dp_async` for calls that must not see filler rows (training steps): the batch is
        cut into ``dp`` equal shards (its size must divide) and each DP rank's owner result comes back."""
        layout = self.group.layout
        futures = self._submit_shards(method, batch.chunk(layout.dp), args, kwargs)
        owners = dispatch.collect_ranks(layout)
        return PendingCall(self.group, self.name, futures, lambda res: [res[r] for r in owners])

    def _submit_shards(self, method: Callable, shards: Sequence[Batch], args: tuple, kwargs: dict) -> dict[int, Any]:
        """Shard ``d`` put once and sent to every rank of DP rank ``d``; the futures by rank."""
        refs = [self.group._put(shard) for shard in shards]
        return {rank: self.group._submit(self.name, rank, method, refs[d], *args, **kwargs)
                for d, ranks in enumerate(dispatch.dp_members(self.group.layout)) for rank in ranks}

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
