"""CISPO and SAPO policy losses against float64 Python loops and hand-worked examples.

References are written from the papers' formulas with plain Python floats (``math``), never by calling
the code under test: CISPO (MiniMax-M1, arXiv 2506.13585) ``l = -sg(clip(r, 1 - e_low, 1 + e_high)) A log pi``,
so ``d l / d log pi = -w A``; SAPO (arXiv 2511.20347) ``l = -(4 / tau) sigmoid(tau (r - 1)) A`` with
``tau = tau_pos`` where ``A > 0`` else ``tau_neg``, so ``d l / d log pi = -4 s (1 - s) r A``. Gradients come
from ``torch.autograd.grad`` and are compared with those derivatives times the aggregation's weight of
the token. Masks are ragged (full, padded, length 1, a hole, empty) and padding holds NaN.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from megarl.algos import (
    LossAggregation,
    LossNormalizer,
    PolicyLossConfig,
    cispo_loss,
    compute_policy_loss,
    sapo_loss,
)
from megarl.config import from_dict
from megarl.errors import ConfigError

MASK_ROWS = [
    [1, 1, 1, 1, 1, 1],
    [1, 1, 1, 0, 0, 0],
    [1, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 1, 1],
    [0, 0, 0, 0, 0, 0],
]
B, T = len(MASK_ROWS), len(MASK_ROWS[0])
MODES = list(LossAggregation)
C = 6.0  # norm_constant for SEQ_MEAN_TOKEN_SUM_NORM


def _mask() -> torch.Tensor:
    return torch.tensor(MASK_ROWS, dtype=torch.float64)


def _valid(i: int) -> list[int]:
    return [t for t in range(T) if MASK_ROWS[i][t]]


def _rand(seed: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """float64 ``[B, T]`` values, NaN at masked positions so any leak through the mask shows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((B, T), generator=g, dtype=torch.float64) * scale + shift
    return torch.where(_mask() != 0, x, torch.full_like(x, float("nan")))


def _close(actual: torch.Tensor, expected, tol: float = 1e-10) -> None:
    exp = torch.tensor(expected, dtype=torch.float64)
    got = actual.detach().double()
    assert got.shape == exp.shape, (got.shape, exp.shape)
    assert torch.isfinite(got).all() and ((got - exp).abs() <= tol * (1 + exp.abs())).all(), f"{got}\n!=\n{exp}"


def ref_weight(i: int, mode: LossAggregation) -> float:
    """d(aggregated loss) / d(per-token loss of a counted token in row i), from the mode's formula."""
    n_tok = sum(len(_valid(r)) for r in range(B))
    n_seq = sum(1 for r in range(B) if _valid(r))
    return {
        LossAggregation.TOKEN_MEAN: 1 / n_tok,
        LossAggregation.SEQ_MEAN_TOKEN_SUM: 1 / n_seq,
        LossAggregation.SEQ_MEAN_TOKEN_MEAN: 1 / (len(_valid(i)) * n_seq),
        LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM: 1 / (n_seq * C),
    }[mode]


def ref_cispo(lp, old, adv, lo, hi):
    """Per-token (loss, d loss / d log pi) and the clipped share, from CISPO's formula."""
    loss, grad, clipped, n = {}, {}, 0, 0
    for i in range(B):
        for t in _valid(i):
            x, a = float(lp[i, t]), float(adv[i, t])
            r = math.exp(x - float(old[i, t]))
            w = min(r, 1 + hi) if lo is None else min(max(r, 1 - lo), 1 + hi)
            loss[i, t], grad[i, t] = -w * a * x, -w * a
            clipped += w != r
            n += 1
    return loss, grad, clipped / n


def ref_sapo(lp, old, adv, tau_pos, tau_neg):
    """Per-token (loss, d loss / d log pi) and the share with gate weight below 1/2, from SAPO's formula."""
    loss, grad, damped, n = {}, {}, 0, 0
    for i in range(B):
        for t in _valid(i):
            a = float(adv[i, t])
            r = math.exp(float(lp[i, t]) - float(old[i, t]))
            tau = tau_pos if a > 0 else tau_neg
            s = 1 / (1 + math.exp(-tau * (r - 1)))
            loss[i, t], grad[i, t] = -(4 / tau) * s * a, -4 * s * (1 - s) * r * a
            damped += 4 * s * (1 - s) < 0.5
            n += 1
    return loss, grad, damped / n


def ref_aggregate(loss: dict, mode: LossAggregation) -> float:
    return sum(v * ref_weight(i, mode) for (i, _), v in loss.items())


def ref_grad(grad: dict, mode: LossAggregation) -> list[list[float]]:
    return [[grad[i, t] * ref_weight(i, mode) if (i, t) in grad else 0.0 for t in range(T)] for i in range(B)]


def _check_kl(out, lp, old) -> None:
    log_r = [float(lp[i, t]) - float(old[i, t]) for i in range(B) for t in _valid(i)]
    _close(out.approx_kl_k1, statistics.mean(-x for x in log_r))
    _close(out.approx_kl_k3, statistics.mean(math.exp(x) - 1 - x for x in log_r))
    _close(out.dual_clip_frac, 0.0)


# --------------------------------------------------------------------------------------------- CISPO


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
@pytest.mark.parametrize("clip_low", [None, 0.2], ids=["no-floor", "floor-0.8"])
def test_cispo_against_token_loop(mode, clip_low):
    old = _rand(1, 0.5, shift=-1.5)  # log-probs around -1.5
    lp = (old + _rand(2, 0.5)).requires_grad_()  # ratios e^N(0, 0.25): above 1.28 and below 0.8 both occur
    adv = _rand(3, 1.5)
    out = cispo_loss(lp, old, adv, _mask(), clip_low, 0.28, mode, norm_constant=C)
    (grad,) = torch.autograd.grad(out.loss, lp)
    loss, dlp, clip_frac = ref_cispo(lp.detach(), old, adv, clip_low, 0.28)
    _close(out.loss, ref_aggregate(loss, mode))
    _close(grad, ref_grad(dlp, mode))  # exactly 0, not NaN, on the NaN-poisoned padding
    _close(out.clip_frac, clip_frac)
    assert 0 < clip_frac < 1
    _check_kl(out, lp.detach(), old)


def test_cispo_clipped_tokens_keep_their_gradient_hand_worked():
    # r = (1.5, 0.5, 5, 1), A = (+1, +1, -1, -2), log pi = (-1, -2, -0.5, -0.25), bounds [none, 1.2]:
    # w = (1.2, 0.5, 1.2, 1); l = -w A log pi = (1.2, 1, -0.6, -0.5); token-mean 1.1 / 4 = 0.275.
    # d l / d log pi = -w A = (-1.2, -0.5, 1.2, 2) / 4: clipped tokens keep a (bounded) gradient, PPO's would be 0.
    lp = torch.tensor([[-1.0, -2.0, -0.5, -0.25]], dtype=torch.float64, requires_grad=True)
    old = lp.detach() - torch.log(torch.tensor([[1.5, 0.5, 5.0, 1.0]], dtype=torch.float64))
    adv = torch.tensor([[1.0, 1.0, -1.0, -2.0]], dtype=torch.float64)
    out = cispo_loss(lp, old, adv, torch.ones(1, 4), None, 0.2)
    _close(out.loss, 0.275)
    _close(torch.autograd.grad(out.loss, lp)[0], [[-0.3, -0.125, 0.3, 0.5]])
    _close(out.clip_frac, 0.5)  # 1.5 and 5 are above 1.2; 0.5 has no floor to hit


def test_cispo_ratio_exactly_at_the_bounds_is_not_clipped():
    # r = 1.25 = 1 + clip_high and r = 0.75 = 1 - clip_low exactly (log pi_old = 0, so exp(log r) is r to
    # the bit for these binary fractions): the weight is r itself and the token is not counted as clipped;
    # beyond each bound (r = 1.5, 0.5) the weight is the bound. A = 1: l = -w log r, d l / d log pi = -w.
    r = [1.25, 0.75, 1.5, 0.5]
    w = [1.25, 0.75, 1.25, 0.75]
    lp = torch.log(torch.tensor([r], dtype=torch.float64)).requires_grad_()
    assert torch.exp(lp.detach()).tolist() == [r]
    out = cispo_loss(lp, torch.zeros(1, 4, dtype=torch.float64), torch.ones(1, 4), torch.ones(1, 4), 0.25, 0.25)
    _close(torch.autograd.grad(out.loss, lp)[0], [[-x / 4 for x in w]])
    _close(out.loss, sum(-wi * math.log(ri) for wi, ri in zip(w, r, strict=True)) / 4)
    _close(out.clip_frac, 0.5)


# --------------------------------------------------------------------------------------------- SAPO


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
@pytest.mark.parametrize("taus", [(1.0, 1.05), (0.5, 3.0)], ids=["paper", "far-apart"])
def test_sapo_against_token_loop(mode, taus):
    old = _rand(4, 0.5, shift=-1.5)
    lp = (old + _rand(5, 0.8)).requires_grad_()  # ratios from ~0.2 to ~5: the gate decays on both sides
    adv = _rand(6, 1.5)
    adv[1, 1] = 0.0  # A = 0 takes tau_neg and contributes nothing
    out = sapo_loss(lp, old, adv, _mask(), *taus, mode, norm_constant=C)
    (grad,) = torch.autograd.grad(out.loss, lp)
    loss, dlp, damped = ref_sapo(lp.detach(), old, adv, *taus)
    _close(out.loss, ref_aggregate(loss, mode))
    _close(grad, ref_grad(dlp, mode))
    _close(out.clip_frac, damped)
    assert (adv[_mask() != 0] > 0).any() and (adv[_mask() != 0] < 0).any()
    _check_kl(out, lp.detach(), old)


def test_sapo_gate_hand_worked():
    # Token 1, 2: r = 1 (on-policy). The gate is (4/tau) sigmoid(0) = 2/tau: l = -2A/tau; its gradient
    # weight 4 s (1 - s) = 1, so d l / d log pi = -A r = -A, whatever tau: A = +1 (tau_pos = 0.5): l = -4,
    # g = -1; A = -1 (tau_neg = 2): l = +1, g = +1.
    # Token 3: r = 1 + ln 3, A = +1, tau_pos = 0.5: s = sigmoid(ln 3 / 2) = sqrt3 / (1 + sqrt3);
    # Token 4: same r, A = -1, tau_neg = 2: s = sigmoid(2 ln 3) = 9/10, weight 4 * 0.9 * 0.1 = 0.36 < 1/2.
    r = torch.tensor([[1.0, 1.0, 1 + math.log(3), 1 + math.log(3)]], dtype=torch.float64)
    lp = torch.full((1, 4), -0.7, dtype=torch.float64, requires_grad=True)
    old = lp.detach() - torch.log(r)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    out = sapo_loss(lp, old, adv, torch.ones(1, 4), 0.5, 2.0, LossAggregation.SEQ_MEAN_TOKEN_SUM)
    s3 = math.sqrt(3) / (1 + math.sqrt(3))
    r3 = 1 + math.log(3)
    _close(out.loss, -4.0 + 1.0 - 8 * s3 + 2 * 0.9)
    _close(torch.autograd.grad(out.loss, lp)[0], [[-1.0, 1.0, -4 * s3 * (1 - s3) * r3, 0.36 * r3]])
    _close(out.clip_frac, 0.25)  # token 4 only (token 3's weight is 4 s3 (1 - s3) = 0.93)


# --------------------------------------------------------------------------------------------- both


LOSSES = {"cispo": lambda *a, mode, norm=None: cispo_loss(*a, None, 0.28, mode, norm, C),
          "sapo": lambda *a, mode, norm=None: sapo_loss(*a, 1.0, 1.05, mode, norm, C)}


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
@pytest.mark.parametrize("name", list(LOSSES))
def test_all_masked_gives_zero_loss_and_gradient(name, mode):
    nan = torch.full((2, 3), float("nan"), dtype=torch.float64)
    lp = nan.clone().requires_grad_()
    out = LOSSES[name](lp, nan, nan, torch.zeros(2, 3), mode=mode)
    (grad,) = torch.autograd.grad(out.loss, lp)
    _close(out.loss, 0.0)
    _close(grad, [[0.0] * 3] * 2)
    for v in out.metrics().values():
        _close(v, 0.0)


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
@pytest.mark.parametrize("name", list(LOSSES))
def test_micro_batches_with_the_global_normalizer_add_up(name, mode):
    old = _rand(7, 0.5, shift=-1.5)
    lp = (old + _rand(8, 0.5)).requires_grad_()
    adv, mask = _rand(9), _mask()
    full = LOSSES[name](lp, old, adv, mask, mode=mode)
    norm = LossNormalizer.of(mask)
    parts = [LOSSES[name](lp[s], old[s], adv[s], mask[s], mode=mode, norm=norm) for s in (slice(0, 2), slice(2, B))]
    _close(parts[0].loss + parts[1].loss, float(full.loss.detach()))
    _close(torch.autograd.grad(parts[0].loss + parts[1].loss, lp)[0], torch.autograd.grad(full.loss, lp)[0].tolist())


# --------------------------------------------------------------------------------------------- config


def test_registry_reads_each_loss_own_knobs():
    # r = 1.5 with A = 1, log pi = -1: CISPO's default cap 1 + 4.0 leaves it (the PPO clip_high 0.2 does not
    # apply): l = 1.5; with cispo_clip_high = 0.28 the weight is 1.28. SAPO with tau_pos = 2: s = sigmoid(1),
    # l = -(4/2) s = -2 s.
    lp = torch.tensor([[-1.0]], dtype=torch.float64)
    old = lp - math.log(1.5)
    adv, mask = torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1)
    _close(compute_policy_loss(PolicyLossConfig(loss="cispo"), lp, old, adv, mask).loss, 1.5)
    cfg = from_dict(PolicyLossConfig, {"loss": "cispo", "cispo_clip_high": 0.28})
    assert cfg.loss == "cispo" and cfg.cispo_clip_low is None
    _close(compute_policy_loss(cfg, lp, old, adv, mask).loss, 1.28)
    cfg = from_dict(PolicyLossConfig, {"loss": "sapo", "sapo_tau_pos": 2.0})
    _close(compute_policy_loss(cfg, lp, old, adv, mask).loss, -2 / (1 + math.exp(-1.0)))


def test_dual_clip_and_bad_knobs_are_refused():
    for loss in ("cispo", "sapo", "gspo"):
        with pytest.raises(ConfigError, match=f"{loss} has no dual-clip"):
            PolicyLossConfig(loss=loss, clip_ratio_c=3.0)
    with pytest.raises(ConfigError, match="SAPO temperatures must be > 0"):
        PolicyLossConfig(loss="sapo", sapo_tau_neg=0.0)
    with pytest.raises(ConfigError, match="cispo_clip_low >= 0"):
        PolicyLossConfig(loss="cispo", cispo_clip_high=-0.1)
