"""The composed objective (``megarl.algos.objective``) against float64 references written out here per token.

The references follow the formulas (PPO clip, token-level truncated IS, the entropy bonus, low_var_kl with
its clamps, token-mean aggregation over the global batch's counts, the top-entropy quantile, the reward
shaping of a score, a teacher and a KL penalty) with Python floats and ``math``, or 0-d float64 tensors where
a gradient is compared; they never call the ``algos`` functions being composed. Ragged rows, one fully
masked. CPU only, no process group.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl import algos
from megarl.algos.config import AlgorithmConfig
from megarl.algos.correction import ISLevel, RolloutCorrectionConfig
from megarl.algos.kl import KLEstimator
from megarl.algos.losses import PolicyLossConfig

MASK = [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
CLIP_LOW, CLIP_HIGH, CAP, ENT_COEF, KL_COEF = 0.2, 0.28, 2.0, 0.01, 0.1
CFG = AlgorithmConfig(policy_loss=PolicyLossConfig(clip_low=CLIP_LOW, clip_high=CLIP_HIGH), entropy_coef=ENT_COEF,
                      kl_loss_coef=KL_COEF, kl_estimator=KLEstimator.K3,
                      rollout_correction=RolloutCorrectionConfig(truncate=ISLevel.TOKEN, truncate_cap=CAP))


def _tensors() -> dict[str, torch.Tensor]:
    """One batch of ``MASK``'s shape (float64): log-probs a few tenths apart, so ratios leave the clip band and
    some rollout ratios exceed the cap."""
    g = torch.Generator().manual_seed(7)
    shape = (len(MASK), len(MASK[0]))
    lp = -0.2 - 2.0 * torch.rand(shape, generator=g, dtype=torch.float64)
    return {"log_probs": lp, "entropy": 0.1 + 2.0 * torch.rand(shape, generator=g, dtype=torch.float64),
            "advantages": torch.randn(shape, generator=g, dtype=torch.float64),
            "old_log_probs": lp + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64),
            "rollout_log_probs": lp + 0.6 * torch.randn(shape, generator=g, dtype=torch.float64),
            "ref_log_probs": lp + 0.4 * torch.randn(shape, generator=g, dtype=torch.float64),
            "mask": torch.tensor(MASK, dtype=torch.float64)}


def _counted() -> list[tuple[int, int]]:
    return [(i, t) for i, row in enumerate(MASK) for t, m in enumerate(row) if m]


def _normalizer(rows) -> algos.LossNormalizer:
    """The global batch's counts as the role has them (float64 tensors after the all-reduce)."""
    tokens = sum(sum(MASK[i]) for i in rows)
    seqs = sum(1 for i in rows if any(MASK[i]))
    return algos.LossNormalizer(torch.tensor(float(tokens), dtype=torch.float64),
                                torch.tensor(float(seqs), dtype=torch.float64))


def _objective(x: dict[str, torch.Tensor], rows, normalizer, cfg=CFG, *, on_policy=False, rollout=True):
    """``algos.policy_objective`` on the micro-batch of ``rows``; ``log_probs`` and ``entropy`` get gradients."""
    lp, ent = x["log_probs"][list(rows)].clone().requires_grad_(), x["entropy"][list(rows)].clone().requires_grad_()
    inputs = algos.ObjectiveInputs(lp, ent, x["advantages"][list(rows)], x["mask"][list(rows)],
                                   old_log_probs=None if on_policy else x["old_log_probs"][list(rows)],
                                   rollout_log_probs=x["rollout_log_probs"][list(rows)] if rollout else None,
                                   ref_log_probs=x["ref_log_probs"][list(rows)])
    out = algos.policy_objective(cfg, inputs, normalizer)
    out.loss.backward()
    return out, lp.grad, ent.grad


def _k3(lp, ref):
    """low_var_kl with verl's clamps: d = clamp(ref - lp, +-20), clamp(e^d - d - 1, +-10)."""
    d = min(max(ref - lp, -20.0), 20.0) if isinstance(lp, float) else torch.clamp(ref - lp, -20.0, 20.0)
    k = (math.exp(d) if isinstance(d, float) else torch.exp(d)) - d - 1.0
    return min(max(k, -10.0), 10.0) if isinstance(k, float) else torch.clamp(k, -10.0, 10.0)


def _reference(x, rows, *, on_policy=False, rollout=True, keep=None, lp_leaf=None, ent_leaf=None):
    """Loss (0-d tensor, differentiable in ``lp_leaf``/``ent_leaf`` if given) and metrics, token by token.

    ``keep``: the set of (row, token) the top-entropy mask keeps (None: all). Denominators: the counted tokens
    and sequences of ``rows`` and of nothing else (pass every row for the global batch).
    """
    f = {k: v.tolist() for k, v in x.items()}
    n_tok = sum(sum(MASK[i]) for i in rows)
    n_seq = sum(1 for i in rows if any(MASK[i]))
    lp_t = lp_leaf if lp_leaf is not None else x["log_probs"]
    ent_t = ent_leaf if ent_leaf is not None else x["entropy"]
    pg = bonus = kl_sum = torch.zeros((), dtype=torch.float64)
    m = dict.fromkeys(("clip", "trunc", "k1", "k3", "rho", "w", "ak1", "ak3", "ent", "kl"), 0.0)
    rhos, ppl = [], []
    for i in rows:
        counted = [t for t, c in enumerate(MASK[i]) if c]
        for t in counted:
            lp, old = lp_t[i, t], (f["log_probs"][i][t] if on_policy else f["old_log_probs"][i][t])
            a = f["advantages"][i][t]
            if rollout:
                log_rho = min(max(old - f["rollout_log_probs"][i][t], -20.0), 20.0)
                rho = math.exp(log_rho)
                w = min(rho, CAP)
                rhos.append(rho)
                m["k1"] += -log_rho
                m["k3"] += rho - 1.0 - log_rho
                m["rho"] += rho
                m["w"] += w
                m["trunc"] += rho > CAP
                a = a * w
            if keep is not None and (i, t) not in keep:
                a = 0.0
            log_r = torch.clamp(lp - old, -20.0, 20.0)
            r = torch.exp(log_r)
            unclipped, clipped = -a * r, -a * torch.clamp(r, 1.0 - CLIP_LOW, 1.0 + CLIP_HIGH)
            pg = pg + (clipped if clipped > unclipped else unclipped)
            m["clip"] += float(bool(clipped > unclipped))
            m["ak1"] += -float(log_r.detach())
            m["ak3"] += float(r.detach()) - 1.0 - float(log_r.detach())
            m["ent"] += f["entropy"][i][t]
            bonus = bonus + (ent_t[i, t] if keep is None or (i, t) in keep else 0.0)
            kl_sum = kl_sum + _k3(lp, f["ref_log_probs"][i][t])
            m["kl"] += _k3(f["log_probs"][i][t], f["ref_log_probs"][i][t])
        if rollout and counted:
            olds = f["log_probs"][i] if on_policy else f["old_log_probs"][i]
            ppl.append(math.exp(sum(-(olds[t] - f["rollout_log_probs"][i][t]) for t in counted) / len(counted)))
    loss = pg / n_tok - ENT_COEF * bonus / n_tok + KL_COEF * kl_sum / n_tok
    metrics = {"pg_loss": pg.item() / n_tok, "entropy": m["ent"] / n_tok, "clip_frac": m["clip"] / n_tok,
               "dual_clip_frac": 0.0, "approx_kl_k1": m["ak1"] / n_tok, "approx_kl_k3": m["ak3"] / n_tok,
               "kl_loss": kl_sum.item() / n_tok}
    if rollout:
        metrics |= {"mismatch/kl_k1": m["k1"] / n_tok, "mismatch/kl_k3": m["k3"] / n_tok,
                    "mismatch/ratio_mean": m["rho"] / n_tok, "mismatch/truncated_frac": m["trunc"] / n_tok,
                    "mismatch/masked_frac": 0.0, "mismatch/weight_mean": m["w"] / n_tok,
                    "mismatch/ppl_ratio": sum(ppl) / n_seq, "mismatch/ratio_max": max(rhos),
                    "mismatch/ratio_min": min(rhos)}
    if on_policy:
        metrics["kl"] = m["kl"] / n_tok
    if keep is not None:
        metrics["entropy_mask_frac"] = len(keep) / n_tok
    return loss, metrics, m


def _assert_metrics(got: dict[str, torch.Tensor], want: dict[str, float]) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    for k, v in want.items():
        assert float(got[k]) == pytest.approx(v, rel=1e-12, abs=1e-14), k


ALL = range(len(MASK))


def test_ppo_clip_with_tis_entropy_bonus_and_k3_kl_loss():
    """(a) Off-policy PPO clip, token-level TIS at cap 2, entropy bonus, low_var_kl loss, token-mean; loss,
    metrics and the gradients w.r.t. log-probs and entropies against autograd on the per-token reference."""
    x = _tensors()
    out, lp_grad, ent_grad = _objective(x, ALL, _normalizer(ALL))
    lp_leaf, ent_leaf = x["log_probs"].clone().requires_grad_(), x["entropy"].clone().requires_grad_()
    loss, metrics, counts = _reference(x, ALL, lp_leaf=lp_leaf, ent_leaf=ent_leaf)
    assert counts["trunc"] >= 1 and counts["clip"] >= 1  # the cap and the clip both act on this data
    assert out.loss.item() == pytest.approx(loss.item(), rel=1e-12)
    _assert_metrics(out.metrics, metrics)
    loss.backward()
    torch.testing.assert_close(lp_grad, lp_leaf.grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(ent_grad, ent_leaf.grad, rtol=1e-12, atol=1e-15)
    assert lp_grad[2].abs().sum() == 0 and lp_grad[0, 4] == 0  # uncounted tokens get no gradient
    # negative control: without the correction the loss is another number (the weights are not all 1 here)
    plain = _objective(x, ALL, _normalizer(ALL), AlgorithmConfig(
        policy_loss=CFG.policy_loss, entropy_coef=ENT_COEF, kl_loss_coef=KL_COEF,
        rollout_correction=RolloutCorrectionConfig(truncate=None)))[0]
    assert abs(plain.loss.item() - loss.item()) > 1e-6
    assert plain.loss.item() == pytest.approx(_reference(x, ALL, rollout=False)[0].item(), rel=1e-12)


def _quantile_keep(x, q: float) -> set[tuple[int, int]]:
    """The counted tokens at or above the (1 - q) quantile, linear interpolation between order statistics."""
    values = sorted(x["entropy"][i, t].item() for i, t in _counted())
    pos = (1.0 - q) * (len(values) - 1)
    lo = math.floor(pos)
    threshold = values[lo] + (pos - lo) * (values[min(lo + 1, len(values) - 1)] - values[lo])
    return {(i, t) for i, t in _counted() if x["entropy"][i, t].item() >= threshold}


def test_top_entropy_mask_zeroes_advantages_but_keeps_denominators():
    """(b) top_entropy_quantile 0.45 over 11 counted tokens: the 5 highest-entropy tokens train; the others'
    advantage is 0, yet every counted token stays in the denominators, the entropy metric and the KL term,
    and the bonus counts only the kept tokens' entropy. On policy (ratio 1), so ``kl`` is reported too."""
    x = _tensors()
    cfg = AlgorithmConfig(policy_loss=CFG.policy_loss, entropy_coef=ENT_COEF, kl_loss_coef=KL_COEF,
                          kl_estimator=KLEstimator.K3, top_entropy_quantile=0.45,
                          rollout_correction=RolloutCorrectionConfig(truncate=None))
    keep = _quantile_keep(x, 0.45)
    assert len(keep) == 5
    out, lp_grad, ent_grad = _objective(x, ALL, _normalizer(ALL), cfg, on_policy=True, rollout=False)
    loss, metrics, _ = _reference(x, ALL, on_policy=True, rollout=False, keep=keep)
    assert out.loss.item() == pytest.approx(loss.item(), rel=1e-12)
    _assert_metrics(out.metrics, metrics)
    # the bonus's gradient reaches exactly the kept tokens' entropies: -coef / N_tok each
    want = torch.zeros_like(ent_grad)
    for i, t in keep:
        want[i, t] = -ENT_COEF / 11
    torch.testing.assert_close(ent_grad, want, rtol=1e-12, atol=1e-15)
    # negative control: keeping every token is another loss
    assert abs(loss.item() - _reference(x, ALL, on_policy=True, rollout=False)[0].item()) > 1e-6


@pytest.mark.parametrize("on_policy", [False, True], ids=["recomputed-old", "update-stands-in"])
def test_two_micro_batches_add_up_to_the_global_means(on_policy):
    """(c) Rows {0, 3} and {1, 2} as two micro-batches with the global normalizer: summed, the loss and every
    metric are the whole batch's (token means over 11 tokens, the perplexity ratio over 3 sequences); the
    ratio extremes reduce by max / min. Off policy the clip and ratio diagnostics are non-zero; on policy
    (the update's forward stands in for the old log-probs) ``kl`` is reported as well."""
    x = _tensors()
    norm = _normalizer(ALL)
    parts = [_objective(x, rows, norm, on_policy=on_policy)[0] for rows in ((0, 3), (1, 2))]
    loss, want, counts = _reference(x, ALL, on_policy=on_policy)
    assert on_policy or counts["clip"] >= 1
    assert sum(p.loss.item() for p in parts) == pytest.approx(loss.item(), rel=1e-12)
    extremes = {"mismatch/ratio_max": max, "mismatch/ratio_min": min}
    got = {k: extremes.get(k, sum)(float(p.metrics[k]) for p in parts) for k in parts[0].metrics}
    _assert_metrics(got, want)
    # negative control: each micro-batch normalised by its own counts, then averaged, is not the global mean
    own = [_objective(x, rows, _normalizer(rows), on_policy=on_policy)[0] for rows in ((0, 3), (1, 2))]
    assert abs(sum(float(p.metrics["mismatch/kl_k1"]) for p in own) / 2 - want["mismatch/kl_k1"]) > 1e-6


def test_kl_loss_without_reference_log_probs_says_what_to_pass():
    x = _tensors()
    inputs = algos.ObjectiveInputs(x["log_probs"], x["entropy"], x["advantages"], x["mask"])
    with pytest.raises(ValueError, match=r"kl_loss_coef=0.1 needs the reference's log-probs.*pass ref_log_probs"):
        algos.policy_objective(CFG, inputs, _normalizer(ALL))


# ------------------------------------------------------------------------------------------ token rewards

# row 1 has a hole (observation tokens of a multi-turn conversation): its score goes on token 4, not 1
REWARD_MASK = [[1, 1, 1, 0, 0], [1, 1, 0, 0, 1], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
SCORES = [1.0, -0.5, 2.0, 0.25]


@pytest.mark.parametrize("estimator", [KLEstimator.K1, KLEstimator.K3])
def test_token_rewards_with_teacher_and_kl_penalty(estimator):
    """(d) Score on each row's last counted token, + 0.5 (teacher - student) on every counted token, - 0.05 kl
    on every counted token, 0 elsewhere; ``reward_kl`` is the mean over rows with a token of each row's
    token-mean KL (the empty row 2 is left out, its score is dropped)."""
    g = torch.Generator().manual_seed(3)
    teacher, student, old, ref = (-0.3 - 1.5 * torch.rand(4, 5, generator=g, dtype=torch.float64) for _ in range(4))
    mask = torch.tensor(REWARD_MASK, dtype=torch.float64)
    out = algos.token_rewards(torch.tensor(SCORES, dtype=torch.float64), mask,
                              teacher=algos.TeacherKL(0.5, teacher, student),
                              kl_penalty=algos.RewardKLPenalty(0.05, old, ref, estimator))
    kl_of = (lambda o, r: o - r) if estimator is KLEstimator.K1 else _k3
    want, per_row = [[0.0] * 5 for _ in range(4)], []
    for i, row in enumerate(REWARD_MASK):
        counted = [t for t, c in enumerate(row) if c]
        for t in counted:
            kl = kl_of(old[i, t].item(), ref[i, t].item())
            want[i][t] = (SCORES[i] if t == counted[-1] else 0.0) + 0.5 * (teacher[i, t].item() - student[i, t].item())
            want[i][t] -= 0.05 * kl
        if counted:
            per_row.append(sum(kl_of(old[i, t].item(), ref[i, t].item()) for t in counted) / len(counted))
    torch.testing.assert_close(out.rewards, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    mean_kl = sum(per_row) / 3
    assert float(out.mean_kl) == pytest.approx(mean_kl, rel=1e-12)
    assert out.metrics == {"kl_coef": 0.05, "reward_kl": pytest.approx(mean_kl, rel=1e-12)}


def test_token_rewards_score_only():
    """No teacher, no penalty: the scores alone, on each row's last counted token; no controller input."""
    mask = torch.tensor(REWARD_MASK, dtype=torch.float32)
    out = algos.token_rewards(torch.tensor(SCORES), mask)
    want = torch.zeros(4, 5)
    want[0, 2], want[1, 4], want[3, 4] = SCORES[0], SCORES[1], SCORES[3]
    assert torch.equal(out.rewards, want) and out.mean_kl is None and out.metrics == {}
