"""``cp_token_index``: megatron-core's load-balanced THD context-parallel split, worked by hand."""

from __future__ import annotations

import pytest
import torch

from megarl.models.context_parallel import cp_token_index


def test_hand_worked_cp2():
    # segment [0, 8): chunks of 2, rank 0 holds chunks 0 and 3; segment [8, 12): chunks of 1, chunks 0 and 3
    assert cp_token_index([0, 8, 12], 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert cp_token_index([0, 8, 12], 2, 1).tolist() == [2, 3, 4, 5, 9, 10]


def test_cp3_ranks_form_a_permutation_and_cp1_is_the_identity():
    offsets = [0, 6, 6, 18, 24]  # an empty segment holds nothing
    assert cp_token_index(offsets, 3, 2).tolist() == [2, 3, 6 + 4, 6 + 5, 6 + 6, 6 + 7, 18 + 2, 18 + 3]
    held = torch.cat([cp_token_index(offsets, 3, r) for r in range(3)])
    assert sorted(held.tolist()) == list(range(24))
    assert cp_token_index([0, 5, 8], 1, 0).tolist() == list(range(8))  # no chunking at CP1: any length


@pytest.mark.parametrize(("offsets", "cp", "rank", "match"), [
    ([0, 8, 10], 2, 0, "segment 1 has 2 tokens, not a multiple of 2 \\* cp = 4"),
    ([1, 8], 2, 0, "must start at 0"),
    ([0, 8, 4], 2, 0, "must not decrease"),
    ([0, 8], 2, 2, "rank 2 is not a rank"),
])
def test_bad_layouts_raise(offsets, cp, rank, match):
    with pytest.raises(ValueError, match=match):
        cp_token_index(offsets, cp, rank)
