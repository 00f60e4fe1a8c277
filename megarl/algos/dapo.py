"""DAPO's data-side pieces (Yu et al. 2025) as pure tensor functions: which prompt groups carry a
learning signal (dynamic sampling), and the soft overlong penalty.

* Dynamic sampling: a group (the ``n`` responses to one prompt) whose rewards are all equal has zero
  advantage under every group-relative estimator (GRPO, RLOO): it adds tokens to the batch and nothing
  to the gradient. :func:`informative_groups` says which groups differ; the trainer samples more
  prompts until the step has ``data.batch_size`` of them (:class:`DynamicSamplingConfig`).
* Overlong shaping: with ``L = max_new_tokens`` and a buffer ``B``, a response of length ``l`` gets
  ``-factor * min(1, max(0, l - (L - B)) / B)``: nothing up to ``L - B`` tokens, a linear ramp over the
  buffer, ``-factor`` at ``L`` (:func:`overlong_penalty`).

Must not import: torch.distributed, megatron, Ray, vLLM.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from megarl.algos.plugins import group_filter
from megarl.errors import ConfigError


class ShortBatch(enum.Enum):
    """What a step does when ``max_extra_rounds`` of sampling did not find ``data.batch_size`` informative groups."""

    TRAIN = "train"  # train on the informative groups found (trimmed to divide into the mini-batches)
    FAIL = "fail"  # stop the run with the counts


@dataclass(frozen=True)
class DynamicSamplingConfig:
    """DAPO dynamic sampling (``algorithm.dynamic_sampling``; null: off): drop prompt groups whose rewards are
    all equal and sample further prompts until the step has ``data.batch_size`` informative groups."""

    # generation rounds beyond the first, each of data.batch_size new prompts (async: takes from the buffer, up to the
    # same number of prompt groups in all)
    max_extra_rounds: int = 4
    on_short: ShortBatch = ShortBatch.TRAIN  # too few informative groups after them: train on those, or fail
    # which prompt groups count as informative: differing_rewards (DAPO's: not all rewards equal) or a user's filter
    # given as 'path/to/file.py:function' (docs/programming.md §2)
    criterion: str = "differing_rewards"

    def __post_init__(self) -> None:
        if self.max_extra_rounds < 0:
            raise ConfigError(f"dynamic_sampling.max_extra_rounds must be >= 0, found {self.max_extra_rounds}")


@group_filter("differing_rewards")
def informative_groups(scores: torch.Tensor, group: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``[num_groups]`` bool: whether group ``g``'s rows (``group == g``) have rewards that are not all equal.
    A group with fewer than two rows is never informative."""
    hi = torch.full((num_groups,), float("-inf"), dtype=torch.float64).scatter_reduce(
        0, group, scores.double(), reduce="amax")
    lo = torch.full((num_groups,), float("inf"), dtype=torch.float64).scatter_reduce(
        0, group, scores.double(), reduce="amin")
    return hi > lo


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong penalty of responses of ``lengths`` tokens (``max_length`` = the generation limit)."""
    if not 0 < buffer <= max_length:
        raise ConfigError(f"the overlong buffer must lie in (0, max_new_tokens={max_length}], found {buffer}")
    excess = (lengths.double() - (max_length - buffer)).clamp(min=0.0)
    return -factor * (excess / buffer).clamp(max=1.0)
