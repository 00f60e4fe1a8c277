"""GrowingLayer against transformers' own DynamicLayer (the reference), through every operation the
embedded engine and transformers apply to a cache layer, and its in-place appends (hand-worked)."""

import torch
from transformers.cache_utils import DynamicLayer

from megarl.rollout.kv_cache import GrowingLayer


def _states(gen: torch.Generator, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, 2, cols, 8, generator=gen), torch.randn(rows, 2, cols, 8, generator=gen)


def test_growing_layer_equals_dynamic_layer_through_every_operation():
    gen = torch.Generator().manual_seed(0)
    ours, ref = GrowingLayer(), DynamicLayer()
    rows = 3

    def update(cols: int) -> None:
        k, v = _states(gen, rows, cols)
        got, want = ours.update(k, v), ref.update(k.clone(), v.clone())
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

    def same() -> None:
        assert torch.equal(ours.keys, ref.keys) and torch.equal(ours.values, ref.values)
        assert ours.get_seq_length() == ref.get_seq_length()

    update(5)  # prefill
    for layer in (ours, ref):  # expand each prompt's cache to its rows, drop one
        layer.batch_select_indices(torch.tensor([0, 0, 1, 2, 2]))
    rows = 5
    same()
    for _ in range(70):  # past the first buffer's 5 + 64 columns
        update(1)
    for layer in (ours, ref):  # finished rows leave
        layer.batch_select_indices(torch.tensor([1, 3]))
    rows = 2
    same()
    update(1)
    for layer in (ours, ref):
        layer.crop(-3)
    same()
    update(2)
    for layer in (ours, ref):  # the engine's trim_left: leading columns replaced by a slice
        layer.keys, layer.values = layer.keys[:, :, 4:], layer.values[:, :, 4:]
    update(1)
    for layer in (ours, ref):
        layer.batch_repeat_interleave(2)
    rows = 4
    update(1)
    same()
    assert ours.get_seq_length() == 5 + 70 + 1 - 3 + 2 - 4 + 1 + 1
    for layer in (ours, ref):
        layer.reset()
    update(3)
    same()


def test_appends_write_into_spare_columns():
    """5-column prefill: a buffer of 5 + HEADROOM (64) columns; the next 64 one-column appends write into it
    (same storage), the 65th reallocates with a quarter of spare columns."""
    gen = torch.Generator().manual_seed(1)
    layer = GrowingLayer()
    layer.update(*_states(gen, 3, 5))
    storage = layer.keys.untyped_storage().data_ptr()
    assert layer.keys.untyped_storage().nbytes() == 3 * 2 * (5 + 64) * 8 * 4
    for step in range(64):
        layer.update(*_states(gen, 3, 1))
        assert layer.keys.untyped_storage().data_ptr() == storage, step
    layer.update(*_states(gen, 3, 1))  # 70 columns: a new buffer of 70 + max(64, 70 // 4)
    assert layer.keys.untyped_storage().data_ptr() != storage
    assert layer.keys.untyped_storage().nbytes() == 3 * 2 * (70 + 64) * 8 * 4
    assert layer.keys.shape == (3, 2, 70, 8)
