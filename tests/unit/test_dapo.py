"""DAPO's data-side pieces (issue #22, item 2) against hand-worked numbers."""

from __future__ import annotations

import pytest
import torch

from megarl.algos.dapo import DynamicSamplingConfig, informative_groups, overlong_penalty
from megarl.errors import ConfigError


def test_informative_groups_are_those_whose_rewards_differ():
    # groups 0..4 with rows in mixed order; group 3 has one row, group 4 none
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.0, 0.0])
    group = torch.tensor([0, 0, 1, 1, 2, 2, 3, 2, 0])
    assert informative_groups(scores, group, 5).tolist() == [True, False, True, False, False]


def test_equal_rewards_up_to_float_noise_still_differ():
    """Any difference is a gradient signal under GRPO (normalised by the group's std): no tolerance."""
    scores = torch.tensor([0.1, 0.1 + 2**-20])
    assert informative_groups(scores, torch.tensor([0, 0]), 1).tolist() == [True]


@pytest.mark.parametrize("length, expected", [
    (0, 0.0), (12, 0.0),       # up to L - B = 12 tokens: no penalty
    (13, -0.25 * 1.5), (14, -0.5 * 1.5), (15, -0.75 * 1.5),  # the ramp over the 4-token buffer, factor 1.5
    (16, -1.5),                # at L = max_new_tokens: the full factor
])
def test_overlong_penalty_hand_computed(length, expected):
    out = overlong_penalty(torch.tensor([length]), max_length=16, buffer=4, factor=1.5)
    assert out.item() == pytest.approx(expected, abs=1e-12)


def test_overlong_penalty_rejects_a_buffer_outside_the_limit():
    with pytest.raises(ConfigError, match="overlong buffer"):
        overlong_penalty(torch.tensor([3]), max_length=8, buffer=9, factor=1.0)
    with pytest.raises(ConfigError, match="max_extra_rounds"):
        DynamicSamplingConfig(max_extra_rounds=-1)
