"""megarl.algos.preference against float64 hand computations on hand-made batches (issue #44): DPO (sigmoid,
robust, hinge, length-normalised IPO), KTO (KL estimate, weights, a batch without undesirable rows, micro-batch
sums) and the Bradley-Terry reward-model loss (margins, reward centring, metrics). The expected values are Python's
math on TRL 1.16's formulas (trl/trainer/dpo_trainer.py, kto_trainer.py, reward_trainer.py), never the code under
test; gradients are checked against the derivative by hand or float64 autograd of a separate transcription of
TRL's code."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from megarl.algos.preference import (
    DPOLoss,
    combine_metric_sums,
    dpo_losses,
    kto_kl,
    kto_losses,
    kto_metrics,
    reward_model_losses,
    reward_model_metrics,
)

PI_C, PI_R = [-1.0, -4.0, -2.5], [-3.0, -2.0, -2.5]
REF_C, REF_R = [-1.5, -3.0, -2.0], [-2.5, -2.5, -3.0]
LEN_C, LEN_R = [2, 5, 0], [4, 1, 3]  # completion token counts (IPO); 0 is clamped to 1 as TRL does
BETA = 0.5


def t(xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


# ------------------------------------------------------------------------------------------------------------- DPO


def _dpo_by_hand(kind: str, eps: float = 0.0) -> list[float]:
    out = []
    for pc, pr, rc, rr, nc, nr in zip(PI_C, PI_R, REF_C, REF_R, LEN_C, LEN_R, strict=True):
        h = (pc - rc) - (pr - rr)  # 1.0, -1.5, -1.0
        if kind == "sigmoid":  # TRL 1.16: no label smoothing
            out.append(-_log_sigmoid(BETA * h))
        elif kind == "robust":
            out.append((-(1 - eps) * _log_sigmoid(BETA * h) + eps * _log_sigmoid(-BETA * h)) / (1 - 2 * eps))
        elif kind == "hinge":
            out.append(max(0.0, 1 - BETA * h))
        else:  # each log-ratio over its completion token count, at least 1
            d = (pc - rc) / max(nc, 1) - (pr - rr) / max(nr, 1)
            out.append((d - 1 / (2 * BETA)) ** 2)
    return out


def _dpo_grad_by_hand(kind: str, eps: float = 0.0) -> tuple[list[float], list[float]]:
    """d loss_i / d pi_chosen_i and d loss_i / d pi_rejected_i."""
    gc, gr = [], []
    for pc, pr, rc, rr, nc, nr in zip(PI_C, PI_R, REF_C, REF_R, LEN_C, LEN_R, strict=True):
        h = (pc - rc) - (pr - rr)
        if kind == "sigmoid":
            g = -BETA * _sigmoid(-BETA * h)
        elif kind == "robust":  # d/dh of -(1-e) ls(bh) + e ls(-bh), over (1 - 2e)
            g = (-(1 - eps) * BETA * _sigmoid(-BETA * h) - eps * BETA * _sigmoid(BETA * h)) / (1 - 2 * eps)
        elif kind == "hinge":
            g = -BETA if 1 - BETA * h > 0 else 0.0
        else:
            d = (pc - rc) / max(nc, 1) - (pr - rr) / max(nr, 1)
            gc.append(2 * (d - 1 / (2 * BETA)) / max(nc, 1))
            gr.append(-2 * (d - 1 / (2 * BETA)) / max(nr, 1))
            continue
        gc.append(g)
        gr.append(-g)
    return gc, gr


@pytest.mark.parametrize("kind, eps", [("sigmoid", 0.0), ("robust", 0.0), ("robust", 0.1), ("hinge", 0.0),
                                       ("ipo", 0.0)])
def test_dpo_losses_rewards_and_gradients_by_hand(kind, eps):
    pi_c, pi_r = t(PI_C).requires_grad_(True), t(PI_R).requires_grad_(True)
    lengths = {"chosen_lengths": torch.tensor(LEN_C), "rejected_lengths": torch.tensor(LEN_R)} if kind == "ipo" else {}
    out = dpo_losses(pi_c, pi_r, t(REF_C), t(REF_R), beta=BETA, loss=DPOLoss(kind), label_smoothing=eps, **lengths)
    assert out.losses.tolist() == pytest.approx(_dpo_by_hand(kind, eps), abs=1e-12)
    # the implicit rewards come from the summed log-ratios for every loss, IPO included (TRL's metrics)
    chosen = [BETA * (p - r) for p, r in zip(PI_C, REF_C, strict=True)]  # 0.25, -0.5, -0.25
    rejected = [BETA * (p - r) for p, r in zip(PI_R, REF_R, strict=True)]  # -0.25, 0.25, 0.25
    assert out.chosen_rewards.tolist() == pytest.approx(chosen, abs=1e-15)
    assert out.rejected_rewards.tolist() == pytest.approx(rejected, abs=1e-15)
    m = out.metrics(pi_c, pi_r)
    assert m.pop("rewards/accuracies") == pytest.approx(1 / 3, abs=1e-7)  # in float32, as TRL's `.float()`
    assert m == pytest.approx({
        "loss": sum(_dpo_by_hand(kind, eps)) / 3, "rewards/chosen": sum(chosen) / 3,
        "rewards/rejected": sum(rejected) / 3,
        "rewards/margins": sum(c - r for c, r in zip(chosen, rejected, strict=True)) / 3,
        "logps/chosen": sum(PI_C) / 3, "logps/rejected": sum(PI_R) / 3}, abs=1e-12)
    out.losses.mean().backward()  # TRL's loss: the mean over the pairs
    gc, gr = _dpo_grad_by_hand(kind, eps)
    assert pi_c.grad.tolist() == pytest.approx([g / 3 for g in gc], abs=1e-12)
    assert pi_r.grad.tolist() == pytest.approx([g / 3 for g in gr], abs=1e-12)


def test_ipo_clamps_an_empty_completion_to_one_token_and_the_policy_at_the_reference_is_ln2_for_sigmoid():
    z = torch.zeros(3, dtype=torch.float64)
    ipo = dpo_losses(z, z, z, z, beta=BETA, loss=DPOLoss.IPO, chosen_lengths=torch.tensor([0, 1, 2]),
                     rejected_lengths=torch.tensor([3, 0, 1]))
    assert ipo.losses.tolist() == pytest.approx([(1 / (2 * BETA)) ** 2] * 3, abs=1e-15)
    x = t([-3.0, -7.5])
    at_reference = dpo_losses(x, x - 1, x.clone(), x - 1, beta=0.1)
    assert at_reference.losses.tolist() == pytest.approx([math.log(2)] * 2, abs=1e-15)


def test_dpo_options_are_refused_where_trl_has_no_such_thing():
    x = torch.zeros(1)
    with pytest.raises(ValueError, match="robust loss only .*sigmoid"):
        dpo_losses(x, x, x, x, loss=DPOLoss.SIGMOID, label_smoothing=0.1)  # TRL 1.16 ignores it: no cDPO
    with pytest.raises(ValueError, match="robust loss only .*hinge"):
        dpo_losses(x, x, x, x, loss=DPOLoss.HINGE, label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"must be in \[0, 0.5\)"):
        dpo_losses(x, x, x, x, loss=DPOLoss.ROBUST, label_smoothing=0.5)
    with pytest.raises(ValueError, match="required by the ipo loss"):
        dpo_losses(x, x, x, x, loss=DPOLoss.IPO)
    with pytest.raises(ValueError, match="required by the ipo loss and by no other; loss sigmoid"):
        dpo_losses(x, x, x, x, chosen_lengths=torch.ones(1), rejected_lengths=torch.ones(1))


# ------------------------------------------------------------------------------------------------------------- KTO

# Per-token log-probs of ragged completions (policy, reference), summed by hand below; label True = desirable.
KTO_ROWS = [  # (policy tokens, reference tokens, label)
    ([-0.5, -1.25], [-0.75, -1.0], True),
    ([-2.0, -0.5, -0.25, -1.0], [-1.5, -0.5, -0.5, -1.5], False),
    ([-0.125], [-0.625], True),
    ([-1.0, -1.0, -3.0], [-1.25, -0.5, -2.0], False),
    ([-0.75, -0.25, -0.5, -1.5, -2.0], [-1.0, -0.5, -0.5, -1.0, -1.0], True),
]
# The KL pairs' summed log-probs (prompt i with completion i-1), policy and reference.
KL_PI, KL_REF = [-4.5, -1.25, -3.0, -2.0, -6.0], [-4.0, -1.5, -2.25, -2.5, -5.0]
KTO_BETA, W_D, W_U = 0.25, 1.5, 0.75


def _kto_by_hand(rows, kl: float) -> tuple[list[float], dict[str, float]]:
    """TRL 1.16 kto_trainer.py: chosen 1 - sigmoid(beta (l - kl)), rejected 1 - sigmoid(beta (kl - l)), weighted;
    the loss is the mean over all rows; the metrics class means."""
    terms, sums = [], {"rc": 0.0, "lc": 0.0, "nc": 0, "rr": 0.0, "lr": 0.0, "nr": 0}
    for pi_tok, ref_tok, label in rows:
        pi, ref = math.fsum(pi_tok), math.fsum(ref_tok)
        lr = pi - ref
        if label:
            terms.append(W_D * (1 - _sigmoid(KTO_BETA * (lr - kl))))
            sums["rc"] += KTO_BETA * lr
            sums["lc"] += pi
            sums["nc"] += 1
        else:
            terms.append(W_U * (1 - _sigmoid(KTO_BETA * (kl - lr))))
            sums["rr"] += KTO_BETA * lr
            sums["lr"] += pi
            sums["nr"] += 1
    metrics = {"kl": kl, "loss": math.fsum(terms) / len(rows)}
    if sums["nc"]:
        metrics |= {"rewards/chosen": sums["rc"] / sums["nc"], "logps/chosen": sums["lc"] / sums["nc"]}
    if sums["nr"]:
        metrics |= {"rewards/rejected": sums["rr"] / sums["nr"], "logps/rejected": sums["lr"] / sums["nr"]}
    if sums["nc"] and sums["nr"]:
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return terms, metrics


def _kto_inputs(rows):
    logps = t([math.fsum(p) for p, _, _ in rows]).requires_grad_(True)
    ref = t([math.fsum(r) for _, r, _ in rows])
    return logps, ref, torch.tensor([label for _, _, label in rows])


def _trl_kto_transcribed(logps, ref_logps, labels, kl):
    """kto_trainer.py 1409-1482, 1548 transcribed (index_select per class, concatenated, nanmean)."""
    chosen_idx = torch.nonzero(labels, as_tuple=False).view(-1)
    rejected_idx = torch.nonzero(~labels, as_tuple=False).view(-1)
    chosen_losses = 1 - F.sigmoid(KTO_BETA * ((logps.index_select(0, chosen_idx)
                                               - ref_logps.index_select(0, chosen_idx)) - kl))
    rejected_losses = 1 - F.sigmoid(KTO_BETA * (kl - (logps.index_select(0, rejected_idx)
                                                      - ref_logps.index_select(0, rejected_idx))))
    return torch.cat((W_D * chosen_losses, W_U * rejected_losses), 0).nanmean()


def test_kto_kl_is_the_clamped_mean_and_averages_per_process_means():
    # mean of (pi - ref) = (-0.5 + 0.25 - 0.75 + 0.5 - 1.0) / 5 = -0.3: clamped to 0
    assert kto_kl(t(KL_PI), t(KL_REF)).item() == 0.0
    shifted = t([p + 1.0 for p in KL_PI])  # mean 0.7
    assert kto_kl(shifted, t(KL_REF)).item() == pytest.approx(0.7, abs=1e-15)
    assert not kto_kl(shifted.requires_grad_(True), t(KL_REF)).requires_grad
    # two processes of 2 and 3 rows (shifted by +2 to stay positive): the mean of their means, then the clamp
    a = [p - r for p, r in zip(KL_PI, KL_REF, strict=True)]  # -0.5, 0.25, -0.75, 0.5, -1.0
    by_process = ((a[0] + a[1]) / 2 + 2.0 + (a[2] + a[3] + a[4]) / 3 + 2.0) / 2
    got = kto_kl([t(KL_PI[:2]) + 2.0, t(KL_PI[2:]) + 2.0], [t(KL_REF[:2]), t(KL_REF[2:])])
    assert got.item() == pytest.approx(by_process, abs=1e-14)
    assert by_process != pytest.approx(sum(a) / 5 + 2.0)  # not the mean over rows when the processes differ


@pytest.mark.parametrize("kl", [0.0, 0.7])
def test_kto_loss_metrics_and_gradient_by_hand(kl):
    logps, ref, labels = _kto_inputs(KTO_ROWS)
    out = kto_losses(logps, ref, labels, torch.tensor(kl, dtype=torch.float64), beta=KTO_BETA,
                     desirable_weight=W_D, undesirable_weight=W_U)
    terms, metrics = _kto_by_hand(KTO_ROWS, kl)
    assert out.losses.tolist() == pytest.approx(terms, abs=1e-14)
    loss = out.losses.sum() / len(KTO_ROWS)
    assert loss.item() == pytest.approx(metrics.pop("loss"), abs=1e-14)
    assert kto_metrics(out.metric_sums(), kl) == pytest.approx(metrics, abs=1e-14)
    loss.backward()
    for i, (pi_tok, ref_tok, label) in enumerate(KTO_ROWS):  # d/dl of w (1 - sigmoid(+-beta (l - kl))), over N
        s = _sigmoid(KTO_BETA * (math.fsum(pi_tok) - math.fsum(ref_tok) - kl) * (1 if label else -1))
        want = (-W_D if label else W_U) * KTO_BETA * s * (1 - s) / len(KTO_ROWS)
        assert logps.grad[i].item() == pytest.approx(want, abs=1e-14)
    x = logps.detach().clone().requires_grad_(True)  # against a transcription of TRL's code
    _trl_kto_transcribed(x, ref, labels, torch.tensor(kl, dtype=torch.float64)).backward()
    assert torch.allclose(x.grad, logps.grad, rtol=0, atol=1e-15)


def test_kto_batch_without_undesirable_rows_and_micro_batch_sums():
    rows = [r for r in KTO_ROWS if r[2]]  # desirable only
    logps, ref, labels = _kto_inputs(rows)
    out = kto_losses(logps, ref, labels, 0.3, beta=KTO_BETA, desirable_weight=W_D, undesirable_weight=W_U)
    terms, metrics = _kto_by_hand(rows, 0.3)
    assert (out.losses.sum() / len(rows)).item() == pytest.approx(metrics.pop("loss"), abs=1e-14)
    got = kto_metrics(out.metric_sums(), 0.3)
    assert got == pytest.approx(metrics, abs=1e-14)
    assert set(got) == {"kl", "rewards/chosen", "logps/chosen"}  # TRL logs no rejected means and no margin
    only_rejected = kto_losses(t([-1.0]), t([-2.0]), torch.tensor([False]), 0.0, beta=KTO_BETA)
    assert set(kto_metrics(only_rejected.metric_sums(), 0.0)) == {"kl", "rewards/rejected", "logps/rejected"}

    # the whole batch as two micro-batches: summed terms over all rows, summed metric sums
    logps, ref, labels = _kto_inputs(KTO_ROWS)
    parts = [kto_losses(logps[s], ref[s], labels[s], 0.7, beta=KTO_BETA, desirable_weight=W_D,
                        undesirable_weight=W_U) for s in (slice(0, 2), slice(2, 5))]
    terms, metrics = _kto_by_hand(KTO_ROWS, 0.7)
    assert (sum(p.losses.sum() for p in parts) / len(KTO_ROWS)).item() == pytest.approx(metrics.pop("loss"),
                                                                                         abs=1e-14)
    assert kto_metrics(combine_metric_sums(p.metric_sums() for p in parts), 0.7) == pytest.approx(metrics, abs=1e-14)


# ---------------------------------------------------------------------------------------------------- reward model

R_C, R_R = [1.5, -0.25, 0.5, 2.0], [0.5, 0.75, 0.5, -1.0]  # pair 3 is a tie: not counted accurate
MARGIN = [0.25, 0.0, 1.0, 0.5]
CENTER = 0.01


@pytest.mark.parametrize("margin, center", [(False, None), (True, None), (True, CENTER), (False, CENTER)])
def test_reward_model_loss_gradient_and_metrics_by_hand(margin, center):
    rc, rr = t(R_C).requires_grad_(True), t(R_R).requires_grad_(True)
    out = reward_model_losses(rc, rr, margin=t(MARGIN) if margin else None, center_rewards_coefficient=center)
    n = len(R_C)
    ms = MARGIN if margin else [0.0] * n
    bt = [-_log_sigmoid(c - r - m) for c, r, m in zip(R_C, R_R, ms, strict=True)]
    sq = [(c + r) ** 2 for c, r in zip(R_C, R_R, strict=True)]
    trl_loss = math.fsum(bt) / n + (center * math.fsum(sq) / n if center is not None else 0.0)  # two means, added
    loss = out.losses.mean()
    assert loss.item() == pytest.approx(trl_loss, abs=1e-14)
    loss.backward()
    c = center or 0.0
    for i, (x, y, m) in enumerate(zip(R_C, R_R, ms, strict=True)):
        s = _sigmoid(-(x - y - m))  # d/dx of -log sigmoid(x - y - m) = -sigmoid(-(x - y - m))
        assert rc.grad[i].item() == pytest.approx((-s + 2 * c * (x + y)) / n, abs=1e-14)
        assert rr.grad[i].item() == pytest.approx((s + 2 * c * (x + y)) / n, abs=1e-14)
    both = R_C + R_R
    want = {"min_reward": min(both), "mean_reward": math.fsum(both) / (2 * n), "max_reward": max(both),
            "accuracy": 2 / 4, "margin": math.fsum(x - y for x, y in zip(R_C, R_R, strict=True)) / n}
    assert reward_model_metrics(out.metric_sums()) == pytest.approx(want, abs=1e-14)
    parts = [reward_model_losses(rc[s].detach(), rr[s].detach()) for s in (slice(0, 1), slice(1, 4))]
    assert reward_model_metrics(combine_metric_sums(p.metric_sums() for p in parts)) == pytest.approx(want, abs=1e-14)
