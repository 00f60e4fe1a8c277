"""Buckets of a resharding plan, and the local tensor work on both ends of a transfer.

Pure torch (no process group): which HF tensors travel together (size-capped buckets in the plan's
global order), how a rank turns its Megatron shard into HF-space pieces (q/k/v out of the
per-group interleaving, gate/up halves, vocabulary padding trimmed, cast to the rollout dtype), and
how a receiving rank assembles its rollout shard from slabs. The tied output layer never appears:
the plan lists ``embed_tokens`` once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from megarl.models.mapping import Kind, tensor_maps
from megarl.models.spec import ModelSpec
from megarl.resharding.plan import HFTensor, ReshardPlan, Slab, Split, source_range


@dataclasses.dataclass(frozen=True)
class Bucket:
    tensors: tuple[HFTensor, ...]  # tensors with slabs in this bucket
    slabs: tuple[Slab, ...]  # in plan order
    final: bool = True  # False: an early part of one tensor over the cap; its shard is complete after the last part


def make_buckets(plan: ReshardPlan, cap_bytes: int, itemsize: int, *, full_tensors: bool = False) -> list[Bucket]:
    """Consecutive tensors of the plan grouped so that no rank's transient bytes in a bucket (its
    rollout shards, staging buffers, outgoing copies) exceed ``cap_bytes``. A tensor over the cap
    travels alone, in parts whose slabs are cut to fit the cap (its rollout shard is the only thing
    larger than the cap that a rank ever holds). ``full_tensors``: receivers hold full-shape tensors
    (see :func:`empty_dest`), counted whole. A pure function of the plan: every rank computes the same
    buckets."""
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, found {cap_bytes}")
    ranks = range(len(plan.places))  # every rank of the plan's world (training ranks, then any rollout pool)
    by_tensor: dict[str, list[Slab]] = {}
    for s in plan.slabs:
        by_tensor.setdefault(s.tensor, []).append(s)
    buckets: list[Bucket] = []
    current: list[HFTensor] = []
    load = dict.fromkeys(ranks, 0)
    for t in plan.tensors:
        size = _transient_bytes(plan, t, by_tensor[t.name], itemsize, with_dest=True, full_tensors=full_tensors)
        if current and any(load[r] + size.get(r, 0) > cap_bytes for r in ranks):
            buckets.append(_bucket(current, by_tensor))
            current, load = [], dict.fromkeys(ranks, 0)
        if any(n > cap_bytes for n in size.values()):
            buckets.extend(_parts(plan, t, by_tensor[t.name], cap_bytes, itemsize))
            continue
        current.append(t)
        for r, n in size.items():
            load[r] += n
    if current:
        buckets.append(_bucket(current, by_tensor))
    return buckets


def _parts(plan: ReshardPlan, t: HFTensor, slabs: list[Slab], cap: int, itemsize: int) -> list[Bucket]:
    """One tensor over the cap: slabs cut into ranges of <= cap/4 bytes, grouped so that each part's
    staging and outgoing copies stay within the cap on every rank."""
    unit = t.row_elems * itemsize
    rows = max(1, cap // 4 // unit)
    pieces = [dataclasses.replace(s, start=a, stop=min(a + rows, s.stop))
              for s in slabs for a in range(s.start, s.stop, rows)] if t.dim is not None else slabs
    parts: list[list[Slab]] = [[]]
    load: dict[int, int] = {}
    for s in pieces:
        size = _transient_bytes(plan, t, [s], itemsize, with_dest=False)
        if parts[-1] and any(load.get(r, 0) + n > cap for r, n in size.items()):
            parts.append([])
            load = {}
        parts[-1].append(s)
        for r, n in size.items():
            load[r] = load.get(r, 0) + n
    return [Bucket((t,), tuple(p), final=i == len(parts) - 1) for i, p in enumerate(parts)]


def _transient_bytes(plan: ReshardPlan, t: HFTensor, slabs: list[Slab], itemsize: int, *,
                     with_dest: bool, full_tensors: bool = False) -> dict[int, int]:
    """Per rank: staging for non-contiguous received slabs + outgoing copies (+ the rollout shard, or the
    full tensor with ``full_tensors``)."""
    out: dict[int, int] = {}
    sent: set[tuple[int, int, int]] = set()
    if with_dest and full_tensors:  # every receiving rank holds the full shape, even with an empty slice
        out = dict.fromkeys(plan.receivers, t.length * t.row_elems * itemsize)
        with_dest = False
    for s in slabs:
        n = plan.slab_bytes(s, itemsize)
        if s.src != s.dst:
            if t.dim not in (None, 0):
                out[s.dst] = out.get(s.dst, 0) + n
            if (s.src, s.start, s.stop) not in sent:
                sent.add((s.src, s.start, s.stop))
                out[s.src] = out.get(s.src, 0) + n
        if with_dest:
            out[s.dst] = out.get(s.dst, 0) + n
    return out


def _bucket(tensors: list[HFTensor], by_tensor: dict[str, list[Slab]]) -> Bucket:
    return Bucket(tuple(tensors), tuple(s for t in tensors for s in by_tensor[t.name]))


# ------------------------------------------------------------------------------------ sending side


class LocalPieces:
    """HF-space pieces of one rank's Megatron shards, split lazily, one Megatron parameter at a time
    (views, except q/k/v which must be un-interleaved); cast to the rollout dtype per slab.

    ``params``: global local-spec Megatron name -> this rank's shard (as in the training model).
    """

    def __init__(self, plan: ReshardPlan, spec: ModelSpec, tp_rank: int, params: Mapping[str, torch.Tensor],
                 dtype: torch.dtype):
        self.plan, self.spec, self.tp_rank, self.params, self.dtype = plan, spec, tp_rank, params, dtype
        self._maps = {m.mcore: m for m in tensor_maps(spec)}
        self._cache: dict[str, tuple[torch.Tensor, ...]] = {}

    def piece(self, t: HFTensor) -> tuple[int, torch.Tensor]:
        """(start, tensor) of the range of ``t`` this rank holds."""
        if t.mcore not in self._cache:
            self._cache = {t.mcore: self._split(t.mcore)}  # keep one parameter's pieces at a time
        start, _ = source_range(t, self.spec, self.plan.train, self.tp_rank, self.plan.padded_vocab)
        return (0 if t.split is Split.NONE else start), self._cache[t.mcore][t.index]

    def view(self, s: Slab) -> torch.Tensor:
        """Slab ``s`` of this rank's piece, in the training dtype (a view where possible)."""
        t = self.plan.tensor(s.tensor)
        start, piece = self.piece(t)
        return piece if t.dim is None else piece.narrow(t.dim, s.start - start, s.stop - s.start)

    def slab(self, s: Slab) -> torch.Tensor:
        """The contiguous tensor in the rollout dtype to send for slab ``s`` (converted per slab, so
        only what is on the wire is ever copied)."""
        return self.view(s).to(self.dtype).contiguous()

    def _split(self, mcore: str) -> tuple[torch.Tensor, ...]:
        m, shard = self._maps[mcore], self.params[mcore].detach()
        if m.kind is Kind.QKV:
            r, d = self.spec.heads_per_group, self.spec.head_dim
            rest = tuple(shard.shape[1:])
            x = shard.reshape(-1, r + 2, d, *rest)
            parts = (x[:, :r].reshape(-1, *rest), x[:, r].reshape(-1, *rest), x[:, r + 1].reshape(-1, *rest))
        elif m.kind is Kind.GATE_UP:
            parts = tuple(shard.chunk(2, dim=0))
        elif m.kind is Kind.VOCAB:
            lo, hi = source_range(self.plan.tensor(m.hf[0]), self.spec, self.plan.train, self.tp_rank,
                                  self.plan.padded_vocab)
            parts = (shard[: hi - lo],)
        else:
            parts = (shard,)
        return parts


# ---------------------------------------------------------------------------------- receiving side


def empty_dest(t: HFTensor, rng: tuple[int, int], dtype: torch.dtype, device: torch.device | None = None, *,
               full: bool = False) -> torch.Tensor:
    """An uninitialised tensor for the range ``rng`` of ``t`` (the rollout shard), on ``device``.

    ``full``: the whole HF shape instead, for engines whose loaders take checkpoint-format tensors and
    read their own slice (vLLM's); the rows outside ``rng`` are never received and are NaN, so a loader
    that read past its slice would poison the logits instead of silently using garbage."""
    out = torch.empty(dest_shape(t, rng, full), dtype=dtype, device=device)
    if full and t.dim is not None and rng != (0, t.length):
        out.fill_(float("nan"))
    return out


def dest_shape(t: HFTensor, rng: tuple[int, int], full: bool = False) -> tuple[int, ...]:
    """The shape of the rollout shard ``rng`` of ``t`` (``full``: the whole HF shape)."""
    shape = list(t.shape)
    if not full and t.dim is not None:
        shape[t.dim] = rng[1] - rng[0]
    return tuple(shape)


def dest_view(dest: torch.Tensor, t: HFTensor, lo: int, s: Slab) -> torch.Tensor:
    """The part of the rollout shard ``dest`` (starting at ``lo``) that slab ``s`` fills."""
    return dest if t.dim is None else dest.narrow(t.dim, s.start - lo, s.stop - s.start)
