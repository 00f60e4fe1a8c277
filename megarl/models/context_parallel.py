"""Packed (THD) and context-parallel causal core attention for megatron-core's local layer spec on CPU.

On GPU, Transformer Engine's attention does both (``cu_seqlens`` and its CP ring / all-gather). Without it,
this module owns the math: :func:`packed_causal_attention` for a stream of packed segments on one rank,
:func:`context_parallel_attention` for the same stream split over a context-parallel group, and
:func:`cp_token_index`, the split itself, for whoever cuts the inputs.

Layout invariant (megatron-core 0.16.1's THD CP layout: ``_get_thd_freqs_on_this_cp_rank`` in
``models/common/embeddings/rope_utils.py``, ``get_batch_on_this_cp_rank`` in ``utils.py``): ``offsets`` are
the global, padded segment boundaries of the packed stream; at CP size ``cp`` > 1 every segment's length
``L`` is a multiple of ``2 * cp``, cut into ``2 * cp`` chunks of ``L / (2 * cp)`` tokens, and rank ``r``
holds chunk ``r`` then chunk ``2 * cp - 1 - r`` of each segment, segments in order (the causal work is
then balanced over the ranks). At CP size 1 a rank holds the stream as it is.

Each segment attends causally to itself only. No ``[t, t]`` (nor any per-block) mask or score tensor is made:
SDPA's CPU flash kernel per segment, and for a CP query chunk two flash passes (the keys before it, its own keys
causally) merged by their log-sum-exps (:class:`_ChunkAttention`). Segments are cut with ``torch.split`` (one
gradient concatenation in backward), not slices (each of which would write its gradient into a zero tensor of
the whole stream). Imports torch, torch.distributed
and megatron-core's autograd collectives only: no Ray, no megarl engine or parallel-state code. On a
machine without CUDA the collective allocates on ``torch.cuda.current_device()``: it needs
``megarl.parallel.cpu_compat``'s redirection (on in a world joined by ``init_distributed``; the engine's
layers get it through ``cpu_compat.redirect_sequence_parallel``). A group of one makes no collective.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region


def check_offsets(offsets: list[int], cp: int = 1) -> None:
    """Raise ``ValueError`` unless ``offsets`` are non-decreasing segment boundaries from 0 whose every segment
    length is a multiple of ``2 * cp`` (at ``cp`` > 1), naming the first segment that is not."""
    if not offsets or offsets[0] != 0:
        raise ValueError(f"offsets must start at 0 (cumulative segment boundaries), got {offsets[:4]}...")
    for i, (start, end) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
        if end < start:
            raise ValueError(f"offsets must not decrease: segment {i} runs from {start} to {end}")
        if cp > 1 and (end - start) % (2 * cp):
            raise ValueError(
                f"segment {i} has {end - start} tokens, not a multiple of 2 * cp = {2 * cp}: context parallelism "
                f"cuts each segment into 2 * cp equal chunks; pad every segment to a multiple of {2 * cp}")


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 3 or k.shape != v.shape or k.dim() != 3 or q.size(1) % k.size(1) or q.size(-1) != k.size(-1):
        raise ValueError(f"expected q [t, hq, d] and k, v [t, hk, d] with hq a multiple of hk, got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[len, heads, d] -> the view [1, heads, len, d] SDPA takes."""
    return x.transpose(0, 1).unsqueeze(0)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one segment: q [l, hq, d], k, v [l, hk, d] -> [l, hq, d]."""
    out = F.scaled_dot_product_attention(_heads_first(q), _heads_first(k), _heads_first(v), is_causal=True,
                                         scale=scale, enable_gqa=k.size(1) != q.size(1))
    return out.squeeze(0).transpose(0, 1)


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _ChunkAttention(torch.autograd.Function):
    """Queries of one chunk [1, h, l, d] attending to the keys before the chunk (``prior``, all of them) and to the
    chunk's own keys (causally): the bottom-right causal mask over [prior | own], without a mask. Two flash passes
    (each returns its log-sum-exp) merged by their log-sum-exps; backward runs the flash backward of each block
    against the merged output and log-sum-exp, which is exact (the flash backward recomputes each block's
    probabilities from them). Saves q, the keys and values it was given, the output and the log-sum-exp: no
    [l, prior + l] mask or score tensor (a masked SDPA would keep the mask, as floats, for its backward)."""

    @staticmethod
    def forward(ctx, q, k_prior, v_prior, k_own, v_own, scale):
        out, lse = _FLASH(q, k_own, v_own, 0.0, True, scale=scale)
        if k_prior.size(2):
            out_prior, lse_prior = _FLASH(q, k_prior, v_prior, 0.0, False, scale=scale)
            merged = torch.logaddexp(lse, lse_prior)
            out = out * (lse - merged).exp().unsqueeze(-1) + out_prior * (lse_prior - merged).exp().unsqueeze(-1)
            lse = merged
        ctx.save_for_backward(q, k_prior, v_prior, k_own, v_own, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k_prior, v_prior, k_own, v_own, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dk_own, dv_own = _FLASH_BACKWARD(grad, q, k_own, v_own, out, lse, 0.0, True, scale=ctx.scale)
        dk_prior = dv_prior = None
        if k_prior.size(2):
            dq_prior, dk_prior, dv_prior = _FLASH_BACKWARD(grad, q, k_prior, v_prior, out, lse, 0.0, False,
                                                           scale=ctx.scale)
            dq = dq + dq_prior
        return dq, dk_prior, dv_prior, dk_own, dv_own, None


def _attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Queries q [lq, hq, d], the last lq positions of keys k, v [lk, hk, d], attending causally (the mask
    aligned bottom-right: query i sees keys 0 .. i + lk - lq) -> [lq, hq, d]."""
    lq, lk = q.size(0), k.size(0)
    if lq == lk:
        return _attend(q, k, v, scale)
    qh, kh, vh = (_heads_first(x) for x in (q, k, v))
    cut = lk - lq
    out = _ChunkAttention.apply(qh, kh[:, :, :cut], vh[:, :, :cut], kh[:, :, cut:], vh[:, :, cut:], scale)
    return out.squeeze(0).transpose(0, 1)


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: list[int],
                            scale: float, plan: PackedPlan | None = None) -> torch.Tensor:
    """Block-diagonal causal attention of a packed stream: q [t, hq, d], k, v [t, hk, d] (GQA: hq a multiple
    of hk), ``offsets`` its segment boundaries (``offsets[-1] == t``); each segment attends causally to
    itself only. Returns [t, hq, d]. ``plan``: :func:`packed_plan` of ``offsets``, made once for all layers."""
    _check_heads(q, k, v)
    check_offsets(offsets)
    if offsets[-1] != q.size(0):
        raise ValueError(f"offsets end at {offsets[-1]} but the stream has {q.size(0)} tokens")
    plan = plan or packed_plan(offsets, q.device)
    # v may be a view into the fused QKV projection: SDPA saves it for backward, which would keep that alive.
    # torch.split, not slices: a slice's backward writes its gradient into a zero tensor of the whole stream, per
    # segment (hundreds of segments: most of the pass)
    v = v.contiguous()
    q_s, k_s, v_s = (x.split(plan.sizes) for x in (q, k, v))
    pieces = []
    for group, gather, kept in plan.groups:
        if gather is None:  # alone: views of the stream, no copy
            pieces.append(_attend(q_s[group[0]], k_s[group[0]], v_s[group[0]], scale))
            continue
        # short segments of similar lengths: one SDPA call over them right-padded (a causal query never sees the
        # keys after it, so the padding changes nothing), then their real rows
        out = F.scaled_dot_product_attention(*(x[gather].transpose(1, 2) for x in (q, k, v)), is_causal=True,
                                             scale=scale, enable_gqa=k.size(1) != q.size(1))
        pieces.append(out.transpose(1, 2).flatten(0, 1)[kept])
    if not pieces:
        return q.new_empty(q.shape)
    out = torch.cat(pieces)
    return out if plan.order is None else out[plan.order]


@dataclasses.dataclass
class PackedPlan:
    """How :func:`packed_causal_attention` runs a stream's segments: ``groups`` of (segment indices, the padded
    batch's stream positions [n, longest] and its real rows, or None for a segment run alone), and ``order``, the
    stream position of each output row as the groups produce them (None: already in stream order)."""

    sizes: list[int]
    groups: list[tuple[list[int], torch.Tensor | None, torch.Tensor | None]]
    order: torch.Tensor | None


def packed_plan(offsets: list[int], device: torch.device) -> PackedPlan:
    sizes = [e - s for s, e in itertools.pairwise(offsets)]
    groups, rows = [], []
    for group in _batches(sizes):
        starts = torch.tensor([offsets[i] for i in group])
        lengths = torch.tensor([sizes[i] for i in group])
        longest = int(lengths.max())
        position = torch.arange(longest)
        real = position < lengths[:, None]  # [n, longest]
        rows.append((starts[:, None] + position)[real])
        if len(group) == 1:
            groups.append((group, None, None))
            continue
        # padding rows read their segment's first token: any real position serves, nothing attends to them
        gather = torch.where(real, starts[:, None] + position, starts[:, None])
        groups.append((group, gather.to(device), real.flatten().nonzero().squeeze(1).to(device)))
    produced = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
    in_order = bool((produced == torch.arange(produced.numel())).all())
    return PackedPlan(sizes, groups, None if in_order else produced.argsort().to(device))


def _batches(sizes: list[int], waste: float = 1.5, overhead: int = 64) -> list[list[int]]:
    """Segments (indices) grouped for one SDPA call each: longest first, a group growing while its padded cost
    (rows x longest x (longest + ``overhead``), the scores plus a per-token share) stays within ``waste`` times its
    segments' own. One SDPA call per segment costs more than its work on short rows (the tiny models' ~10-token
    rows: a call per sequence and layer made training 1.2x slower than padded rows)."""
    order = sorted((i for i, n in enumerate(sizes) if n), key=lambda i: -sizes[i])
    groups: list[list[int]] = []
    own = 0
    for i in order:
        if groups:
            group, longest = groups[-1], sizes[groups[-1][0]]
            cost = own + sizes[i] * (sizes[i] + overhead)
            if (len(group) + 1) * longest * (longest + overhead) <= waste * cost:
                group.append(i)
                own = cost
                continue
        groups.append([i])
        own = sizes[i] * (sizes[i] + overhead)
    return groups


def cp_token_index(offsets: list[int], cp: int, rank: int) -> torch.Tensor:
    """The global positions (into the packed stream of ``offsets[-1]`` tokens) CP rank ``rank`` of ``cp`` holds,
    in its local order: of each segment, chunk ``rank`` then chunk ``2 * cp - 1 - rank``. ``x[idx]`` cuts a
    rank's share of any per-token tensor ``x`` of the stream."""
    check_offsets(offsets, cp)
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is not a rank of a context-parallel group of {cp}")
    if cp == 1:
        return torch.arange(offsets[-1])
    pieces = []
    for start, end in zip(offsets[:-1], offsets[1:], strict=True):
        chunk = (end - start) // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            pieces.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def _gather_in_global_order(x: torch.Tensor, offsets: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's local tokens x [t / cp, ...] gathered and put back in the stream's order: [t, ...]. The
    gather's backward reduce-scatters (sums over ranks) the gradient onto each rank's local tokens."""
    cp = dist.get_world_size(group)
    gathered = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=group)
    held = torch.cat([cp_token_index(offsets, cp, r) for r in range(cp)])  # row i of gathered is position held[i]
    row_of = torch.empty_like(held)
    row_of[held] = torch.arange(held.numel())
    return gathered.index_select(0, row_of.to(x.device))


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: list[int], scale: float,
                               group: dist.ProcessGroup) -> torch.Tensor:
    """:func:`packed_causal_attention` of a stream split over the context-parallel ``group``: q [t / cp, hq, d],
    k, v [t / cp, hk, d] are this rank's tokens in the layout of :func:`cp_token_index`, ``offsets`` the
    global padded boundaries. Keys and values are all-gathered (their gradients reduce-scattered back); each
    of the rank's query chunks attends to its segment's keys up to its own end. Returns [t / cp, hq, d]."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    if cp == 1:
        return packed_causal_attention(q, k, v, offsets, scale)
    _check_heads(q, k, v)
    check_offsets(offsets, cp)
    if offsets[-1] != q.size(0) * cp:
        raise ValueError(f"offsets end at {offsets[-1]} but {cp} ranks of {q.size(0)} local tokens hold "
                         f"{q.size(0) * cp}")
    k_all, v_all = (_gather_in_global_order(x, offsets, group) for x in (k, v))
    sizes = [e - s for s, e in itertools.pairwise(offsets)]
    chunks = [size // (2 * cp) for size in sizes for _ in range(2)]  # this rank's two chunks of each segment
    queries = iter(q.split(chunks))
    outs = []
    for size, k_seg, v_seg in zip(sizes, k_all.split(sizes), v_all.split(sizes), strict=True):
        chunk = size // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            q_chunk = next(queries)
            if chunk:
                outs.append(_attend_chunk(q_chunk, k_seg[:(c + 1) * chunk], v_seg[:(c + 1) * chunk], scale))
    return torch.cat(outs) if outs else q.new_empty(q.shape)
