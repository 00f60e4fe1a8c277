"""Reward stages as user code: functions run after the reward sources, in the order ``reward.stages`` lists them,
each seeing the reward so far and adding its own term (docs/programming.md §2).

    megarl train examples/grpo_addition_tiny/config.yaml \
        reward.stages.safety=examples/plugins/rewards.py:safety_filter \
        reward.stages.best=examples/plugins/rewards.py:group_best_bonus

- ``safety_filter``: a filter before anything else may reward a response: a response containing a banned string
  (here the digit ``7``, standing in for a safety classifier's verdict) gets a total reward of 0: the stage
  returns minus the reward so far on those rows.
- ``group_best_bonus``: a group-relative term: +0.1 to the responses with the best reward so far in their prompt's
  group, when the group's rewards differ.

Each stage's term is logged apart (``reward/safety_mean``, ``reward/best_mean``) and kept on the rows
(``safety_scores``, ``best_scores``). tests/trainer/test_plugin_runs.py checks both against the rows by hand.
"""

from __future__ import annotations

import torch

from megarl.algos import RewardStageInputs, reward_stage

BANNED = "7"


@reward_stage()
def safety_filter(inputs: RewardStageInputs) -> torch.Tensor:
    flagged = torch.tensor([BANNED in response for response in inputs.responses])
    return torch.where(flagged, -inputs.scores, torch.zeros_like(inputs.scores))


@reward_stage()
def group_best_bonus(inputs: RewardStageInputs) -> torch.Tensor:
    bonus = torch.zeros_like(inputs.scores)
    for g in inputs.group_ids.unique():
        members = inputs.group_ids == g
        scores = inputs.scores[members]
        if scores.max() > scores.min():
            bonus[members] = 0.1 * (scores == scores.max()).float()
    return bonus
