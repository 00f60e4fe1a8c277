"""Advantage estimators: GAE, GRPO, RLOO, REINFORCE++ and ReMax as pure tensor functions, registered as plug-ins
(:mod:`megarl.algos.plugins`) under the names a config uses.

Owns how per-token rewards (and critic values, group ids, baseline rewards where an estimator
needs them) become ``(advantages, returns)``, both ``[batch, response_len]`` and exactly 0 at
masked positions. Recursions over time *skip* masked positions: a position with mask 0 neither
receives nor passes on a return, so ragged right padding and masked holes inside a response
(e.g. tool output in a multi-turn rollout) are both handled. Outcome estimators (GRPO, RLOO)
score a sequence by the sum of its counted token rewards.

Must not import: torch.distributed, megatron, Ray, vLLM, or any megarl layer above ``algos``.
The driver calls :func:`compute_advantages` once per batch; nothing here keeps state.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

from megarl.algos.ops import as_member, masked_sum, masked_whiten, zero_masked
from megarl.algos.plugins import ESTIMATOR, Plugin, advantage_estimator, resolve
from megarl.errors import ConfigError


class Advantages(NamedTuple):
    advantages: torch.Tensor  # [batch, response_len], 0 where masked
    returns: torch.Tensor  # [batch, response_len], 0 where masked


class RewardScale(enum.Enum):
    """What GRPO divides ``s_i - mean_g`` by (TRL's ``scale_rewards``)."""

    GROUP = "group"  # the std of the prompt's group of responses (GRPO as published; TRL's default)
    BATCH = "batch"  # one std over every response of the batch ("PPO Lite", arXiv 2508.08221)
    NONE = "none"  # nothing: Dr. GRPO (arXiv 2503.20783), no question-level difficulty bias


@dataclass(frozen=True)
class AdvantageConfig:
    """Which estimator and its hyper-parameters; each field is read only by the estimators named."""

    # gae (a critic's values, PPO), grpo (group-normalised outcome), rloo (leave-one-out baseline), reinforce_plus_plus
    # (batch-normalised returns), remax (the greedy response's reward as baseline), or a user's estimator given as
    # 'path/to/file.py:function' (docs/programming.md §2)
    estimator: str = "gae"
    gamma: float = 1.0  # discount: GAE, REINFORCE++
    lam: float = 1.0  # GAE lambda
    scale_rewards: RewardScale = RewardScale.GROUP  # GRPO: divide by the std of the group | batch | none (Dr. GRPO)
    eps: float = 1e-6  # GRPO: added to that std (TRL adds 1e-4)

    REPLACED_KEYS: ClassVar[dict[str, str]] = {
        "norm_by_std": "write scale_rewards: group for norm_by_std: true, scale_rewards: none for false"}

    def __post_init__(self) -> None:
        for name in ("gamma", "lam"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"advantage {name} must lie in [0, 1], found {value}")
        if self.eps <= 0:
            raise ConfigError(f"advantage eps must be positive, found {self.eps}")


@dataclass(frozen=True)
class AdvantageInputs:
    """The tensors an estimator may read; those an estimator does not need may be ``None``."""

    token_rewards: torch.Tensor  # [batch, response_len]; outcome rewards sit on the last counted token
    mask: torch.Tensor  # [batch, response_len]
    values: torch.Tensor | None = None  # [batch, response_len] critic values (GAE)
    group_ids: torch.Tensor | None = None  # [batch] integer prompt index (GRPO, RLOO)
    baseline_rewards: torch.Tensor | None = None  # [batch] reward of the greedy response (ReMax)


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A ``[batch]`` value on every counted token of its row, 0 elsewhere."""
    return zero_masked(per_seq.unsqueeze(-1).expand(mask.shape), mask)


@torch.no_grad()
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float) -> Advantages:
    """Generalised Advantage Estimation (Schulman et al. 2015) over the counted positions of each row.

    With ``t' = `` the next counted position after ``t`` (none past the last one: ``V = A = 0``)::

        delta_t = r_t + gamma * V_{t'} - V_t
        A_t     = delta_t + gamma * lam * A_{t'}
        R_t     = A_t + V_t

    Advantages are not whitened here (the registry entry does that, as PPO implementations do).
    """
    if values.shape != rewards.shape or mask.shape != rewards.shape:
        raise ValueError(f"gae: shapes differ: rewards {rewards.shape}, values {values.shape}, mask {mask.shape}")
    valid = mask != 0
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        # A masked position is skipped: it carries the next counted position's value and advantage through.
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        next_adv = torch.where(valid[:, t], adv_t, next_adv)
        advantages[:, t] = torch.where(valid[:, t], adv_t, torch.zeros_like(adv_t))
    returns = zero_masked(advantages + values, mask)
    return Advantages(advantages, returns)


def _group_stats(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-sample ``(group size, group sum, group mean, unbiased group std)`` of ``scores``."""
    if group_ids.dim() != 1 or group_ids.shape[0] != scores.shape[0]:
        raise ValueError(f"group_ids must have shape [{scores.shape[0]}], found {tuple(group_ids.shape)}")
    if group_ids.is_floating_point():
        raise ValueError(f"group_ids must be an integer tensor (prompt index), found {group_ids.dtype}")
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    zeros = torch.zeros(uniq.numel(), dtype=scores.dtype, device=scores.device)
    count = zeros.index_add(0, inverse, torch.ones_like(scores))[inverse]
    total = zeros.index_add(0, inverse, scores)[inverse]
    mean = total / count
    sq_dev = zeros.index_add(0, inverse, (scores - mean) ** 2)[inverse]
    std = torch.sqrt(sq_dev / (count - 1).clamp(min=1.0))
    return count, total, mean, std


@torch.no_grad()
def grpo(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    mask: torch.Tensor,
    scale: RewardScale = RewardScale.GROUP,
    eps: float = 1e-6,
) -> Advantages:
    """Group-relative advantage (Shao et al. 2024): ``A_i = (s_i - mean_g) / (std + eps)``.

    ``mean_g`` is the mean of the scores of the responses sharing ``group_ids[i]``. ``std`` is a sample
    (Bessel-corrected) standard deviation: with ``scale=GROUP`` that of the group's scores, with ``BATCH``
    that of all scores of the batch (one number; 0 for a batch of one), and with ``NONE`` there is no
    division: ``A_i = s_i - mean_g`` (Dr. GRPO). These are TRL's ``scale_rewards`` choices (TRL's ``eps``
    is 1e-4). A group of one response has ``A = 0``. ``A_i`` is broadcast over the counted tokens; the
    returns are the raw scores ``s_i`` broadcast the same way (no critic consumes them).
    """
    scale = as_member(RewardScale, scale, "reward scale")
    if scale is not RewardScale.NONE and eps <= 0:
        raise ValueError(f"grpo: eps must be positive when dividing by a std, found {eps}")
    count, _, mean, std = _group_stats(scores, group_ids)
    adv = scores - mean
    if scale is RewardScale.GROUP:
        adv = adv / (std + eps)
    elif scale is RewardScale.BATCH:
        batch_std = scores.std() if scores.numel() > 1 else torch.zeros((), dtype=scores.dtype)
        adv = adv / (batch_std + eps)
    adv = torch.where(count > 1, adv, torch.zeros_like(adv))
    return Advantages(_broadcast(adv, mask), _broadcast(scores, mask))


@torch.no_grad()
def rloo(scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor) -> Advantages:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): ``A_i = s_i - (sum_{j in g, j != i} s_j) / (k - 1)``.

    ``k`` is the size of the group of ``i``; a group of one has no baseline and gets ``A = 0``.
    Returns are the raw scores, broadcast over the counted tokens like the advantages.
    """
    count, total, _, _ = _group_stats(scores, group_ids)
    baseline = (total - scores) / (count - 1).clamp(min=1.0)
    adv = torch.where(count > 1, scores - baseline, torch.zeros_like(scores))
    return Advantages(_broadcast(adv, mask), _broadcast(scores, mask))


@torch.no_grad()
def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t'}`` with ``t'`` the next counted position (``G = 0`` past the last one).

    Masked positions are skipped (they neither add a reward nor break the chain) and are 0 in the result.
    """
    valid = mask != 0
    running = torch.zeros_like(rewards[:, 0])
    returns = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[-1])):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid[:, t], running, torch.zeros_like(running))
    return returns


@torch.no_grad()
def reinforce_plus_plus(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> Advantages:
    """REINFORCE++ (Hu 2025): token-level discounted returns, whitened across the whole batch.

    ``G = discounted_returns(r, mask, gamma)``; ``A = (G - mean(G)) / sqrt(var(G) + 1e-8)`` with mean
    and unbiased variance over all counted tokens of the batch (KL penalty, if any, already in ``r``).
    """
    returns = discounted_returns(rewards, mask, gamma)
    return Advantages(masked_whiten(returns, mask), returns)


@torch.no_grad()
def remax(rewards: torch.Tensor, baseline_rewards: torch.Tensor, mask: torch.Tensor) -> Advantages:
    """ReMax (Li et al. 2023): ``A_t = G_t - b`` with ``G_t = sum_{t'' >= t} r_{t''}`` over counted positions.

    ``b`` is the reward of the greedy response to the same prompt (``baseline_rewards``, shape
    ``[batch]``). Returns are ``G_t``.
    """
    if baseline_rewards.shape != rewards.shape[:1]:
        found = tuple(baseline_rewards.shape)
        raise ValueError(f"baseline_rewards must have shape [{rewards.shape[0]}], found {found}")
    returns = discounted_returns(rewards, mask, 1.0)
    return Advantages(returns - _broadcast(baseline_rewards.to(returns.dtype), mask), returns)


def _need(inputs: AdvantageInputs, field: str, cfg: AdvantageConfig, why: str) -> torch.Tensor:
    value = getattr(inputs, field)
    if value is None:
        raise ConfigError(f"advantage estimator {cfg.estimator!r} needs inputs.{field} ({why}), found None")
    return value


def _scores(inputs: AdvantageInputs) -> torch.Tensor:
    return masked_sum(inputs.token_rewards, inputs.mask, dim=-1)


@advantage_estimator("gae", needs=("values",))
def _gae_entry(inputs: AdvantageInputs, cfg: AdvantageConfig) -> Advantages:
    """GAE, then batch whitening of the advantages."""
    values = _need(inputs, "values", cfg, "critic values per token")
    adv, ret = gae(inputs.token_rewards, values, inputs.mask, cfg.gamma, cfg.lam)
    return Advantages(masked_whiten(adv, inputs.mask), ret)


@advantage_estimator("grpo", needs=("group_ids",))
def _grpo_entry(inputs: AdvantageInputs, cfg: AdvantageConfig) -> Advantages:
    ids = _need(inputs, "group_ids", cfg, "the prompt index of each response")
    return grpo(_scores(inputs), ids, inputs.mask, cfg.scale_rewards, cfg.eps)


@advantage_estimator("rloo", needs=("group_ids",))
def _rloo_entry(inputs: AdvantageInputs, cfg: AdvantageConfig) -> Advantages:
    ids = _need(inputs, "group_ids", cfg, "the prompt index of each response")
    return rloo(_scores(inputs), ids, inputs.mask)


@advantage_estimator("reinforce_plus_plus")
def _reinforce_pp_entry(inputs: AdvantageInputs, cfg: AdvantageConfig) -> Advantages:
    return reinforce_plus_plus(inputs.token_rewards, inputs.mask, cfg.gamma)


@advantage_estimator("remax", needs=("baseline_rewards",))
def _remax_entry(inputs: AdvantageInputs, cfg: AdvantageConfig) -> Advantages:
    baseline = _need(inputs, "baseline_rewards", cfg, "the reward of the greedy response per prompt")
    return remax(inputs.token_rewards, baseline, inputs.mask)


def estimator(cfg: AdvantageConfig) -> Plugin:
    """The plug-in ``cfg.estimator`` names (:mod:`megarl.algos.plugins`)."""
    return resolve(ESTIMATOR, cfg.estimator)


def compute_advantages(cfg: AdvantageConfig, inputs: AdvantageInputs) -> Advantages:
    """Run the estimator ``cfg.estimator`` on ``inputs``; a missing input raises naming the field. Positions
    outside the mask are 0 in the result whatever the estimator wrote there."""
    if inputs.mask.shape != inputs.token_rewards.shape:
        raise ValueError(
            f"mask shape {tuple(inputs.mask.shape)} does not match token_rewards {tuple(inputs.token_rewards.shape)}"
        )
    plugin = estimator(cfg)
    return checked_advantages(plugin(inputs, cfg), inputs.mask, plugin.name)


def checked_advantages(out: object, mask: torch.Tensor, name: str) -> Advantages:
    """An estimator's return as :class:`Advantages`, zero outside ``mask``; a ConfigError if it is not a pair of
    floating tensors of the mask's shape."""
    where = f"advantage estimator {name!r}"
    if not isinstance(out, tuple) or len(out) != 2:
        raise ConfigError(f"{where} returned {type(out).__name__}; expected Advantages(advantages, returns) or a "
                          f"pair of [batch, response_len] tensors")
    for field, value in zip(("advantages", "returns"), out, strict=True):
        if not isinstance(value, torch.Tensor) or value.shape != mask.shape or not value.is_floating_point():
            found = (f"shape {tuple(value.shape)}, {value.dtype}" if isinstance(value, torch.Tensor)
                     else type(value).__name__)
            raise ConfigError(f"{where}: its {field} must be a floating tensor of shape {tuple(mask.shape)} (the "
                              f"mask's), found {found}")
    return Advantages(zero_masked(out[0], mask), zero_masked(out[1], mask))
