"""Rollout-training mismatch correction: importance weights on ``rho = pi_old / pi_rollout`` (pure).

The rollout engine samples from ``pi_rollout``; the loss assumes the samples came from ``pi_old``, the
training model at the same weights. The two differ whenever the engines do (bf16 vLLM kernels against
fp32/bf16 Megatron, a different attention or sampling path, later stale weights in asynchronous
training). Two corrections, alone or together, at one of three levels (:class:`ISLevel`):

* **truncated IS** (``truncate``; TIS, Yao et al. 2025): every token's loss is multiplied by
  ``min(rho, truncate_cap)`` - the token's own ratio (``token``), the product over its sequence
  (``sequence``) or the geometric mean over its sequence (``geometric``);
* **masked IS / rejection** (``reject``; MIS): tokens (``token``: ICEPOP's two-sided mask) or whole
  sequences (``sequence``; ``geometric``: Geo-RS) whose ratio lies outside ``[reject_low, reject_high]``
  get weight 0. They stay in the loss's denominators (the objective is an expectation over all samples
  with those terms zeroed, as in ICEPOP).

The weights multiply the advantages: every policy loss in :mod:`megarl.algos.losses` is linear in a
positive scaling of its advantage, so this equals weighting the per-token loss and leaves clipping
decisions unchanged. ``rho`` is detached (a constant of the update). Also returns the mismatch
diagnostics (:class:`CorrectionOutput`). Must not import: torch.distributed, megatron, Ray, vLLM.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from megarl.algos.ops import masked_mean
from megarl.errors import ConfigError

_LOG_RATIO_LIMIT = 20.0  # exp() beyond this is meaningless (and inf in float32 for a long sequence's product)


class ISLevel(enum.Enum):
    TOKEN = "token"  # each token's own ratio
    SEQUENCE = "sequence"  # the product of the sequence's token ratios
    GEOMETRIC = "geometric"  # the geometric mean of the sequence's token ratios (length-normalised)


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Importance-sampling correction of the rollout engine's distribution against the training model's
    (``algorithm.rollout_correction``). On by default as token-level TIS with cap 2: with matched engines
    (the CPU default) every weight is 1 to within 1e-5, and with bf16 vLLM rollouts it bounds what a
    token the two engines disagree on can do to the update, at no cost."""

    truncate: ISLevel | None = ISLevel.TOKEN  # truncated IS: weight min(rho, truncate_cap) at this level; null: off
    truncate_cap: float = 2.0  # C of truncated IS
    reject: ISLevel | None = None  # masked IS: weight 0 where rho is outside [reject_low, reject_high]; null: off
    reject_low: float = 0.5  # lower bound of the kept ratios (ICEPOP: 0.5)
    reject_high: float = 2.0  # upper bound of the kept ratios (ICEPOP: 5.0 in the paper's MoE runs)

    def __post_init__(self) -> None:
        if self.truncate_cap < 1.0:
            raise ConfigError(f"rollout_correction.truncate_cap must be >= 1 (a cap below 1 shrinks every weight), "
                              f"found {self.truncate_cap}")
        if not 0.0 <= self.reject_low < 1.0 < self.reject_high:
            raise ConfigError(f"rollout_correction needs 0 <= reject_low < 1 < reject_high, found {self.reject_low} "
                              f"and {self.reject_high}")

    @property
    def active(self) -> bool:
        return self.truncate is not None or self.reject is not None


@dataclass(frozen=True)
class CorrectionOutput:
    weights: torch.Tensor  # [B, S], detached: multiply the advantages; 0 outside the mask and where rejected
    metrics: dict[str, torch.Tensor]  # token means over the mask (names under ``mismatch/``), see below
    seq_metrics: dict[str, torch.Tensor]  # means over the sequences with a counted token
    ratio_max: torch.Tensor  # largest token rho over the mask (0 when nothing is counted)
    ratio_min: torch.Tensor  # smallest token rho over the mask (0 when nothing is counted)


def _level_log_ratio(log_rho: torch.Tensor, mask: torch.Tensor, level: ISLevel) -> torch.Tensor:
    """The log ratio each token is judged by at ``level``, [B, S] (a sequence's value on each of its tokens)."""
    if level is ISLevel.TOKEN:
        return log_rho
    total = (log_rho * mask).sum(-1, keepdim=True)
    if level is ISLevel.GEOMETRIC:
        total = total / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return total.expand_as(log_rho)


def rollout_correction(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor,
                       cfg: RolloutCorrectionConfig) -> CorrectionOutput:
    """Weights and diagnostics from ``log rho = old_log_prob - rollout_log_prob`` over ``mask`` (all [B, S]).

    Token-mean metrics: ``kl_k1`` = mean(-log rho) and ``kl_k3`` = mean(rho - 1 - log rho), estimates of
    KL(pi_rollout || pi_old) from the rollout's samples; ``ratio_mean``; ``truncated_frac`` (tokens whose
    weight was capped); ``masked_frac`` (tokens rejected); ``weight_mean``. Sequence-mean metrics:
    ``ppl_ratio`` = mean over sequences of ``ppl_old / ppl_rollout = exp(mean_t(-log rho))``.
    """
    mask = mask.to(old_log_prob.dtype)
    log_rho = ((old_log_prob.detach() - rollout_log_prob) * mask).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    rho = torch.exp(log_rho)
    weights = mask.clone()
    truncated = torch.zeros_like(mask)
    if cfg.truncate is not None:
        level = torch.exp(_level_log_ratio(log_rho, mask, cfg.truncate).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT))
        truncated = (level > cfg.truncate_cap).to(mask.dtype) * mask
        weights = weights * level.clamp(max=cfg.truncate_cap)
    rejected = torch.zeros_like(mask)
    if cfg.reject is not None:
        level = torch.exp(_level_log_ratio(log_rho, mask, cfg.reject).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT))
        outside = (level < cfg.reject_low) | (level > cfg.reject_high)
        rejected = outside.to(mask.dtype) * mask
        weights = weights * (1.0 - rejected)
    counted = mask > 0
    seqs = counted.any(-1)
    per_seq_neg = (-log_rho * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    zero = torch.zeros((), dtype=rho.dtype, device=rho.device)
    return CorrectionOutput(
        weights=weights.detach(),
        metrics={"kl_k1": masked_mean(-log_rho, mask), "kl_k3": masked_mean(rho - 1.0 - log_rho, mask),
                 "ratio_mean": masked_mean(rho, mask), "truncated_frac": masked_mean(truncated, mask),
                 "masked_frac": masked_mean(rejected, mask), "weight_mean": masked_mean(weights, mask)},
        seq_metrics={"ppl_ratio": torch.exp(per_seq_neg)[seqs].mean() if seqs.any() else zero},
        ratio_max=rho[counted].max() if counted.any() else zero,
        ratio_min=rho[counted].min() if counted.any() else zero,
    )
