"""Plug-ins as user code: an advantage estimator and a policy loss given to megarl by path (docs/programming.md §2).

    megarl train examples/grpo_addition_tiny/config.yaml \
        algorithm.advantage.estimator=examples/plugins/algorithms.py:dr_grpo \
        algorithm.policy_loss.loss=examples/plugins/algorithms.py:clipped_surrogate

- ``dr_grpo``: Dr. GRPO (Liu et al. 2025, arXiv 2503.20783): the group mean subtracted from each response's
  score, no division by the group's std (no question-level difficulty bias), broadcast over the response's tokens.
- ``group_normalised``: GRPO through megarl's public ``grpo`` function (a starting point for a variant).
- ``clipped_surrogate``: PPO's clipped surrogate (Schulman et al. 2017), token-level ratio, from its definition.
- ``constant_normalised_surrogate``: the same surrogate summed over tokens and divided by a constant
  (``config.norm_constant``, e.g. the maximum response length): Dr. GRPO's length-unbiased aggregation.
- ``some_correct``: a dynamic-sampling criterion (``algorithm.dynamic_sampling.criterion``): groups whose rewards
  differ and that hold at least one fully right response.

Nothing here is imported by megarl's own code; the tests run a trainer with these files
(tests/trainer/test_plugin_runs.py).
"""

from __future__ import annotations

import torch

from megarl.algos import (
    AdvantageInputs,
    Advantages,
    PolicyLossOutput,
    advantage_estimator,
    aggregate_loss,
    group_filter,
    grpo,
    masked_mean,
    masked_sum,
    policy_loss,
)


def _group_mean_and_std(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean, std = torch.empty_like(scores), torch.empty_like(scores)
    for g in group_ids.unique():
        members = group_ids == g
        mean[members] = scores[members].mean()
        std[members] = scores[members].std() if int(members.sum()) > 1 else 0.0
    return mean, std


@advantage_estimator(needs=("group_ids",))
def dr_grpo(inputs: AdvantageInputs, config) -> Advantages:
    scores = (inputs.token_rewards * inputs.mask).sum(-1)  # outcome reward: the sum of a response's token rewards
    mean, _ = _group_mean_and_std(scores, inputs.group_ids)
    advantages = (scores - mean)[:, None] * inputs.mask
    return Advantages(advantages, scores[:, None] * inputs.mask)


@advantage_estimator(needs=("group_ids",))
def group_normalised(inputs: AdvantageInputs, config) -> Advantages:
    """GRPO through megarl's public building block (a variant would change what it is given or returns)."""
    scores = masked_sum(inputs.token_rewards, inputs.mask, dim=-1)
    return grpo(scores, inputs.group_ids, inputs.mask, config.scale_rewards, config.eps)


def _surrogate(log_prob, old_log_prob, advantages, mask, config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    log_ratio = torch.clamp((log_prob - old_log_prob) * mask, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high)
    per_token = torch.maximum(unclipped, clipped)
    return per_token, log_ratio, (clipped > unclipped).to(ratio.dtype)


def _output(loss, log_ratio, clipped, mask) -> PolicyLossOutput:
    log_ratio = log_ratio.detach()
    return PolicyLossOutput(loss, masked_mean(clipped, mask).detach(), torch.zeros(()),
                            masked_mean(-log_ratio, mask), masked_mean(torch.exp(log_ratio) - 1.0 - log_ratio, mask))


@policy_loss()
def clipped_surrogate(log_prob, old_log_prob, advantages, mask, config, normalizer) -> PolicyLossOutput:
    per_token, log_ratio, clipped = _surrogate(log_prob, old_log_prob, advantages, mask, config)
    loss = aggregate_loss(per_token, mask, config.aggregation, normalizer, config.norm_constant)
    return _output(loss, log_ratio, clipped, mask)


@policy_loss()
def constant_normalised_surrogate(log_prob, old_log_prob, advantages, mask, config, normalizer) -> PolicyLossOutput:
    per_token, log_ratio, clipped = _surrogate(log_prob, old_log_prob, advantages, mask, config)
    loss = aggregate_loss(per_token, mask, "seq-mean-token-sum-norm", normalizer, config.norm_constant)
    return _output(loss, log_ratio, clipped, mask)


@group_filter()
def some_correct(scores: torch.Tensor, group_ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """A dynamic-sampling criterion: keep a prompt group when its rewards differ and at least one response earned
    the full reward of 1 (a group of near misses teaches the policy little about what a right answer is)."""
    keep = torch.zeros(num_groups, dtype=torch.bool)
    for g in range(num_groups):
        group = scores[group_ids == g]
        keep[g] = bool(group.max() > group.min()) and bool((group >= 1.0).any())
    return keep
