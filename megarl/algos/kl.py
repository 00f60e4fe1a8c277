"""KL between the policy and a reference: per-token estimators, the reward penalty, the KL loss, controllers.

Owns the estimator registry (``KL_ESTIMATORS``, keyed by :class:`KLEstimator`), how a KL penalty is
folded into token rewards (:func:`apply_kl_penalty`, PPO/REINFORCE++ style), the KL loss term
(:func:`kl_loss`, GRPO style) and the coefficient controllers (fixed, adaptive). Estimators follow
J. Schulman, "Approximating KL divergence" (2020): with samples ``x ~ pi`` and
``log r = log pi_ref(x) - log pi(x)``, each estimates ``KL(pi || pi_ref)``.

Must not import: torch.distributed, megatron, Ray, vLLM, or any megarl layer above ``algos``.
Controllers hold one float of state; the trainer saves ``state_dict()`` with its checkpoint.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from megarl.algos.ops import LossAggregation, LossNormalizer, aggregate_loss, lookup, masked_mean, zero_masked
from megarl.errors import ConfigError

# exp() of a log-ratio beyond this is inf in float32 (as in megarl.algos.losses)
_LOG_RATIO_LIMIT = 20.0


class KLEstimator(enum.Enum):
    K1 = "kl"
    K2 = "mse"
    K3 = "low_var_kl"
    ABS = "abs"


def kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``k1 = log pi - log pi_ref`` (unbiased, high variance, can be negative)."""
    return log_prob - ref_log_prob


def kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``k2 = 0.5 * (log pi - log pi_ref)^2`` (biased, low variance, its gradient is the KL gradient)."""
    return 0.5 * (log_prob - ref_log_prob).square()


def kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, clamp: bool = True) -> torch.Tensor:
    """``k3 = exp(d) - d - 1`` with ``d = clamp(log pi_ref - log pi, -20, 20)``, result clamped to [-10, 10].

    Unbiased and non-negative before clamping; the clamps (as in verl's ``low_var_kl``) keep a
    single far-off token from producing inf or dominating the batch. The price: a token whose k3
    exceeds 10 (``log pi_ref - log pi`` beyond about 2.6 or below -11) gets no KL gradient at all.
    ``clamp=False`` is the plain formula, as TRL's GRPOTrainer computes it (``algorithm.kl_clamp``).
    """
    d = ref_log_prob - log_prob
    if not clamp:
        return torch.exp(d) - d - 1.0
    d = torch.clamp(d, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(d) - d - 1.0, min=-10.0, max=10.0)


def kl_abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``|log pi - log pi_ref|``."""
    return (log_prob - ref_log_prob).abs()


KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

KL_ESTIMATORS: dict[KLEstimator, KLFn] = {
    KLEstimator.K1: kl_k1,
    KLEstimator.K2: kl_k2,
    KLEstimator.K3: kl_k3,
    KLEstimator.ABS: kl_abs,
}


def kl_divergence(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, estimator: KLEstimator,
                  clamp: bool = True) -> torch.Tensor:
    """Per-token KL estimate of ``KL(pi || pi_ref)`` by ``estimator`` (same shape as the inputs).

    ``clamp=False`` drops ``low_var_kl``'s clamps (:func:`kl_k3`); the other estimators have none."""
    if log_prob.shape != ref_log_prob.shape:
        raise ValueError(f"log_prob {tuple(log_prob.shape)} and ref_log_prob {tuple(ref_log_prob.shape)} differ")
    fn = lookup(KL_ESTIMATORS, estimator, KLEstimator, "KL estimator")
    if not clamp and fn is kl_k3:
        return kl_k3(log_prob, ref_log_prob, clamp=False)
    return fn(log_prob, ref_log_prob)


@dataclass(frozen=True)
class KLPenalty:
    rewards: torch.Tensor  # [batch, response_len] token rewards minus coef * kl; 0 where masked
    kl: torch.Tensor  # [batch, response_len] per-token estimate; 0 where masked
    mean_kl: torch.Tensor  # scalar: per-sequence token-mean, averaged over sequences (controller input)


@torch.no_grad()
def apply_kl_penalty(
    token_rewards: torch.Tensor,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    estimator: KLEstimator = KLEstimator.K1,
    clamp: bool = True,
) -> KLPenalty:
    """``r'_t = r_t - coef * kl_t`` on counted tokens, 0 elsewhere (Ziegler et al. 2019 reward shaping).

    ``log_prob`` are the log-probs the responses were sampled with (the "old" policy).
    ``mean_kl = mean_i (sum_t m kl / n_i)`` over sequences with at least one counted token, the
    quantity :class:`AdaptiveKLController` is driven by.
    """
    kl = zero_masked(kl_divergence(log_prob, ref_log_prob, estimator, clamp), mask)
    rewards = zero_masked(token_rewards - coef * kl, mask)
    per_seq = masked_mean(kl, mask, dim=-1)
    has_tokens = (mask != 0).any(dim=-1)
    mean_kl = per_seq.sum() / has_tokens.sum().clamp(min=1)
    return KLPenalty(rewards, kl, mean_kl)


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    mask: torch.Tensor,
    estimator: KLEstimator = KLEstimator.K3,
    aggregation: LossAggregation = LossAggregation.TOKEN_MEAN,
    normalizer: LossNormalizer | None = None,
    norm_constant: float | None = None,
    clamp: bool = True,
    old_log_prob: torch.Tensor | None = None,
    sequence_ratio: bool = False,
) -> torch.Tensor:
    """The KL term added to the policy loss (GRPO): ``aggregate_loss(kl_divergence(...), mask, aggregation)``.

    Differentiable in ``log_prob``; ``normalizer`` and ``norm_constant`` as in :func:`aggregate_loss`;
    ``clamp`` as in :func:`kl_divergence`.

    With ``old_log_prob`` (the policy that sampled) each token's KL is multiplied by the importance ratio
    ``r = exp(log pi - log pi_old)``, which keeps its gradient: ``d(r kl) = r dkl + kl dr``, so even on
    policy (``r = 1`` in value) the gradient gains ``kl * d log pi`` and becomes the unbiased gradient of
    the reverse KL (DeepSeek-V3.2; TRL's ``use_bias_correction_kl``). ``sequence_ratio`` uses one ratio
    per sequence, ``exp(mean_t (log pi - log pi_old))`` over its counted tokens (TRL's
    ``importance_sampling_level="sequence"``, megarl's GSPO). The log-ratio is clamped to +-20 with ``clamp``.
    """
    kl = kl_divergence(zero_masked(log_prob, mask), zero_masked(ref_log_prob, mask), estimator, clamp)
    if old_log_prob is not None:
        log_ratio = zero_masked(log_prob - old_log_prob, mask)
        if sequence_ratio:
            log_ratio = masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1)
        if clamp:
            log_ratio = torch.clamp(log_ratio, -_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
        kl = kl * torch.exp(log_ratio)
    return aggregate_loss(kl, mask, aggregation, normalizer, norm_constant)


class KLController(Protocol):
    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, float]: ...

    def load_state_dict(self, state: dict[str, float]) -> None: ...


class FixedKLController:
    """A constant KL coefficient; ``update`` does nothing."""

    def __init__(self, coef: float) -> None:
        if coef < 0:
            raise ConfigError(f"KL coefficient must be >= 0, found {coef}")
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        del current_kl, n_steps

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Proportional controller of Ziegler et al. 2019 ("Fine-tuning LMs from human preferences", eq. 2).

    ``e = clip(current_kl / target - 1, -0.2, 0.2)``; ``value <- value * (1 + e * n_steps / horizon)``.
    ``n_steps`` is the number of samples (the paper) or steps the KL was measured over, in the unit
    that ``horizon`` is expressed in.
    """

    def __init__(self, coef: float, target: float, horizon: float) -> None:
        super().__init__(coef)
        if target <= 0 or horizon <= 0:
            raise ConfigError(f"adaptive KL needs target > 0 and horizon > 0, found target={target}, horizon={horizon}")
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


class KLControllerType(enum.Enum):
    FIXED = "fixed"
    ADAPTIVE = "adaptive"


@dataclass(frozen=True)
class KLControllerConfig:
    kind: KLControllerType = KLControllerType.FIXED  # fixed or adaptive (PPO's controller)
    coef: float = 0.001  # initial (or fixed) coefficient
    target: float = 0.1  # adaptive only: the KL aimed for
    horizon: float = 10000.0  # adaptive only: samples over which the error is corrected

    def __post_init__(self) -> None:
        if self.coef < 0:
            raise ConfigError(f"KL coef must be >= 0, found {self.coef}")
        if self.kind is KLControllerType.ADAPTIVE and (self.target <= 0 or self.horizon <= 0):
            raise ConfigError(f"adaptive KL needs target > 0 and horizon > 0, found {self.target}, {self.horizon}")


KL_CONTROLLERS: dict[KLControllerType, Callable[[KLControllerConfig], KLController]] = {
    KLControllerType.FIXED: lambda cfg: FixedKLController(cfg.coef),
    KLControllerType.ADAPTIVE: lambda cfg: AdaptiveKLController(cfg.coef, cfg.target, cfg.horizon),
}


def build_kl_controller(cfg: KLControllerConfig) -> KLController:
    """The controller ``cfg.kind`` names, initialised from ``cfg``."""
    return lookup(KL_CONTROLLERS, cfg.kind, KLControllerType, "KL controller")(cfg)
