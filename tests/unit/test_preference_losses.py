"""megarl.algos.preference against a float64 hand computation on a hand-made batch of three pairs (issue #44:
hinge and label-smoothed DPO by hand; sigmoid, robust and IPO the same way). The reference is Python's math on
the formulas as the papers state them, not the code under test."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algos.preference import DPOLoss, dpo_losses

PI_C, PI_R = [-1.0, -4.0, -2.5], [-3.0, -2.0, -2.5]
REF_C, REF_R = [-1.5, -3.0, -2.0], [-2.5, -2.5, -3.0]
BETA = 0.5


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def _by_hand(kind: str, eps: float = 0.0) -> list[float]:
    out = []
    for pc, pr, rc, rr in zip(PI_C, PI_R, REF_C, REF_R, strict=True):
        h = (pc - pr) - (rc - rr)  # 1.0, -1.5, -1.0
        if kind == "sigmoid":
            out.append(-(1 - eps) * _log_sigmoid(BETA * h) - eps * _log_sigmoid(-BETA * h))
        elif kind == "robust":
            out.append((-(1 - eps) * _log_sigmoid(BETA * h) + eps * _log_sigmoid(-BETA * h)) / (1 - 2 * eps))
        elif kind == "hinge":
            out.append(max(0.0, 1 - BETA * h))
        else:
            out.append((h - 1 / (2 * BETA)) ** 2)
    return out


@pytest.mark.parametrize("kind, eps", [("sigmoid", 0.0), ("sigmoid", 0.1), ("robust", 0.1), ("hinge", 0.0),
                                       ("ipo", 0.0)])
def test_losses_and_rewards_by_hand(kind, eps):
    t = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
    pi_c = t(PI_C).requires_grad_(True)
    out = dpo_losses(pi_c, t(PI_R), t(REF_C), t(REF_R), beta=BETA, loss=DPOLoss(kind), label_smoothing=eps)
    assert out.losses.tolist() == pytest.approx(_by_hand(kind, eps), abs=1e-12)
    chosen = [BETA * (p - r) for p, r in zip(PI_C, REF_C, strict=True)]  # 0.25, -0.5, -0.25
    rejected = [BETA * (p - r) for p, r in zip(PI_R, REF_R, strict=True)]  # -0.25, 0.25, 0.25
    assert out.chosen_rewards.tolist() == pytest.approx(chosen) and out.rejected_rewards.tolist() == pytest.approx(
        rejected)
    m = out.metrics(t(PI_C), t(PI_R))
    assert m["rewards/accuracies"] == pytest.approx(1 / 3) and m["rewards/margins"] == pytest.approx(
        sum(c - r for c, r in zip(chosen, rejected, strict=True)) / 3)
    assert m["logps/chosen"] == pytest.approx(sum(PI_C) / 3) and m["loss"] == pytest.approx(
        sum(_by_hand(kind, eps)) / 3)
    out.losses.sum().backward()  # differentiable in the policy's log-probs
    assert pi_c.grad is not None and torch.isfinite(pi_c.grad).all()


def test_label_smoothing_is_refused_where_it_means_nothing():
    x = torch.zeros(1)
    with pytest.raises(ValueError, match="applies to the sigmoid and robust losses, not hinge"):
        dpo_losses(x, x, x, x, loss=DPOLoss.HINGE, label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"must be in \[0, 0.5\)"):
        dpo_losses(x, x, x, x, label_smoothing=0.5)
