"""Dynamic micro-batching by token budget (pure: no process groups).

Sequences are right-padded rows of a batch with known lengths. :func:`plan` groups row indices into
micro-batches (longest first, greedy) so that ``rows * longest <= max_tokens``; :func:`cut` takes the
rows of one micro-batch and trims every tensor's sequence axis to that micro-batch's longest row;
:func:`restore` scatters per-micro-batch outputs back into original row order at full length.
:func:`spread` splits a plan into more micro-batches, for ranks that must run as many as their peers
(expert parallelism: every rank of an expert-parallel group joins each MoE layer's all-to-all).
"""

from __future__ import annotations

import torch


def plan(lengths: list[int], max_tokens: int, max_size: int) -> list[list[int]]:
    """Row indices of each micro-batch. A sequence longer than ``max_tokens`` gets a micro-batch alone."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches:
            current = batches[-1]
            longest = lengths[current[0]]  # rows arrive longest first
            if len(current) < max_size and (len(current) + 1) * longest <= max_tokens:
                current.append(i)
                continue
        batches.append([i])
    return batches


def spread(batches: list[list[int]], count: int) -> list[list[int]]:
    """``batches`` split into ``count`` micro-batches where it has fewer (the one with the most rows halved,
    repeatedly); fewer than ``count`` come back only when every micro-batch is down to one row."""
    batches = [list(b) for b in batches]
    while len(batches) < count:
        i = max(range(len(batches)), key=lambda j: (len(batches[j]), -j), default=None)
        if i is None or len(batches[i]) < 2:
            break
        rows = batches[i]
        batches[i:i + 1] = [rows[: len(rows) // 2], rows[len(rows) // 2:]]
    return batches


def cut(tensors: dict[str, torch.Tensor], rows: list[int], length: int,
        width: int | None = None) -> dict[str, torch.Tensor]:
    """Select ``rows`` and trim axis 1 of every 2-d+ tensor to ``length`` (1-d tensors: rows only); with
    ``width`` > ``length``, zero-pad axis 1 after the first ``length`` entries to ``width``."""
    idx = torch.tensor(rows, dtype=torch.long)
    out = {}
    for k, t in tensors.items():
        if t.dim() < 2:
            out[k] = t[idx]
            continue
        part = t[idx, :length]
        if width is not None and width > length:
            padded = part.new_zeros((len(rows), width, *part.shape[2:]))
            padded[:, : part.shape[1]] = part
            part = padded
        out[k] = part
    return out


def restore(parts: list[torch.Tensor], plan_rows: list[list[int]], batch_size: int, seq_len: int) -> torch.Tensor:
    """Per-micro-batch [rows, len_i, ...] outputs -> one [batch_size, seq_len, ...] tensor, zero padded."""
    first = parts[0]
    out = first.new_zeros((batch_size, seq_len, *first.shape[2:]))
    for part, rows in zip(parts, plan_rows, strict=True):
        out[torch.tensor(rows, dtype=torch.long, device=out.device), : part.shape[1]] = part
    return out
