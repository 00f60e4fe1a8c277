"""GrowingLayer against transformers' own DynamicLayer (the reference), through every operation the
embedded engine and transformers apply to a cache layer, and its in-place appends (hand-worked); PrefixStore's
matching and eviction on hand-worked entries."""

import torch
from transformers.cache_utils import DynamicLayer

from megarl.rollout.kv_cache import GrowingLayer, Prefix, PrefixStore


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


def _prefix(tokens: list[int]) -> Prefix:
    """One layer, 2 heads of 8 float32 values per token: 2 * 2 * 8 * 4 = 128 bytes per token."""
    k = torch.full((2, len(tokens), 8), float(len(tokens)))
    return Prefix(tokens=tuple(tokens), keys=[k], values=[k.clone()], routing=None)


def test_prefix_store_takes_the_longest_proper_prefix_and_evicts_the_oldest():
    store = PrefixStore(capacity_bytes=128 * 10)  # room for 10 tokens
    store.put(_prefix([1, 2]))
    store.put(_prefix([1, 2, 3, 4]))
    store.put(_prefix([9, 9, 9]))
    assert len(store) == 3 and store.nbytes == 128 * 9
    assert store.take([1, 2]) is None  # a prompt equal to an entry keeps no token to feed: not a match
    assert store.take([5, 1, 2, 3]) is None  # not a prefix
    assert store.take([1, 2, 3, 4, 5]).tokens == (1, 2, 3, 4)  # the longest one, removed from the store
    assert store.take([1, 2, 3, 4, 5]).tokens == (1, 2)
    assert len(store) == 1 and store.nbytes == 128 * 3
    store.put(_prefix([4] * 5))
    store.put(_prefix([5] * 4))  # 3 + 5 + 4 > 10: the oldest ([9, 9, 9]) leaves
    assert store.take([9, 9, 9, 9]) is None and store.take([4] * 6).tokens == (4,) * 5
    store.put(_prefix([7] * 11))  # larger than the whole store: not kept, nothing evicted for it
    assert store.take([7] * 12) is None and store.take([5] * 5) is not None
    store.put(_prefix([3, 3]))
    store.put(_prefix([3, 3]))  # an equal row (the same answer in another conversation): kept once each
    assert store.take([3, 3, 1]).tokens == (3, 3) and store.take([3, 3, 2]).tokens == (3, 3)
    assert store.take([3, 3, 3]) is None
    store.put(_prefix([3, 3]))
    store.clear()
    assert len(store) == 0 and store.nbytes == 0 and store.take([3, 3, 3]) is None
