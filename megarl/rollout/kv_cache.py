"""The embedded engine's KV caches: a cache layer that appends in place, and the store of finished rows' KV that
a later call continuing them (a conversation's next turn) starts from (:class:`PrefixStore`).

transformers' ``DynamicLayer`` appends each step's keys and values with ``torch.cat``, which copies
the whole cache every step: O(L^2) bytes over an L-token generation, as much memory traffic as the
attention itself. 30M model (8 layers, 2 KV heads of 128), 64 rows: 64 tokens cost 0.03 s of copies
per layer, 512 tokens 1.8 s per layer (14.6 s of a generation whose matmuls take ~17 s).
:class:`GrowingLayer` keeps ``keys`` / ``values`` as prefix views of buffers with spare columns and
writes each step into them; a full buffer is reallocated with a quarter (at least ``HEADROOM``
columns) to spare, so copies total O(L). Attention reads the views (PyTorch's SDPA kernels take
strided keys and values; measured as fast as contiguous ones).

The layer is a ``DynamicLayer`` in everything else: code that replaces ``keys`` / ``values`` (the
engine's trimming and merging, ``crop``, ``batch_repeat_interleave``, offloading) leaves tensors the
layer does not own, and its next ``update`` copies them into a new buffer. Row selection keeps the
buffers' spare columns (one copy instead of two).

Imports transformers (the embedded engine imports this module lazily).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    HEADROOM = 64  # spare columns of a (re)allocated buffer, at least; else a quarter of its length
    _buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # [B, H, capacity, D] keys, values
    _views: tuple[torch.Tensor, torch.Tensor] | None = None  # the keys / values this layer set last

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._buffers = self._views = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        if not self._owned() or end > self._buffers[0].shape[2]:
            self._reallocate(length, end + max(self.HEADROOM, end // 4), key_states.shape)
        for buffer, new in zip(self._buffers, (key_states, value_states), strict=True):
            buffer[:, :, length:end].copy_(new)
        self._set_views(end)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self._owned():
            super().batch_select_indices(indices)
            return
        length = self.get_seq_length()
        self._buffers = (self._buffers[0][indices], self._buffers[1][indices])
        self._set_views(length)

    def _owned(self) -> bool:
        """Whether keys / values are still the views this layer set (nothing replaced them since)."""
        return self._views is not None and self.keys is self._views[0] and self.values is self._views[1]

    def _reallocate(self, length: int, capacity: int, shape: torch.Size) -> None:
        """New buffers of ``capacity`` columns for states of ``shape`` [B, H, new, D], holding the first
        ``length`` columns of keys / values."""
        b, h, _, d = shape
        self._buffers = (self.keys.new_empty((b, h, capacity, d)), self.values.new_empty((b, h, capacity, d)))
        if length:
            self._buffers[0][:, :, :length].copy_(self.keys)
            self._buffers[1][:, :, :length].copy_(self.values)

    def _set_views(self, length: int) -> None:
        self.keys, self.values = self._buffers[0][:, :, :length], self._buffers[1][:, :, :length]
        self._views = (self.keys, self.values)


@dataclass
class Prefix:
    """The KV of one finished row: every token it fed the model (its prompt and all but its last sampled token)."""

    tokens: tuple[int, ...]
    keys: list[torch.Tensor]  # per layer [H, len(tokens), D]
    values: list[torch.Tensor]
    routing: torch.Tensor | None  # MoE: int16 [len(tokens), layers, top_k] of those tokens, else None

    @classmethod
    def of_row(cls, cache, row: int, columns: torch.Tensor, tokens: tuple[int, ...],
               routing: torch.Tensor | None) -> Prefix:
        """Batch row ``row``'s ``columns`` of every layer of ``cache`` (copies), the KV of ``tokens``."""
        return cls(tokens=tokens, routing=routing,
                   keys=[layer.keys[row].index_select(1, columns) for layer in cache.layers],
                   values=[layer.values[row].index_select(1, columns) for layer in cache.layers])

    @property
    def nbytes(self) -> int:
        tensors = [*self.keys, *self.values, *([] if self.routing is None else [self.routing])]
        return sum(t.numel() * t.element_size() for t in tensors)


def seed_cache(cache, prefixes: Sequence[Prefix | None], width: int) -> torch.Tensor:
    """Fill the empty ``cache`` with each batch row's prefix, right-aligned in ``width`` columns (zeros before it,
    and for rows without one); returns the long attention mask [rows, width] of those columns."""
    sample = next(p for p in prefixes if p is not None)
    mask = torch.zeros((len(prefixes), width), dtype=torch.long, device=sample.keys[0].device)
    for d, p in enumerate(prefixes):
        if p is not None:
            mask[d, width - len(p.tokens):] = 1
    for layer in range(len(sample.keys)):
        states = []
        for kept in ([p and p.keys[layer] for p in prefixes], [p and p.values[layer] for p in prefixes]):
            first = next(t for t in kept if t is not None)  # [H, n, D]
            full = first.new_zeros((len(prefixes), first.shape[0], width, first.shape[2]))
            for d, t in enumerate(kept):
                if t is not None:
                    full[d, :, width - t.shape[1]:] = t
            states.append(full)
        cache.update(*states, layer)
    return mask


_MASK = (1 << 64) - 1


def _prefix_hashes(tokens: Sequence[int]) -> list[int]:
    """``h[l]`` for ``l = 0 .. len(tokens)``: a 64-bit polynomial hash of ``tokens[:l]``."""
    h, out = 0, [0]
    for t in tokens:
        h = (h * 1_000_003 + t + 1) & _MASK
        out.append(h)
    return out


class PrefixStore:
    """Finished rows' KV, kept between generation calls for prompts that continue them (a multi-turn
    conversation's next turn is its trajectory so far: the previous call's prompt and response, then the
    observation). Rows with the same tokens (a group's equal answers) are kept once each: each continues its own
    conversation. Least recently stored entries leave first once ``capacity_bytes`` would be passed; an entry
    larger than the capacity is not kept. :meth:`take` finds the longest stored proper prefix of a prompt in one
    pass over its tokens (rolling hashes, then an exact comparison). Entries are valid only for the weights that
    computed them: the engine clears the store on every weight update and on sleep.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[int, tuple[tuple[int, int], Prefix]] = OrderedDict()  # oldest first
        self._index: dict[tuple[int, int], list[int]] = {}  # (length, hash of the tokens) -> entry numbers
        self._lengths: Counter[int] = Counter()
        self._next = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self._lengths.clear()
        self.nbytes = 0

    def put(self, prefix: Prefix) -> None:
        size = prefix.nbytes
        if size > self.capacity_bytes:
            return
        while self._entries and self.nbytes + size > self.capacity_bytes:
            self._remove(next(iter(self._entries)))
        key = (len(prefix.tokens), _prefix_hashes(prefix.tokens)[-1])
        self._entries[self._next] = (key, prefix)
        self._index.setdefault(key, []).append(self._next)
        self._lengths[key[0]] += 1
        self._next += 1
        self.nbytes += size

    def take(self, prompt: Sequence[int]) -> Prefix | None:
        """Remove and return the longest entry whose tokens are a proper prefix of ``prompt`` (the prompt keeps
        at least one token to feed), or None."""
        if not self._entries:
            return None
        hashes = _prefix_hashes(prompt)
        for length in range(len(prompt) - 1, 0, -1):
            if not self._lengths[length]:
                continue
            for number in self._index.get((length, hashes[length]), ()):
                if self._entries[number][1].tokens == tuple(prompt[:length]):
                    return self._remove(number)
        return None

    def _remove(self, number: int) -> Prefix:
        key, prefix = self._entries.pop(number)
        numbers = self._index[key]
        numbers.remove(number)
        if not numbers:
            del self._index[key]
        self._lengths[key[0]] -= 1
        self.nbytes -= prefix.nbytes
        return prefix
