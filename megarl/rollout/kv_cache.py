"""A KV-cache layer for the embedded engine's decode loop that appends in place.

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
