"""What the driver holds of a worker group, whatever hosts it: typed role handles, pending calls,
the group options and the error a failed call raises. No Ray here.

Both kinds of worker group (``WorkerGroup``: Ray actors; ``LocalGroup``: this process) implement
:class:`GroupLike`, the one protocol a handle relies on.

Dispatch modes of :class:`RoleHandle`:

* :meth:`RoleHandle.all` - same arguments to every rank, every rank's result (rank order);
* :meth:`RoleHandle.one` - one rank;
* :meth:`RoleHandle.dp` - a :class:`Batch` cut into DP shards (filler rows only where needed),
  shard ``d`` put once and sent to every rank of DP rank ``d``; results collected from each DP
  rank's owner (last PP stage, TP rank 0), in sample order, filler removed.

Each has an ``*_async`` twin returning a :class:`PendingCall`, so calls on independent groups overlap.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, runtime_checkable

from megarl.controller import dispatch
from megarl.controller.spec import GroupOptions
from megarl.data.batch import Batch
from megarl.errors import MegarlError
from megarl.parallel.layout import ParallelLayout

if TYPE_CHECKING:  # the worker side (its methods run megarl.parallel.cpu_compat's suspension): typing only here
    from megarl.controller.role import Role

R = TypeVar("R", bound="Role")
T = TypeVar("T")
P = ParamSpec("P")


class WorkerError(MegarlError, RuntimeError):
    """A worker raised (or died, or timed out); the group has been torn down. ``lost``: the worker process
    died or hung (its node may be gone), so fresh workers may succeed where it failed; otherwise it raised.

    ``role``: the role whose call failed; ``roles``: every role the failed process hosted (colocated roles share
    processes: a dead policy worker takes the reference with it); ``host``, ``node_ip``, ``pid``: where it ran,
    when one rank failed and its group knew (``None`` for a timeout of several ranks)."""

    def __init__(self, message: str, *, role: str, rank: int | None, lost: bool = False,
                 roles: tuple[str, ...] = (), host: str | None = None, node_ip: str | None = None,
                 pid: int | None = None) -> None:
        super().__init__(message)
        self.role = role
        self.rank = rank
        self.lost = lost
        self.roles = roles or (role,)
        self.host, self.node_ip, self.pid = host, node_ip, pid


@runtime_checkable
class GroupLike(Protocol):
    """What a role handle needs of a worker group, whatever hosts it."""

    layout: ParallelLayout
    options: GroupOptions

    @property
    def world_size(self) -> int: ...

    def put(self, obj: Any) -> Any:
        """What :meth:`submit` accepts for an argument shared by several ranks (put once)."""

    def submit(self, role: str, rank: int, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Start ``method(<role's instance on rank>, *args, **kwargs)``; a future for :meth:`gather`."""

    def gather(self, role: str, futures: dict[int, Any], timeout_s: float | None) -> dict[int, Any]:
        """Results by rank; raises :class:`WorkerError` (after tearing the group down) on a failure or timeout."""

    def finished(self, futures: dict[int, Any]) -> list[int]:
        """The ranks whose futures are done (without waiting)."""


class PendingCall(Generic[T]):
    """Futures of one group call; :meth:`result` waits, fails fast on the first error."""

    def __init__(self, group: GroupLike, role: str, futures: dict[int, Any],
                 finish: Callable[[dict[int, Any]], T]) -> None:
        self._group, self._role, self._futures, self._finish = group, role, futures, finish
        self._results: dict[int, Any] = {}  # of the ranks :meth:`poll` found done

    def result(self, timeout_s: float | None = ...) -> T:  # type: ignore[assignment]
        timeout = self._group.options.timeouts.call_s if timeout_s is ... else timeout_s
        rest = {r: f for r, f in self._futures.items() if r not in self._results}
        return self._finish(self._results | self._group.gather(self._role, rest, timeout))

    def poll(self) -> bool:
        """Whether every rank is done, without waiting; raises :class:`WorkerError` if one that is done failed."""
        done = [r for r in self._group.finished(self._futures) if r not in self._results]
        if done:
            self._results |= self._group.gather(self._role, {r: self._futures[r] for r in done}, 0)
        return len(self._results) == len(self._futures)

    def running(self) -> list[int]:
        """The ranks not done yet, without waiting."""
        done = set(self._results) | set(self._group.finished(self._futures))
        return sorted(set(self._futures) - done)


class RoleHandle(Generic[R]):
    """Typed calls on one role of a worker group. ``method`` is the role class's own function, so a type
    checker follows each call's arguments and result (``handle.dp(PolicyRole.generate, prompts, params)``)."""

    def __init__(self, group: GroupLike, name: str, role_cls: Callable[..., R]) -> None:
        self.group, self.name, self.role_cls = group, name, role_cls

    def all_async(self, method: Callable[Concatenate[R, P], T], *args: P.args,
                  **kwargs: P.kwargs) -> PendingCall[list[T]]:
        futures = {r: self.group.submit(self.name, r, method, *args, **kwargs) for r in range(self.group.world_size)}
        return PendingCall(self.group, self.name, futures, lambda res: [res[r] for r in sorted(res)])

    def one_async(self, rank: int, method: Callable[Concatenate[R, P], T], *args: P.args,
                  **kwargs: P.kwargs) -> PendingCall[T]:
        futures = {rank: self.group.submit(self.name, rank, method, *args, **kwargs)}
        return PendingCall(self.group, self.name, futures, lambda res: res[rank])

    def dp_async(self, method: Callable[Concatenate[R, Batch, P], Batch | None], batch: Batch, *args: P.args,
                 **kwargs: P.kwargs) -> PendingCall[Batch]:
        """Each DP rank's shard in, the owners' result rows back in sample order. A method may return
        several rows per input row (k responses per prompt), grouped by input row: filler rows, which
        come last, are dropped in proportion."""
        layout = self.group.layout
        shards, pad = batch.shard(layout.dp)
        futures = self._submit_shards(method, shards, args, kwargs)
        owners = dispatch.collect_ranks(layout)

        def finish(res: dict[int, Any]) -> Batch:
            out = Batch.concat([res[r] for r in owners])
            per_row, rest = divmod(len(out), len(batch) + pad)
            if rest:
                raise ValueError(f"{self.name}.{method.__name__} returned {len(out)} rows for {len(batch) + pad} "
                                 "input rows: not a whole number per input row")
            return out.unpad(pad * per_row)

        return PendingCall(self.group, self.name, futures, finish)

    def dp_split_async(self, method: Callable[Concatenate[R, Batch, P], T], batch: Batch, *args: P.args,
                       **kwargs: P.kwargs) -> PendingCall[list[T]]:
        """Like :meth:`dp_async` for calls that must not see filler rows (training steps): the batch is
        cut into ``dp`` equal shards (its size must divide) and each DP rank's owner result comes back."""
        layout = self.group.layout
        futures = self._submit_shards(method, batch.chunk(layout.dp), args, kwargs)
        owners = dispatch.collect_ranks(layout)
        return PendingCall(self.group, self.name, futures, lambda res: [res[r] for r in owners])

    def _submit_shards(self, method: Callable, shards: Sequence[Batch], args: tuple, kwargs: dict) -> dict[int, Any]:
        """Shard ``d`` put once and sent to every rank of DP rank ``d``; the futures by rank."""
        refs = [self.group.put(shard) for shard in shards]
        return {rank: self.group.submit(self.name, rank, method, refs[d], *args, **kwargs)
                for d, ranks in enumerate(dispatch.dp_members(self.group.layout)) for rank in ranks}

    def dp_split(self, method: Callable[Concatenate[R, Batch, P], T], batch: Batch, *args: P.args,
                 **kwargs: P.kwargs) -> list[T]:
        return self.dp_split_async(method, batch, *args, **kwargs).result()

    def all(self, method: Callable[Concatenate[R, P], T], *args: P.args, **kwargs: P.kwargs) -> list[T]:
        return self.all_async(method, *args, **kwargs).result()

    def one(self, rank: int, method: Callable[Concatenate[R, P], T], *args: P.args, **kwargs: P.kwargs) -> T:
        return self.one_async(rank, method, *args, **kwargs).result()

    def dp(self, method: Callable[Concatenate[R, Batch, P], Batch | None], batch: Batch, *args: P.args,
           **kwargs: P.kwargs) -> Batch:
        return self.dp_async(method, batch, *args, **kwargs).result()


def wait_all(calls: Sequence[PendingCall[Any]], poll_s: float = 0.02, *, deadline_s: float | None = None,
             what: str = "") -> list[Any]:
    """Results of several pending calls (on different groups, running concurrently), in order. The first
    failure in any of them raises at once: the ranks of another call may be blocked in a collective with the
    failed ones (a weight sync across pools) and would otherwise hold the wait until their own timeout.

    ``deadline_s``: a deadline of this wait's own (e.g. ``cluster.timeouts.push_s``), shorter than the calls'
    ``call_s``: past it the calls still running fail as lost workers (:class:`WorkerError` with ``lost=True``, the
    ranks still running of ``what`` named), their groups torn down."""
    limit = deadline_s if deadline_s is not None else max((c._group.options.timeouts.call_s or math.inf)
                                                          for c in calls)
    deadline = time.monotonic() + limit
    while not all([c.poll() for c in calls]):  # every call polled each round: the first failure raises
        if time.monotonic() > deadline:
            stalled = _stalled(calls, deadline_s, what) if deadline_s is not None else None
            if stalled is not None:
                raise stalled
            break
        time.sleep(poll_s)
    return [c.result() for c in calls]  # past the deadline: the calls' own timeouts tear their groups down


def _stalled(calls: Sequence[PendingCall[Any]], deadline_s: float, what: str) -> WorkerError | None:
    """The lost-worker error of calls past ``deadline_s`` (None if they all finished meanwhile): each still-running
    call's group is torn down (its own timeout error, raised at once, names the processes and is the cause). The
    error's ``role`` and ``rank`` are the first call's still running; ``roles``, every role of the groups torn down."""
    running = [(c, c.running()) for c in calls]
    if not any(ranks for _, ranks in running):
        return None
    causes: list[WorkerError] = []
    for call, ranks in running:
        if ranks:
            try:
                call.result(timeout_s=0)  # a call still running: its group kills its ranks and raises
            except WorkerError as e:
                causes.append(e)
    stuck = "; ".join(f"{c._role} ranks {ranks}" for c, ranks in running if ranks)
    first = next((c, ranks) for c, ranks in running if ranks)
    error = WorkerError(f"{what or 'a call'} did not finish within {deadline_s:g} s (still running: {stuck}): a rank "
                        "stopped, hung or lost its link; the groups were torn down.",
                        role=first[0]._role, rank=first[1][0] if len(first[1]) == 1 else None, lost=True,
                        roles=tuple(dict.fromkeys(r for e in causes for r in e.roles)))
    error.__cause__ = causes[0] if causes else None
    return error
