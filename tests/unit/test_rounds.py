"""Dynamic sampling's budget (issue #42): whole rounds (sync, one-step-off) and takes of what is missing (async)
may sample the same number of prompt groups, (1 + max_extra_rounds) x batch_size; a hand-worked sequence of rounds.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megarl.config.train import load_config
from megarl.data.batch import Batch
from megarl.trainer.sources import Rounds

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dapo_addition_tiny" / "config.yaml"


def _round(rounds: Rounds, groups: int, informative: int) -> None:
    """A scored round of ``groups`` prompt groups (2 responses each), the first ``informative`` with differing
    rewards."""
    scores = torch.tensor([[1.0, 0.0] if g < informative else [1.0, 1.0] for g in range(groups)]).flatten()
    uid = torch.arange(groups).repeat_interleave(2)
    rounds.add(Batch.from_dict({"scores": scores, "prompt_uid": uid}), groups, 0)


def test_whole_rounds_and_takes_share_one_budget():
    cfg = load_config(EXAMPLE, ["data.batch_size=16", "algorithm.dynamic_sampling.max_extra_rounds=2"])
    # whole rounds of 16 (sync): 5 + 5 + 5 informative, then the budget of 48 groups is spent
    whole = Rounds(cfg, None)
    for found in (5, 10, 15):
        assert not whole.done
        _round(whole, 16, 5)
        assert whole.found == found
    assert whole.done and whole.groups == 48
    # takes of what is missing (async), at most 5 informative each: 16, 11, 6, then the 1 still missing
    takes = Rounds(cfg, None)
    sizes = []
    while not takes.done:
        sizes.append(takes.needed)
        _round(takes, takes.needed, min(takes.needed, 5))
    assert sizes == [16, 11, 6, 1] and takes.groups == 34 and takes.found == 16
    # one informative group per take: 16, 15, 14, then what is left of the 48 (3); 4 found, the budget spent
    short = Rounds(cfg, None)
    sizes = []
    while not short.done:
        sizes.append(short.needed)
        _round(short, short.needed, 1)
    assert sizes == [16, 15, 14, 3] and short.groups == 48 and short.found == 4


def test_a_user_criterion_picks_the_groups():
    """examples/plugins/algorithms.py:some_correct keeps the groups whose rewards differ and hold a reward of 1."""
    plugins = EXAMPLE.parents[1] / "plugins" / "algorithms.py"
    cfg = load_config(EXAMPLE, ["data.batch_size=4", f"algorithm.dynamic_sampling.criterion={plugins}:some_correct"])
    rounds = Rounds(cfg, None)
    scores = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.25, 1.0])  # groups: {1, 0}, {0.5, 0}, {1, 1}, {0.25, 1}
    rounds.add(Batch.from_dict({"scores": scores, "prompt_uid": torch.arange(4).repeat_interleave(2)}), 4, 0)
    assert torch.cat(rounds.informative).tolist() == [True, False, False, True] and rounds.found == 2
