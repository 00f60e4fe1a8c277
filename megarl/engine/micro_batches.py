"""Dynamic micro-batching by token budget (pure: no process groups).

Sequences are right-padded rows of a batch with known lengths. :func:`plan` groups row indices into
micro-batches (longest first, greedy) so that ``rows * longest <= max_tokens``; :func:`cut` takes the
rows of one micro-batch and trims every tensor's sequence axis to that micro-batch's longest row;
:func:`restore` scatters per-micro-batch outputs back into original row order at full length.
:func:`spread` splits a plan into more micro-batches, for ranks that must run as many as their peers
(expert parallelism: every rank of an expert-parallel group joins each MoE layer's all-to-all).

``group`` > 1 keeps each run of ``group`` consecutive rows (``[0, group)``, ``[group, 2 group)``, ...) in one
micro-batch, consecutive and in order: a preference pair's chosen and rejected rows, whose loss is one
function of both. A group counts as ``group`` rows of its longest row's length.
"""

from __future__ import annotations

import dataclasses

import torch


def plan(lengths: list[int], max_tokens: int, max_size: int, group: int = 1, packed: bool = False) -> list[list[int]]:
    """Row indices of each micro-batch. A sequence (group) longer than ``max_tokens`` gets a micro-batch alone.
    ``packed``: the micro-batches are packed token streams, whose cost is the sum of their rows' lengths (first fit,
    longest first) instead of rows x longest."""
    if len(lengths) % group:
        raise ValueError(f"{len(lengths)} rows do not divide into groups of {group}")
    units = [list(range(g, g + group)) for g in range(0, len(lengths), group)]
    longest = [max(lengths[i] for i in u) for u in units]
    order = sorted(range(len(units)), key=lambda u: (-longest[u], u))
    if packed:
        return _first_fit(units, [sum(lengths[i] for i in u) for u in units], order, max_tokens, max(max_size, group))
    batches: list[list[int]] = []
    first: list[int] = []  # each micro-batch's longest unit (units arrive longest first)
    for u in order:
        if batches:
            current, size = batches[-1], len(batches[-1]) + group
            if size <= max(max_size, group) and size * longest[first[-1]] <= max_tokens:
                current.extend(units[u])
                continue
        batches.append(list(units[u]))
        first.append(u)
    return batches


def _first_fit(units: list[list[int]], cost: list[int], order: list[int], max_tokens: int,
               max_size: int) -> list[list[int]]:
    batches: list[list[int]] = []
    tokens: list[int] = []
    for u in order:
        fits = (b for b in range(len(batches))
                if tokens[b] + cost[u] <= max_tokens and len(batches[b]) + len(units[u]) <= max_size)
        b = next(fits, None)
        if b is None:
            batches.append([])
            tokens.append(0)
            b = len(batches) - 1
        batches[b].extend(units[u])
        tokens[b] += cost[u]
    return batches


def spread(batches: list[list[int]], count: int, group: int = 1) -> list[list[int]]:
    """``batches`` split into ``count`` micro-batches where it has fewer (the one with the most rows halved at a
    group boundary, repeatedly); fewer than ``count`` come back only when every micro-batch is down to one group."""
    batches = [list(b) for b in batches]
    while len(batches) < count:
        i = max(range(len(batches)), key=lambda j: (len(batches[j]), -j), default=None)
        if i is None or len(batches[i]) < 2 * group:
            break
        rows = batches[i]
        half = len(rows) // group // 2 * group
        batches[i:i + 1] = [rows[:half], rows[half:]]
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


@dataclasses.dataclass(frozen=True)
class Alignment:
    """How a micro-batch's model input is padded: sequence parallelism splits it over the TP ranks (a multiple of
    tp); context parallelism cuts every sequence into 2 cp chunks, each then split by sequence parallelism."""

    align: int = 1  # packed: every sequence's extent a multiple of this
    multiple: int = 1  # the model's input length a multiple of this (padded: the width; packed: the stream)

    @classmethod
    def of(cls, tp: int = 1, cp: int = 1, sequence_parallel: bool = False) -> Alignment:
        multiple = tp if sequence_parallel else 1
        return cls(align=2 * cp * multiple, multiple=1) if cp > 1 else cls(align=1, multiple=multiple)

    def extents(self, lengths: list[int]) -> list[int]:
        """Each sequence's extent in a packed stream: its length rounded up to ``align`` (at least one ``align``),
        the last one's grown so that the stream is a multiple of ``multiple``."""
        extents = [max(-(-n // self.align) * self.align, self.align) for n in lengths]
        extents[-1] += -sum(extents) % self.multiple
        return extents

    def width(self, length: int) -> int:
        """A padded micro-batch's width for its longest row of ``length`` tokens."""
        return -(-length // self.multiple) * self.multiple


UNALIGNED = Alignment()  # no sequence or context parallelism
