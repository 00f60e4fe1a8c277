"""TRL 1.16 GRPOTrainer options in megarl (issue #26), against TRL's formulas re-implemented here in float64.

Each reference below is written from TRL's source (``trl/trainer/grpo_trainer.py`` of trl==1.16.0, the
function named in its docstring) with plain Python floats or float64 torch autograd on its own formula,
never by calling the megarl code under test. Batches are hand-made: ragged masks, garbage in padding.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from megarl.algos import (
    AdvantageConfig,
    AdvantageInputs,
    KLEstimator,
    LossAggregation,
    RewardScale,
    compute_advantages,
    high_entropy_mask,
    kl_divergence,
    kl_loss,
    ppo_clip_loss,
)
from megarl.errors import ConfigError

MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float64)


def _lp(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = -torch.rand(MASK.shape, generator=g, dtype=torch.float64) * 3.0
    return torch.where(MASK != 0, x, torch.full_like(x, 123.0))  # garbage in the padding


def _trl_aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """TRL ``_compute_loss``: "grpo" (mean per sequence, then over sequences) and "bnpo"/"dapo" (one
    token mean over the batch; on one process without accumulation the two are equal)."""
    per_token = torch.where(mask != 0, per_token, torch.zeros_like(per_token))
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def _trl_kl(lp, old, ref, mask, bias_correction: bool, sequence: bool) -> torch.Tensor:
    """TRL ``GRPOTrainer._compute_loss``: ``per_token_kl = exp(ref - lp) - (ref - lp) - 1``, times
    ``coef_1 = exp(log_importance_weights)`` with ``use_bias_correction_kl`` (no clamp anywhere)."""
    log_ratio = lp - old
    log_w = log_ratio
    if sequence:  # importance_sampling_level="sequence"
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    per_token_kl = torch.exp(ref - lp) - (ref - lp) - 1
    if bias_correction:
        per_token_kl = per_token_kl * torch.exp(log_w)
    return per_token_kl


AGGREGATIONS = {"dapo": LossAggregation.TOKEN_MEAN, "grpo": LossAggregation.SEQ_MEAN_TOKEN_MEAN}


# ----------------------------------------------------------------------------- KL: bias correction, no clamp


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
@pytest.mark.parametrize("sequence", [False, True])
@pytest.mark.parametrize("bias_correction", [False, True])
def test_kl_loss_equals_trl_value_and_gradient(loss_type, sequence, bias_correction):
    old, ref = _lp(1), _lp(2)
    base = torch.where(MASK != 0, old + 0.3 * torch.randn(MASK.shape, generator=torch.Generator().manual_seed(3),
                                                          dtype=torch.float64), old)
    lp_ref = base.clone().requires_grad_(True)
    expected = _trl_aggregate(_trl_kl(lp_ref, old, ref, MASK, bias_correction, sequence), MASK, loss_type)
    expected.backward()
    lp = base.clone().requires_grad_(True)
    got = kl_loss(lp, ref, MASK, KLEstimator.K3, AGGREGATIONS[loss_type], clamp=False,
                  old_log_prob=old if bias_correction else None, sequence_ratio=sequence)
    got.backward()
    assert torch.allclose(got, expected, rtol=1e-12, atol=1e-12)
    assert torch.allclose(lp.grad, lp_ref.grad, rtol=1e-10, atol=1e-12)


def test_bias_corrected_kl_gradient_on_policy_is_the_log_ratio():
    """Hand-worked: on policy (old = sg(lp): ratio 1 in value), d/dlp [r k3] = (1 - e^d) + (e^d - d - 1) = -d
    per token with d = ref - lp, i.e. (lp - ref) / N under a token mean; without the ratio it is 1 - e^d."""
    lp = torch.tensor([[-1.0, -0.5, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-2.0, -0.25, -2.0]], dtype=torch.float64)
    mask = torch.ones_like(ref)
    kl_loss(lp, ref, mask, KLEstimator.K3, clamp=False, old_log_prob=lp.detach()).backward()
    assert torch.allclose(lp.grad, torch.tensor([[1.0, -0.25, 0.0]], dtype=torch.float64) / 3, atol=1e-15)
    plain = lp.detach().clone().requires_grad_(True)
    kl_loss(plain, ref, mask, KLEstimator.K3, clamp=False).backward()
    expected = [(1 - math.exp(r - x)) / 3 for x, r in zip([-1.0, -0.5, -2.0], [-2.0, -0.25, -2.0], strict=True)]
    assert torch.allclose(plain.grad, torch.tensor([expected], dtype=torch.float64), atol=1e-15)


def test_kl_clamp_is_megarl_default_and_off_is_trl():
    # d = ref - lp: 25 (past the log-ratio clamp), 3 (k3 = e^3 - 4 = 16.09 > 10), -12 (k3 = 11 > 10), 0.5 (in range)
    lp = torch.tensor([-30.0, -4.0, -1.0, -1.0], dtype=torch.float64)
    ref = torch.tensor([-5.0, -1.0, -13.0, -0.5], dtype=torch.float64)
    trl = [math.exp(r - x) - (r - x) - 1 for x, r in zip(lp.tolist(), ref.tolist(), strict=True)]
    plain = kl_divergence(lp, ref, KLEstimator.K3, clamp=False)
    assert torch.allclose(plain, torch.tensor(trl, dtype=torch.float64), rtol=1e-12)
    clamped = kl_divergence(lp, ref, KLEstimator.K3)
    assert clamped.tolist()[:3] == [10.0, 10.0, 10.0] and math.isclose(clamped[3].item(), trl[3], rel_tol=1e-12)
    # the switch changes nothing for the estimators without clamps
    for est in (KLEstimator.K1, KLEstimator.K2, KLEstimator.ABS):
        assert torch.equal(kl_divergence(lp, ref, est, clamp=False), kl_divergence(lp, ref, est))


# ----------------------------------------------------------------------------- scale_rewards and eps


def _trl_advantages(rewards: list[float], num_generations: int, scale: str, eps: float) -> list[float]:
    """TRL ``_generate_and_score_completions`` (multi_objective_aggregation="sum_then_normalize"): group mean
    over consecutive ``num_generations``; std (Bessel, ``nanstd``) per group, over the batch, or none."""
    groups = [rewards[i:i + num_generations] for i in range(0, len(rewards), num_generations)]
    out = []
    for i, r in enumerate(rewards):
        group = groups[i // num_generations]
        adv = r - statistics.fmean(group)
        if scale == "group":
            adv /= statistics.stdev(group) + eps
        elif scale == "batch":
            adv /= statistics.stdev(rewards) + eps
        out.append(adv)
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("eps", [1e-4, 1e-6])
def test_grpo_scale_rewards_equals_trl(scale, eps):
    rewards = [1.0, 0.0, 0.5, 1.0, 0.25, 0.25, 0.25, 0.25, 3.0, -1.0, 0.0, 2.0]  # one group of equal rewards
    n = 4
    mask = torch.tensor([[1, 1, 0]] * len(rewards), dtype=torch.float32)
    token_rewards = torch.zeros(mask.shape)
    token_rewards[:, 1] = torch.tensor(rewards)  # the outcome on the last counted token
    cfg = AdvantageConfig(estimator="grpo", scale_rewards=RewardScale(scale), eps=eps)
    out = compute_advantages(cfg, AdvantageInputs(token_rewards.double(), mask.double(),
                                                  group_ids=torch.arange(len(rewards)) // n))
    expected = _trl_advantages(rewards, n, scale, eps)
    assert torch.allclose(out.advantages[:, 0], torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert torch.equal(out.advantages[:, 2], torch.zeros(len(rewards), dtype=torch.float64))


def test_grpo_default_scale_is_group_with_megarl_eps():
    cfg = AdvantageConfig(estimator="grpo")
    assert cfg.scale_rewards is RewardScale.GROUP and cfg.eps == 1e-6


# ----------------------------------------------------------------------------- top_entropy_quantile


def _trl_entropy_mask(entropies: list[list[float]], mask: list[list[int]], rho: float) -> list[list[bool]]:
    """TRL ``get_high_entropy_mask(entropies, mask, 1 - rho)``: ``torch.quantile`` (linear interpolation) of the
    non-pad entropies; keep non-pad tokens with entropy >= it. Quantile written out: position q (n - 1)."""
    values = sorted(e for row, m_row in zip(entropies, mask, strict=True) for e, m in zip(row, m_row, strict=True)
                    if m)
    pos = (1.0 - rho) * (len(values) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    threshold = values[lo] + (pos - lo) * (values[hi] - values[lo])
    return [[bool(m) and e >= threshold for e, m in zip(row, m_row, strict=True)]
            for row, m_row in zip(entropies, mask, strict=True)]


ENTROPY = [[0.5, 2.25, 1.0, 9.0], [3.0, 0.125, 1.0, 4.5], [2.25, 7.0, 7.0, 7.0]]  # float32-exact, ties; pads large
ENT_MASK = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


@pytest.mark.parametrize("rho", [1.0, 0.8, 0.5, 0.2, 0.1, 0.0])
def test_high_entropy_mask_equals_trl(rho):
    got = high_entropy_mask(torch.tensor(ENTROPY), torch.tensor(ENT_MASK), rho)
    assert got.tolist() == _trl_entropy_mask(ENTROPY, ENT_MASK, rho)


def test_high_entropy_mask_hand_worked():
    # counted entropies sorted: 0.125 0.5 1 1 2.25 2.25 3 4.5 (n = 8). rho 0.5: position 0.5 * 7 = 3.5 ->
    # threshold 1 + 0.5 * (2.25 - 1) = 1.625: keep 2.25, 2.25, 3, 4.5 (the pads' 9 and 7 never)
    got = high_entropy_mask(torch.tensor(ENTROPY), torch.tensor(ENT_MASK), 0.5)
    assert got.tolist() == [[False, True, False, False], [True, False, False, True], [True, False, False, False]]
    assert not high_entropy_mask(torch.tensor(ENTROPY), torch.zeros(3, 4), 0.2).any()
    with pytest.raises(ConfigError, match=r"\[0, 1\]"):
        high_entropy_mask(torch.tensor(ENTROPY), torch.tensor(ENT_MASK), 1.5)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_zeroed_advantages_are_trl_entropy_masked_loss(loss_type):
    """What the policy update does with ``top_entropy_quantile``: zero the advantages of the tokens left out.
    TRL multiplies the per-token PPO loss by the mask and keeps the full mask in the denominator."""
    old, mask = _lp(4), MASK
    base = torch.where(mask != 0, old + 0.4 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(5),
                                                          dtype=torch.float64), old)
    adv = torch.tensor([[1.5, 1.5, 1.5, 9.0], [-0.5, -0.5, -0.5, -0.5], [2.0, 9.0, 9.0, 9.0]], dtype=torch.float64)
    keep = torch.tensor(_trl_entropy_mask(ENTROPY, ENT_MASK, 0.5), dtype=torch.float64)
    lp_ref = base.clone().requires_grad_(True)
    coef_1 = torch.exp(lp_ref - old)
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.28)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv) * keep  # TRL: per_token_loss * entropy_mask
    expected = _trl_aggregate(per_token, mask, loss_type)
    expected.backward()
    lp = base.clone().requires_grad_(True)
    kept = high_entropy_mask(torch.tensor(ENTROPY, dtype=torch.float64), mask, 0.5)
    out = ppo_clip_loss(lp, old, adv * kept, mask, 0.2, 0.28, aggregation=AGGREGATIONS[loss_type])
    out.loss.backward()
    assert torch.allclose(out.loss, expected, rtol=1e-12, atol=1e-14)
    assert torch.allclose(lp.grad, lp_ref.grad, rtol=1e-10, atol=1e-14)
