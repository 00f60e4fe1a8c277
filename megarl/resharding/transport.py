"""Execute a resharding plan over the training workers' own process group (gloo on CPU, NCCL on GPU).

Every rank walks the same buckets in the same order. Inside a bucket each slab is one point-to-point
message (``batch_isend_irecv``; the slab's index in the bucket is its tag), received straight into
the rollout shard when the slab is a contiguous part of it (dim-0 ranges), through a staging
buffer otherwise. A rank yields each finished bucket as ``[(hf_name, rollout shard)]`` for its
engine to load, then drops it. Extra memory is bounded by the bucket cap plus one Megatron
parameter's converted pieces; never a second model copy.

With split placement (a plan with ``rollout_ranks``) the messages travel over a
:class:`~megarl.resharding.link.WeightLink` joining both pools: training ranks only send (their buckets
come out empty), rollout ranks only receive (they pass no parameters).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from megarl.metrics import trace
from megarl.models.spec import ModelSpec
from megarl.resharding.buckets import Bucket, LocalPieces, dest_shape, dest_view, empty_dest, make_buckets
from megarl.resharding.link import Message, WeightLink
from megarl.resharding.plan import ReshardPlan
from megarl.resharding.stats import TransferStats


def stream_weights(
    plan: ReshardPlan,
    spec: ModelSpec,
    params: Mapping[str, torch.Tensor],
    *,
    rank: int,
    dtype: torch.dtype,
    bucket_bytes: int,
    stats: TransferStats | None = None,
    group: dist.ProcessGroup | None = None,
    full_tensors: bool = False,
    link: WeightLink | None = None,
    device: torch.device | str | None = None,
    buffer: Callable[[str, Sequence[int], torch.dtype, torch.device], torch.Tensor | None] | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield this rank's rollout shards bucket by bucket (HF names, ``dtype``, vocab trimmed).

    ``params``: global local-spec Megatron name -> this rank's shard (all its model chunks).
    ``rank``: this process's rank in ``group`` (the world the plan's layout describes), or in ``link``.
    ``full_tensors``: yield each shard inside a full-shape HF tensor (the rest NaN; see ``empty_dest``),
    for engines that load checkpoint-format tensors; the bytes moved are the same.
    ``link``: the group of a split placement (then ``group`` is unused); a rollout rank passes no ``params``
    and the ``device`` its shards go to (default: where the training shards are).
    ``buffer``: the engine's own storage of a rollout shard (name, shape, dtype, device), received into in place
    (:meth:`megarl.rollout.base.RolloutEngine.weight_buffer`); None there, or without it, a staging tensor.
    Every rank of the group must consume the whole iterator: buckets are collective.
    """
    stats = stats if stats is not None else TransferStats()
    sends = rank < plan.train.world_size  # a training rank (a rollout rank of a split plan only receives)
    pieces = LocalPieces(plan, spec, plan.train.coords(rank).tp, params, dtype) if sends else None
    itemsize = torch.empty((), dtype=dtype).element_size()
    device = torch.device(device if device is not None else next(iter(params.values())).device)
    dests: dict[str, torch.Tensor] = {}  # rollout shards being filled
    for bucket in make_buckets(plan, bucket_bytes, itemsize, full_tensors=full_tensors):
        start, start_ns, moved = time.perf_counter(), time.time_ns(), stats.bytes_sent + stats.bytes_received
        for t in bucket.tensors:  # full-shape tensors also where a receiver's slice is empty (vocabulary tails)
            if t.name not in dests and ((full_tensors and (t.name, rank) in plan.dest)
                                        or any(s.dst == rank for s in bucket.slabs if s.tensor == t.name)):
                rng = plan.dest[(t.name, rank)]
                into = None if buffer is None else buffer(t.name, dest_shape(t, rng, full_tensors), dtype, device)
                dests[t.name] = into if into is not None else empty_dest(t, rng, dtype, device, full=full_tensors)
        _exchange(plan, bucket, pieces, dests, rank, dtype, itemsize, stats, group, link, full_tensors)
        stats.seconds += time.perf_counter() - start
        trace.record(f"reshard bucket {stats.buckets}", start_ns, time.time_ns(), cat="reshard",
                     bytes_moved=stats.bytes_sent + stats.bytes_received - moved, tensors=len(bucket.tensors))
        stats.buckets += 1
        if bucket.final:
            out = [(t.name, dests.pop(t.name)) for t in bucket.tensors if t.name in dests]
            yield out
            del out  # hold no reference while the next bucket runs (the consumer clears the list)


def _exchange(plan: ReshardPlan, bucket: Bucket, pieces: LocalPieces | None, dests: dict[str, torch.Tensor],
              rank: int, dtype: torch.dtype, itemsize: int, stats: TransferStats, group, link: WeightLink | None,
              full_tensors: bool) -> None:
    messages: list[Message] = []
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    sent: dict[tuple[str, int, int], torch.Tensor] = {}  # one contiguous copy per slab, however many peers
    for tag, s in enumerate(bucket.slabs):
        if rank not in (s.src, s.dst):
            continue
        t = plan.tensor(s.tensor)
        nbytes = plan.slab_bytes(s, itemsize)
        if s.src == s.dst:  # cast straight into place
            dest_view(dests[s.tensor], t, _dest_start(plan, s.tensor, rank, full_tensors), s).copy_(pieces.view(s))
            stats.bytes_kept += nbytes
            continue
        if s.src == rank:
            key = (s.tensor, s.start, s.stop)
            if key not in sent:
                sent[key] = pieces.slab(s)
            messages.append(Message(True, sent[key], s.dst, tag))
            stats.bytes_sent += nbytes
        else:
            view = dest_view(dests[s.tensor], t, _dest_start(plan, s.tensor, rank, full_tensors), s)
            buf = view if view.is_contiguous() else torch.empty(view.shape, dtype=dtype, device=view.device)
            if buf is not view:
                staged.append((view, buf))
            messages.append(Message(False, buf, s.src, tag))
            stats.bytes_received += nbytes
    if link is not None:
        link.exchange(messages)
    elif messages:
        ops = [dist.P2POp(dist.isend if m.send else dist.irecv, m.tensor, _peer(m.peer, group), group=group,
                          tag=m.tag) for m in messages]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    for view, buf in staged:
        view.copy_(buf)


def _dest_start(plan: ReshardPlan, name: str, rank: int, full_tensors: bool) -> int:
    """Where the receiving tensor starts along the split dimension: 0 for full-shape tensors."""
    return 0 if full_tensors else plan.dest[(name, rank)][0]


def _peer(rank_in_group: int, group) -> int:
    """P2POp takes global ranks."""
    return rank_in_group if group is None else dist.get_global_rank(group, rank_in_group)
