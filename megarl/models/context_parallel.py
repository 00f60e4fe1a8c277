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

Each segment attends causally to itself only. No ``[t, t]`` tensor is made: SDPA's CPU flash kernel
per segment, a boolean mask per (query chunk, segment) block at most. Imports torch, torch.distributed
and megatron-core's autograd collectives only: no Ray, no megarl engine or parallel-state code. On a
machine without CUDA the collective allocates on ``torch.cuda.current_device()``: it needs
``megarl.parallel.cpu_compat``'s redirection (on in a world joined by ``init_distributed``; the engine's
layers get it through ``cpu_compat.redirect_sequence_parallel``). A group of one makes no collective.
"""

from __future__ import annotations

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
    """Queries q [lq, hq, d], the last lq positions of keys k, v [lk, hk, d], attending causally (the mask
    aligned bottom-right: query i sees keys 0 .. i + lk - lq) -> [lq, hq, d]."""
    lq, lk = q.size(0), k.size(0)
    # An explicit mask, not torch.nn.attention.bias.causal_lower_right: its flash path drops enable_gqa.
    mask = None if lq == lk else torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    out = F.scaled_dot_product_attention(_heads_first(q), _heads_first(k), _heads_first(v), attn_mask=mask,
                                         is_causal=mask is None, scale=scale, enable_gqa=k.size(1) != q.size(1))
    return out.squeeze(0).transpose(0, 1)


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: list[int],
                            scale: float) -> torch.Tensor:
    """Block-diagonal causal attention of a packed stream: q [t, hq, d], k, v [t, hk, d] (GQA: hq a multiple
    of hk), ``offsets`` its segment boundaries (``offsets[-1] == t``); each segment attends causally to
    itself only. Returns [t, hq, d]."""
    _check_heads(q, k, v)
    check_offsets(offsets)
    if offsets[-1] != q.size(0):
        raise ValueError(f"offsets end at {offsets[-1]} but the stream has {q.size(0)} tokens")
    # v may be a view into the fused QKV projection: SDPA saves it for backward, which would keep that alive
    v = v.contiguous()
    outs = [_attend(q[s:e], k[s:e], v[s:e], scale) for s, e in zip(offsets[:-1], offsets[1:], strict=True) if e > s]
    return torch.cat(outs) if outs else q.new_empty(q.shape)


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
    outs, local = [], 0
    for start, end in zip(offsets[:-1], offsets[1:], strict=True):
        chunk = (end - start) // (2 * cp)
        if chunk == 0:
            continue
        for c in (rank, 2 * cp - 1 - rank):
            keys = slice(start, start + (c + 1) * chunk)
            outs.append(_attend(q[local:local + chunk], k_all[keys], v_all[keys], scale))
            local += chunk
    return torch.cat(outs) if outs else q.new_empty(q.shape)
