"""The process group of a weight sync across pools: training ranks and rollout ranks in worlds of their own.

With split placement the policy's ranks and the rollout engines' ranks belong to different torch.distributed
worlds (one per worker group), so the resharding plan's point-to-point messages travel over a group of
their own: a ``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (GPU) built straight from a TCPStore that
training rank 0 opens on a free port. It is never registered as a torch.distributed group (a process has
one default world), so messages go through the group object's own ``send`` / ``recv``. Ranks: the training
ranks first (``0..T-1``, their rank in the training world), then the rollout ranks (``T + their rank``),
as in :func:`megarl.resharding.plan.make_plan` with ``rollout_ranks``.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist


class Message(NamedTuple):
    send: bool  # True: send ``tensor`` to ``peer``; False: receive into it
    tensor: torch.Tensor
    peer: int  # rank in the group the messages travel over
    tag: int


def listen(host: str, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """Rank 0: a rendezvous store on a free port of ``host`` (the OS picks it); (store, port)."""
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return store, store.port


class WeightLink:
    """One rank's membership of a weight-sync group spanning two pools; blocks until every rank joined."""

    def __init__(self, host: str, port: int, rank: int, size: int, *, device: torch.device | str,
                 init_timeout_s: float, collective_timeout_s: float, store: dist.TCPStore | None = None) -> None:
        """``init_timeout_s``: the rendezvous; ``collective_timeout_s``: one exchange's wait (a push may wait behind
        the other pool's generation or checkpoint), the group's own timeout."""
        if store is None:  # rank 0 passes the store it opened with :func:`listen`
            store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=init_timeout_s))
        timeout = datetime.timedelta(seconds=collective_timeout_s)
        self._store = store  # keep the master alive as long as the group
        prefixed = dist.PrefixStore("megarl-weight-link", store)
        self.rank, self.size = rank, size
        if torch.device(device).type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)

    def exchange(self, messages: Sequence[Message]) -> None:
        """Post every message, then wait for all (a rank either only sends or only receives in a split sync,
        so the order of posting cannot deadlock)."""
        works = [self.pg.send([m.tensor], m.peer, m.tag) if m.send else self.pg.recv([m.tensor], m.peer, m.tag)
                 for m in messages]
        for w in works:
            w.wait()

    def close(self) -> None:
        self.pg = None
        self._store = None
