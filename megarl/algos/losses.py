"""Policy losses (plug-ins registered by name, :mod:`megarl.algos.plugins`), the clipped value loss and entropy,
as pure tensor functions.

Owns the per-token surrogate objectives of PPO-family updates (PPO clip, GSPO, CISPO, SAPO) and their
diagnostics (clip fractions, approximate KL between the sampling and the current policy). Losses are returned
ready for ``backward()`` after :func:`~megarl.algos.ops.aggregate_loss`; metrics are detached
token-means over this (micro-)batch's counted tokens, for logging only.

Must not import: torch.distributed, megatron, Ray, vLLM, or any megarl layer above ``algos``.
Vocab-parallel entropy (logits sharded over tensor-parallel ranks) is the engine layer's job;
:func:`entropy_from_logits` here is for a full-vocabulary tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from megarl.algos.ops import LossAggregation, LossNormalizer, aggregate_loss, masked_mean, zero_masked
from megarl.algos.plugins import POLICY_LOSS, is_spec, policy_loss, resolve
from megarl.errors import ConfigError

# exp() of a log-ratio beyond this is inf in float32 and meaningless anyway (verl clamps the same way).
_LOG_RATIO_LIMIT = 20.0


@dataclass(frozen=True)
class PolicyLossConfig:
    loss: str = "ppo_clip"  # ppo_clip, gspo (sequence-level ratio), cispo, sapo, or 'file.py:function' (a user's)
    clip_low: float = 0.2  # ppo_clip, gspo: ratio kept >= 1 - clip_low
    clip_high: float = 0.2  # ppo_clip, gspo: ratio kept <= 1 + clip_high (DAPO "clip-higher": 0.28)
    clip_ratio_c: float | None = None  # ppo_clip only: dual-clip bound for A < 0 (Ye et al. 2020: 3.0); None = off
    aggregation: LossAggregation = LossAggregation.TOKEN_MEAN
    norm_constant: float | None = None  # for SEQ_MEAN_TOKEN_SUM_NORM: the maximum response length
    # CISPO bounds its IS weight with fields of its own: clip_low/clip_high's PPO defaults would put a floor of
    # 0.8 under the weight, and MiniMax-M1 has none. (verl reuses clip_ratio_low/high for CISPO; TRL caps the
    # weight at epsilon_high, "5.0 recommended" after ScaleRL, arXiv 2510.13786: our 1 + 4.0.)
    cispo_clip_low: float | None = None  # cispo: IS weight kept >= 1 - cispo_clip_low; None = no floor (MiniMax-M1)
    cispo_clip_high: float = 4.0  # cispo: IS weight kept <= 1 + cispo_clip_high (ScaleRL / TRL: weight <= 5)
    sapo_tau_pos: float = 1.0  # sapo: gate temperature where A > 0 (paper default 1.0)
    sapo_tau_neg: float = 1.05  # sapo: gate temperature where A <= 0 (paper default 1.05; larger damps sooner)

    def __post_init__(self) -> None:
        if not (0.0 <= self.clip_low < 1.0 and self.clip_high >= 0.0):
            raise ConfigError(f"need 0 <= clip_low < 1 and clip_high >= 0, found {self.clip_low}, {self.clip_high}")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ConfigError(f"dual-clip clip_ratio_c must be > 1 (e.g. 3.0) or None, found {self.clip_ratio_c}")
        if (self.cispo_clip_low is not None and self.cispo_clip_low < 0.0) or self.cispo_clip_high < 0.0:
            raise ConfigError(f"need cispo_clip_low >= 0 (or None) and cispo_clip_high >= 0, found "
                              f"{self.cispo_clip_low}, {self.cispo_clip_high}")
        if not (self.sapo_tau_pos > 0.0 and self.sapo_tau_neg > 0.0):
            raise ConfigError(f"SAPO temperatures must be > 0, found sapo_tau_pos={self.sapo_tau_pos}, "
                              f"sapo_tau_neg={self.sapo_tau_neg}")
        if self.clip_ratio_c is not None and not is_spec(self.loss) and not resolve(POLICY_LOSS, self.loss).dual_clip:
            raise ConfigError(f"{self.loss} has no dual-clip (only ppo_clip bounds its clipped surrogate); set "
                              f"clip_ratio_c to None, found {self.clip_ratio_c}")


@dataclass(frozen=True)
class PolicyLossOutput:
    loss: torch.Tensor  # scalar, differentiable
    # fraction of counted tokens where the clip acts: ppo_clip, gspo: the clipped surrogate is the active one;
    # cispo: the IS weight was clipped; sapo: the gate's gradient weight 4 s (1 - s) is below 1/2
    clip_frac: torch.Tensor
    dual_clip_frac: torch.Tensor  # fraction of counted tokens (A < 0) bounded by -A * clip_ratio_c
    approx_kl_k1: torch.Tensor  # mean(log pi_old - log pi): KL(pi_old || pi), k1 estimator
    approx_kl_k3: torch.Tensor  # mean(r - 1 - log r), r = pi / pi_old: KL(pi_old || pi), k3 estimator

    def metrics(self) -> dict[str, torch.Tensor]:
        """Detached scalars for the metrics logger (keys are metric names, not dispatch keys)."""
        return {
            "loss": self.loss.detach(),
            "clip_frac": self.clip_frac,
            "dual_clip_frac": self.dual_clip_frac,
            "approx_kl_k1": self.approx_kl_k1,
            "approx_kl_k3": self.approx_kl_k3,
        }


def _ratio_metrics(log_ratio: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k1, k3)`` estimates of KL(pi_old || pi) from ``log_ratio = log pi - log pi_old``."""
    log_ratio = log_ratio.detach()
    k1 = masked_mean(-log_ratio, mask)
    k3 = masked_mean(torch.exp(log_ratio) - 1.0 - log_ratio, mask)
    return k1, k3


def _token_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor,
                 mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log r, r)`` per token, ``r = pi / pi_old``, 0 / 1 outside the mask, the log clamped to +-20."""
    log_ratio = torch.clamp(zero_masked(log_prob - old_log_prob, mask), -_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    return log_ratio, torch.exp(log_ratio)


def ppo_clip_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float | None = None,
    aggregation: LossAggregation = LossAggregation.TOKEN_MEAN,
    normalizer: LossNormalizer | None = None,
    norm_constant: float | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate, per token, then aggregated.

    ``r = exp(clamp(log pi - log pi_old, -20, 20))`` and::

        l     = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
        l_dc  = min(l, -A c)   where A < 0 and dual-clip is on (c = clip_ratio_c > 1)

    ``clip_frac`` counts tokens with ``-A clip(r) > -A r``; ``dual_clip_frac`` tokens with
    ``A < 0`` and ``l > -A c``. ``normalizer``/``norm_constant`` as in ``aggregate_loss``.
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ConfigError(f"dual-clip clip_ratio_c must be > 1, found {clip_ratio_c}")
    log_ratio, ratio = _token_ratio(log_prob, old_log_prob, mask)
    advantages = zero_masked(advantages, mask)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    clip_frac = masked_mean((clipped > unclipped).to(ratio.dtype), mask)
    if clip_ratio_c is None:
        dual_clip_frac = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
    else:
        bound = -advantages * clip_ratio_c
        negative = advantages < 0
        dual_clip_frac = masked_mean((negative & (per_token > bound)).to(ratio.dtype), mask)
        per_token = torch.where(negative, torch.minimum(per_token, bound), per_token)
    loss = aggregate_loss(per_token, mask, aggregation, normalizer, norm_constant)
    k1, k3 = _ratio_metrics(log_ratio, mask)
    return PolicyLossOutput(loss, clip_frac.detach(), dual_clip_frac.detach(), k1, k3)


def gspo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    aggregation: LossAggregation = LossAggregation.SEQ_MEAN_TOKEN_MEAN,
    normalizer: LossNormalizer | None = None,
    norm_constant: float | None = None,
) -> PolicyLossOutput:
    """GSPO-token: the clipped surrogate with a sequence-level, length-normalised ratio.

    ``log s_i = mean_t (log pi - log pi_old)`` over the counted tokens of sequence ``i``; per token
    ``s_{i,t} = exp(sg[log s_i] + log pi_t - sg[log pi_t])`` (value ``s_i``, gradient of ``log pi_t``),
    and ``l = max(-A s, -A clip(s, 1 - clip_low, 1 + clip_high))``. The paper aggregates with
    ``SEQ_MEAN_TOKEN_MEAN`` (the default here) and much narrower clip ranges than PPO (3e-4, 4e-4).
    No dual-clip.
    """
    log_prob, advantages = zero_masked(log_prob, mask), zero_masked(advantages, mask)
    token_log_ratio = log_prob - zero_masked(old_log_prob, mask)
    seq_log_ratio = masked_mean(token_log_ratio.detach(), mask, dim=-1).unsqueeze(-1)
    log_s = torch.clamp(seq_log_ratio + log_prob - log_prob.detach(), max=_LOG_RATIO_LIMIT)
    ratio = torch.exp(log_s)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    clip_frac = masked_mean((clipped > unclipped).to(ratio.dtype), mask).detach()
    loss = aggregate_loss(per_token, mask, aggregation, normalizer, norm_constant)
    k1, k3 = _ratio_metrics(token_log_ratio, mask)
    return PolicyLossOutput(loss, clip_frac, torch.zeros_like(clip_frac), k1, k3)


def cispo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float | None,
    clip_high: float,
    aggregation: LossAggregation = LossAggregation.TOKEN_MEAN,
    normalizer: LossNormalizer | None = None,
    norm_constant: float | None = None,
) -> PolicyLossOutput:
    """CISPO: REINFORCE on ``log pi`` weighted by the clipped importance-sampling weight, which gets no gradient.

    ``r = exp(clamp(log pi - log pi_old, -20, 20))``, ``w = sg(clip(r, 1 - clip_low, 1 + clip_high))`` and::

        l = -w A log pi          d l / d log pi = -w A

    Unlike PPO's clip, which zeroes the gradient of a token whose ratio left the band, every token keeps
    a gradient here; only its weight is bounded. ``clip_low=None`` is no lower bound (MiniMax-M1 sets
    eps_low "to a large value" and tunes eps_high only). The paper averages over all tokens of the batch
    (``TOKEN_MEAN``). ``clip_frac`` counts tokens with ``r`` strictly outside the bounds. No dual-clip.
    """
    log_prob, advantages = zero_masked(log_prob, mask), zero_masked(advantages, mask)
    log_ratio, ratio = _token_ratio(log_prob.detach(), old_log_prob, mask)
    weight = torch.clamp(ratio, None if clip_low is None else 1.0 - clip_low, 1.0 + clip_high)
    per_token = -weight * advantages * log_prob
    clip_frac = masked_mean((weight != ratio).to(ratio.dtype), mask)
    loss = aggregate_loss(per_token, mask, aggregation, normalizer, norm_constant)
    k1, k3 = _ratio_metrics(log_ratio, mask)
    return PolicyLossOutput(loss, clip_frac, torch.zeros_like(clip_frac), k1, k3)


def sapo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    tau_pos: float,
    tau_neg: float,
    aggregation: LossAggregation = LossAggregation.TOKEN_MEAN,
    normalizer: LossNormalizer | None = None,
    norm_constant: float | None = None,
) -> PolicyLossOutput:
    """SAPO: the token ratio passes a smooth sigmoid gate instead of PPO's hard clip.

    ``r = exp(clamp(log pi - log pi_old, -20, 20))``, ``tau = tau_pos`` where ``A > 0``, else ``tau_neg``,
    ``s = sigmoid(tau (r - 1))`` and::

        l = -(4 / tau) s A          d l / d log pi = -4 s (1 - s) r A

    The gradient is the unclipped one (``-A r``) times ``4 s (1 - s)``: exactly 1 at ``r = 1`` (on-policy,
    plain policy gradient), decaying smoothly as ``r`` leaves 1, faster for larger ``tau``. The paper's
    ``tau_neg > tau_pos`` damps negative-advantage updates sooner. The paper averages per sequence, then
    over sequences (``SEQ_MEAN_TOKEN_MEAN``); the aggregation here is the caller's. ``clip_frac`` counts
    tokens whose gate weight ``4 s (1 - s)`` is below 1/2 (``tau |r - 1| > 1.7627``). No dual-clip.
    """
    log_ratio, ratio = _token_ratio(log_prob, old_log_prob, mask)
    advantages = zero_masked(advantages, mask)
    tau = torch.where(advantages > 0, ratio.new_tensor(tau_pos), ratio.new_tensor(tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    per_token = -(4.0 / tau) * gate * advantages
    s = gate.detach()
    clip_frac = masked_mean((4.0 * s * (1.0 - s) < 0.5).to(ratio.dtype), mask).detach()
    loss = aggregate_loss(per_token, mask, aggregation, normalizer, norm_constant)
    k1, k3 = _ratio_metrics(log_ratio, mask)
    return PolicyLossOutput(loss, clip_frac, torch.zeros_like(clip_frac), k1, k3)


PolicyLossFn = Callable[[Tensor, Tensor, Tensor, Tensor, PolicyLossConfig, LossNormalizer | None], PolicyLossOutput]


@policy_loss("ppo_clip", dual_clip=True)
def _ppo_clip_entry(
    lp: Tensor, old_lp: Tensor, adv: Tensor, mask: Tensor, cfg: PolicyLossConfig, norm: LossNormalizer | None
) -> PolicyLossOutput:
    return ppo_clip_loss(
        lp, old_lp, adv, mask, cfg.clip_low, cfg.clip_high, cfg.clip_ratio_c, cfg.aggregation, norm, cfg.norm_constant
    )


@policy_loss("gspo", sequence_ratio=True)
def _gspo_entry(
    lp: Tensor, old_lp: Tensor, adv: Tensor, mask: Tensor, cfg: PolicyLossConfig, norm: LossNormalizer | None
) -> PolicyLossOutput:
    return gspo_loss(lp, old_lp, adv, mask, cfg.clip_low, cfg.clip_high, cfg.aggregation, norm, cfg.norm_constant)


@policy_loss("cispo")
def _cispo_entry(
    lp: Tensor, old_lp: Tensor, adv: Tensor, mask: Tensor, cfg: PolicyLossConfig, norm: LossNormalizer | None
) -> PolicyLossOutput:
    return cispo_loss(
        lp, old_lp, adv, mask, cfg.cispo_clip_low, cfg.cispo_clip_high, cfg.aggregation, norm, cfg.norm_constant
    )


@policy_loss("sapo")
def _sapo_entry(
    lp: Tensor, old_lp: Tensor, adv: Tensor, mask: Tensor, cfg: PolicyLossConfig, norm: LossNormalizer | None
) -> PolicyLossOutput:
    return sapo_loss(
        lp, old_lp, adv, mask, cfg.sapo_tau_pos, cfg.sapo_tau_neg, cfg.aggregation, norm, cfg.norm_constant
    )


def compute_policy_loss(
    cfg: PolicyLossConfig,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    normalizer: LossNormalizer | None = None,
) -> PolicyLossOutput:
    """The policy loss ``cfg.loss`` with the clip ranges and aggregation of ``cfg``."""
    shapes = {t.shape for t in (log_prob, old_log_prob, advantages, mask)}
    if len(shapes) != 1:
        raise ValueError(f"log_prob, old_log_prob, advantages and mask must share one shape, found {shapes}")
    return resolve(POLICY_LOSS, cfg.loss)(log_prob, old_log_prob, advantages, mask, cfg, normalizer)


@dataclass(frozen=True)
class ValueLossOutput:
    loss: torch.Tensor  # scalar, differentiable
    clip_frac: torch.Tensor  # fraction of counted tokens where the clipped error is the larger one


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float | None,
    aggregation: LossAggregation = LossAggregation.TOKEN_MEAN,
    normalizer: LossNormalizer | None = None,
    norm_constant: float | None = None,
) -> ValueLossOutput:
    """Clipped value loss: ``0.5 * agg(max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2))``.

    ``clip_range=None`` gives the plain ``0.5 * agg((V - R)^2)``; ``clip_frac`` counts tokens where
    the clipped error is strictly larger (as in TRL and verl).
    """
    values, old_values, returns = (zero_masked(t, mask) for t in (values, old_values, returns))
    err = (values - returns).square()
    if clip_range is None:
        per_token, clip_frac = err, torch.zeros((), dtype=err.dtype, device=err.device)
    else:
        v_clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
        err_clipped = (v_clipped - returns).square()
        per_token = torch.maximum(err, err_clipped)
        clip_frac = masked_mean((err_clipped > err).to(err.dtype), mask).detach()
    loss = 0.5 * aggregate_loss(per_token, mask, aggregation, normalizer, norm_constant)
    return ValueLossOutput(loss, clip_frac)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last axis: ``H = logsumexp(z) - sum_v softmax(z)_v z_v``."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, top_quantile: float) -> torch.Tensor:
    """Which counted tokens are among the ``top_quantile`` share by entropy ("Beyond the 80/20 rule",
    arXiv 2506.01939; TRL's ``top_entropy_quantile``).

    The threshold is the ``1 - top_quantile`` quantile (linear interpolation, ``torch.quantile``'s default) of
    the float32 entropies of the counted tokens of ``entropy``; a counted token is kept where its entropy is
    at or above it (ties all kept). ``top_quantile=1`` keeps every counted token, ``0`` only the
    highest-entropy one(s). No counted token: nothing kept. Returns a bool tensor of ``entropy``'s shape
    (never true where ``mask`` is 0); no gradient flows through the choice.
    """
    if not 0.0 <= top_quantile <= 1.0:
        raise ConfigError(f"top_entropy_quantile must lie in [0, 1], found {top_quantile}")
    counted = mask != 0
    values = entropy.detach()[counted].float()
    if values.numel() == 0:
        return torch.zeros_like(counted)
    threshold = torch.quantile(values, 1.0 - top_quantile)
    return (entropy.detach().float() >= threshold) & counted


def aggregate_entropy(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    aggregation: LossAggregation = LossAggregation.TOKEN_MEAN,
    normalizer: LossNormalizer | None = None,
    norm_constant: float | None = None,
) -> torch.Tensor:
    """Per-token entropy ``[batch, response_len]`` aggregated like the policy loss it regularises.

    The trainer subtracts ``entropy_coef * aggregate_entropy(...)`` from the policy loss; using the
    same aggregation and normaliser keeps the bonus correct under micro-batching.
    """
    return aggregate_loss(entropy, mask, aggregation, normalizer, norm_constant)
