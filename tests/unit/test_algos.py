"""megarl.algos against independent references: float64 Python loops per sequence and hand-worked examples.

Every reference here is written from the formula with plain Python floats (``math``, ``statistics``),
never by calling the code under test. Masks are ragged (different lengths, a hole inside a response,
an empty row) and padding holds NaN or large garbage, so any leak through a mask shows up.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from megarl.algos import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    AdvantageConfig,
    AdvantageInputs,
    FixedKLController,
    KLControllerConfig,
    KLControllerType,
    KLEstimator,
    LossAggregation,
    LossNormalizer,
    PolicyLossConfig,
    RewardScale,
    aggregate_entropy,
    aggregate_loss,
    apply_kl_penalty,
    build_kl_controller,
    compute_advantages,
    compute_policy_loss,
    entropy_from_logits,
    gae,
    grpo,
    gspo_loss,
    kl_divergence,
    kl_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    ppo_clip_loss,
    reinforce_plus_plus,
    remax,
    rloo,
    value_loss,
)
from megarl.algos.plugins import ESTIMATOR, POLICY_LOSS, registered
from megarl.config import from_dict
from megarl.errors import ConfigError

# Rows: full, right-padded, length 1, a hole in the middle (masked tool output), empty.
MASK_ROWS = [
    [1, 1, 1, 1, 1, 1],
    [1, 1, 1, 0, 0, 0],
    [1, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 1, 1],
    [0, 0, 0, 0, 0, 0],
]
B, T = len(MASK_ROWS), len(MASK_ROWS[0])
MODES = list(LossAggregation)


def _mask(dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.tensor(MASK_ROWS, dtype=dtype)


def _rand(seed: int, scale: float = 1.0, shape: tuple[int, ...] = (B, T), poison: bool = True) -> torch.Tensor:
    """Random float64 values; masked positions get NaN (``poison``) so a leak through the mask is visible."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * scale
    if poison and shape == (B, T):
        x = torch.where(_mask() != 0, x, torch.full_like(x, float("nan")))
    return x


def _valid(row: int) -> list[int]:
    return [t for t in range(T) if MASK_ROWS[row][t]]


def _close(actual: torch.Tensor, expected: list[list[float]] | list[float] | float, tol: float = 1e-10) -> None:
    exp = torch.tensor(expected, dtype=torch.float64)
    got = actual.detach().double()
    assert got.shape == exp.shape, (got.shape, exp.shape)
    # (torch.testing.assert_close costs seconds of lazy imports on first use; this check is the same.)
    assert torch.isfinite(got).all() and ((got - exp).abs() <= tol * (1 + exp.abs())).all(), f"{got}\n!=\n{exp}"


# --------------------------------------------------------------------------------------------- references


def ref_aggregate(loss: list[list[float]], mode: LossAggregation, norm_constant: float | None = None) -> float:
    """Aggregate the counted per-token losses (lists per sequence, padding already dropped)."""
    seqs = [row for row in loss if row]
    if mode is LossAggregation.TOKEN_MEAN:
        return sum(sum(r) for r in seqs) / sum(len(r) for r in seqs)
    if mode is LossAggregation.SEQ_MEAN_TOKEN_SUM:
        return sum(sum(r) for r in seqs) / len(seqs)
    if mode is LossAggregation.SEQ_MEAN_TOKEN_MEAN:
        return sum(sum(r) / len(r) for r in seqs) / len(seqs)
    return sum(sum(r) for r in seqs) / (len(seqs) * norm_constant)


def ref_gae(r: torch.Tensor, v: torch.Tensor, gamma: float, lam: float) -> tuple[list, list]:
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for i in range(B):
        next_v, next_a = 0.0, 0.0
        for t in reversed(_valid(i)):
            delta = float(r[i, t]) + gamma * next_v - float(v[i, t])
            a = delta + gamma * lam * next_a
            adv[i][t], ret[i][t] = a, a + float(v[i, t])
            next_v, next_a = float(v[i, t]), a
    return adv, ret


def ref_discounted(r: torch.Tensor, gamma: float) -> list[list[float]]:
    out = [[0.0] * T for _ in range(B)]
    for i in range(B):
        g = 0.0
        for t in reversed(_valid(i)):
            g = float(r[i, t]) + gamma * g
            out[i][t] = g
    return out


def ref_whiten(x: list[list[float]]) -> list[list[float]]:
    vals = [x[i][t] for i in range(B) for t in _valid(i)]
    mu, sd = statistics.mean(vals), statistics.stdev(vals)
    return [[(x[i][t] - mu) / math.sqrt(sd**2 + 1e-8) if MASK_ROWS[i][t] else 0.0 for t in range(T)] for i in range(B)]


def _broadcast_ref(per_seq: list[float]) -> list[list[float]]:
    return [[per_seq[i] if MASK_ROWS[i][t] else 0.0 for t in range(T)] for i in range(B)]


# --------------------------------------------------------------------------------------------- ops


def test_masked_reductions_match_python_statistics():
    x = _rand(0)
    vals = [float(x[i, t]) for i in range(B) for t in _valid(i)]
    _close(masked_sum(x, _mask()), math.fsum(vals))
    _close(masked_mean(x, _mask().bool()), statistics.mean(vals))
    _close(masked_var(x, _mask()), statistics.variance(vals))
    _close(masked_var(x, _mask(), unbiased=False), statistics.pvariance(vals))
    row_means = [statistics.mean([float(x[i, t]) for t in _valid(i)]) if _valid(i) else 0.0 for i in range(B)]
    _close(masked_mean(x, _mask(), dim=-1), row_means)
    row_vars = [
        statistics.variance([float(x[i, t]) for t in _valid(i)]) if len(_valid(i)) > 1 else 0.0 for i in range(B)
    ]
    _close(masked_var(x, _mask(), dim=-1), row_vars)
    grid = [[float(x[i, t]) if MASK_ROWS[i][t] else 0.0 for t in range(T)] for i in range(B)]
    _close(masked_whiten(x, _mask()), ref_whiten(grid))
    mu = statistics.mean(vals)
    shifted_back = [
        [w + mu if MASK_ROWS[i][t] else 0.0 for t, w in enumerate(row)] for i, row in enumerate(ref_whiten(grid))
    ]
    _close(masked_whiten(x, _mask(), shift_mean=False), shifted_back)
    # An empty selection is 0, not NaN.
    _close(masked_mean(x, torch.zeros(B, T)), 0.0)


def test_aggregation_hand_worked():
    # loss [[1,2,3],[4,-,-]]: token-mean 10/4; seq-mean-token-sum (6+4)/2; seq-mean-token-mean (2+4)/2;
    # seq-mean-token-sum-norm with C=4: 10/(2*4).
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 99.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    expected = {
        "token-mean": 2.5,
        "seq-mean-token-sum": 5.0,
        "seq-mean-token-mean": 3.0,
        "seq-mean-token-sum-norm": 1.25,
    }
    for mode in MODES:
        _close(aggregate_loss(loss, mask, mode, norm_constant=4.0), expected[mode.value])
    _close(aggregate_loss(loss, mask, "token-mean"), 2.5)  # the exact config value is accepted


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_aggregation_modes_and_micro_batch_sum_equals_global(mode):
    g = torch.Generator().manual_seed(1)
    lengths = [7, 2, 0, 5, 1, 3, 6]  # row 2 is empty: it must not count as a sequence
    width = max(lengths)
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    loss = torch.randn(len(lengths), width, generator=g, dtype=torch.float64)
    lists = [[float(loss[i, t]) for t in range(n)] for i, n in enumerate(lengths)]
    full = aggregate_loss(loss, mask, mode, norm_constant=8.0)
    _close(full, ref_aggregate(lists, mode, 8.0))
    # Split rows unevenly; each micro-batch is cut to its own padded width, as a packer would.
    parts = [(0, 2), (2, 4), (4, 7)]
    micro = [(loss[a:b, : max(lengths[a:b])], mask[a:b, : max(lengths[a:b])]) for a, b in parts]
    norm = sum((LossNormalizer.of(m) for _, m in micro), LossNormalizer.zero())
    assert float(norm.token_count) == sum(lengths) and float(norm.seq_count) == 6
    total = sum(aggregate_loss(x, m, mode, norm, norm_constant=8.0) for x, m in micro)
    _close(total, float(full))
    # The same counts survive the trip through one all-reduce tensor.
    again = LossNormalizer.from_tensor(norm.as_tensor())
    _close(sum(aggregate_loss(x, m, mode, again, norm_constant=8.0) for x, m in micro), float(full))
    if mode is not LossAggregation.SEQ_MEAN_TOKEN_SUM:  # local denominators do not add up to the global loss
        local = sum(aggregate_loss(x, m, mode, norm_constant=8.0) for x, m in micro)
        assert abs(float(local) - float(full)) > 1e-3


def test_sum_norm_requires_an_explicit_constant():
    with pytest.raises(ConfigError, match="constant normaliser"):
        aggregate_loss(torch.ones(2, 3), torch.ones(2, 3), LossAggregation.SEQ_MEAN_TOKEN_SUM_NORM)


# --------------------------------------------------------------------------------------------- advantages


def test_gae_skips_padding_and_holes():
    r, v = _rand(2), _rand(3)
    for gamma, lam in [(1.0, 1.0), (0.9, 0.8), (0.99, 0.0)]:
        adv, ret = gae(r, v, _mask(), gamma, lam)
        ref_adv, ref_ret = ref_gae(r, v, gamma, lam)
        _close(adv, ref_adv)
        _close(ret, ref_ret)


def test_gae_hand_worked():
    # One row [r=0, -, r=1] (middle masked), V=[0.5, 9, 0.2], gamma=0.5, lam=0.5:
    # t=2: delta = 1 - 0.2 = 0.8, A=0.8;  t=0 (next counted is t=2): delta = 0 + 0.5*0.2 - 0.5 = -0.4,
    # A = -0.4 + 0.25*0.8 = -0.2; returns A+V = [0.3, 0, 1.0].
    r = torch.tensor([[0.0, 5.0, 1.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 9.0, 0.2]], dtype=torch.float64)
    adv, ret = gae(r, v, torch.tensor([[1, 0, 1]]), 0.5, 0.5)
    _close(adv, [[-0.2, 0.0, 0.8]])
    _close(ret, [[0.3, 0.0, 1.0]])


def test_gae_registry_entry_whitens_advantages_keeps_raw_returns():
    r, v = _rand(4), _rand(5)
    out = compute_advantages(AdvantageConfig(gamma=0.95, lam=0.9), AdvantageInputs(r, _mask(), values=v))
    ref_adv, ref_ret = ref_gae(r, v, 0.95, 0.9)
    _close(out.advantages, ref_whiten(ref_adv))
    _close(out.returns, ref_ret)


GROUP_IDS = [7, 3, 7, 3, 9]  # two groups of two and a singleton; not contiguous, not 0-based


def _scores_ref(r: torch.Tensor) -> list[float]:
    return [math.fsum(float(r[i, t]) for t in _valid(i)) for i in range(B)]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_against_per_group_statistics(scale):
    r = _rand(6)
    # Put a larger group in: duplicate the batch so group 7 and 3 have four members each, 9 two.
    r2 = torch.cat([r, _rand(7)])
    ids = torch.tensor(GROUP_IDS * 2)
    mask2 = torch.cat([_mask(), _mask()])
    scores = [math.fsum(float(r2[i, t]) for t in range(T) if mask2[i, t]) for i in range(2 * B)]
    groups: dict[int, list[float]] = {}
    for gid, s in zip(ids.tolist(), scores, strict=True):
        groups.setdefault(gid, []).append(s)
    expected = []
    for gid, s in zip(ids.tolist(), scores, strict=True):
        diff = s - statistics.mean(groups[gid])
        std = {"group": statistics.stdev(groups[gid]), "batch": statistics.stdev(scores), "none": None}[scale]
        expected.append(diff if std is None else diff / (std + 1e-6))
    cfg = AdvantageConfig(estimator="grpo", scale_rewards=RewardScale(scale))
    out = compute_advantages(cfg, AdvantageInputs(r2, mask2, group_ids=ids))
    exp_grid = [[expected[i] if mask2[i, t] else 0.0 for t in range(T)] for i in range(2 * B)]
    _close(out.advantages, exp_grid)
    _close(out.returns, [[scores[i] if mask2[i, t] else 0.0 for t in range(T)] for i in range(2 * B)])


def test_grpo_hand_worked_and_singleton_group():
    # Group 0 scores [1, 0, 0, 1]: mean 0.5, sample std sqrt(1/3); A = +-0.5 / (sqrt(1/3) + 1e-6) ~ +-0.8660239.
    # Group 5 has one response: no relative signal, A = 0.
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 4.0], dtype=torch.float64)
    mask = torch.ones(5, 2)
    adv, _ = grpo(scores, torch.tensor([0, 0, 0, 0, 5]), mask, RewardScale.GROUP, eps=1e-6)
    a = 0.5 / (math.sqrt(1.0 / 3.0) + 1e-6)
    _close(adv[:, 0], [a, -a, -a, a, 0.0])
    assert abs(a - 0.8660239) < 1e-6


def test_rloo_leave_one_out():
    r = _rand(8)
    ids = torch.tensor(GROUP_IDS)
    scores = _scores_ref(r)
    expected = []
    for i in range(B):
        others = [scores[j] for j in range(B) if GROUP_IDS[j] == GROUP_IDS[i] and j != i]
        expected.append(scores[i] - statistics.mean(others) if others else 0.0)
    out = compute_advantages(AdvantageConfig("rloo"), AdvantageInputs(r, _mask(), group_ids=ids))
    _close(out.advantages, _broadcast_ref(expected))
    # Hand-worked: group scores [1, 2, 6]: baselines (2+6)/2=4, (1+6)/2=3.5, (1+2)/2=1.5 -> A = [-3, -1.5, 4.5].
    adv, _ = rloo(torch.tensor([1.0, 2.0, 6.0]), torch.tensor([4, 4, 4]), torch.ones(3, 1))
    _close(adv[:, 0], [-3.0, -1.5, 4.5])


def test_reinforce_plus_plus_discounted_and_whitened():
    r = _rand(9)
    for gamma in (1.0, 0.9):
        out = compute_advantages(
            AdvantageConfig("reinforce_plus_plus", gamma=gamma), AdvantageInputs(r, _mask())
        )
        ref_ret = ref_discounted(r, gamma)
        _close(out.returns, ref_ret)
        _close(out.advantages, ref_whiten(ref_ret))
    # Hand-worked returns, r = [1, -, 2, 4] (hole at 1), gamma 0.5: G3 = 4, G2 = 2 + 0.5*4 = 4, G0 = 1 + 0.5*4 = 3.
    _, ret = reinforce_plus_plus(torch.tensor([[1.0, 7.0, 2.0, 4.0]]), torch.tensor([[1, 0, 1, 1]]), 0.5)
    _close(ret, [[3.0, 0.0, 4.0, 4.0]])


def test_remax_reward_minus_greedy_baseline():
    r = _rand(10)
    base = torch.tensor([0.5, -1.0, 2.0, 0.0, 3.0], dtype=torch.float64)
    out = compute_advantages(
        AdvantageConfig("remax"), AdvantageInputs(r, _mask(), baseline_rewards=base)
    )
    ref_ret = ref_discounted(r, 1.0)
    _close(out.returns, ref_ret)
    _close(
        out.advantages,
        [[ref_ret[i][t] - float(base[i]) if MASK_ROWS[i][t] else 0.0 for t in range(T)] for i in range(B)],
    )
    # Outcome reward 1 on the last token, greedy got 0.25: every counted token has A = 0.75.
    adv, _ = remax(torch.tensor([[0.0, 0.0, 1.0, 0.0]]), torch.tensor([0.25]), torch.tensor([[1, 1, 1, 0]]))
    _close(adv, [[0.75, 0.75, 0.75, 0.0]])


def test_advantage_inputs_missing_and_registry_complete():
    assert registered(ESTIMATOR) == ["gae", "grpo", "reinforce_plus_plus", "remax", "rloo"]
    inputs = AdvantageInputs(_rand(11), _mask())
    with pytest.raises(ConfigError, match=r"'grpo' needs inputs.group_ids"):
        compute_advantages(AdvantageConfig("grpo"), inputs)
    with pytest.raises(ConfigError, match=r"'gae' needs inputs.values"):
        compute_advantages(AdvantageConfig(), inputs)
    with pytest.raises(ConfigError, match="gamma must lie in"):
        AdvantageConfig(gamma=1.5)
    assert from_dict(AdvantageConfig, {"estimator": "rloo", "gamma": 0.9}).estimator == "rloo"


# --------------------------------------------------------------------------------------------- policy / value loss


def ref_ppo(lp, old, adv, low, high, c) -> tuple[list[list[float]], float, float]:
    per_seq, clipped, dual, n = [], 0, 0, 0
    for i in range(B):
        row = []
        for t in _valid(i):
            ratio, a = math.exp(float(lp[i, t]) - float(old[i, t])), float(adv[i, t])
            l1, l2 = -a * ratio, -a * min(max(ratio, 1 - low), 1 + high)
            loss = max(l1, l2)
            clipped += l2 > l1
            if c is not None and a < 0:
                dual += loss > -a * c
                loss = min(loss, -a * c)
            row.append(loss)
            n += 1
        per_seq.append(row)
    return per_seq, clipped / n, dual / n


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
@pytest.mark.parametrize("clip_ratio_c", [None, 3.0])
def test_ppo_clip_loss_against_token_loop(mode, clip_ratio_c):
    old = _rand(12, 0.5)
    lp = (old + _rand(13, 0.6)).requires_grad_()  # ratios spread around 1: both PPO clip branches are hit
    lp.data[3, 4], lp.data[0, 2] = old[3, 4] + 1.5, old[0, 2] - 1.5  # ratio e^1.5 ~ 4.5 > c, and e^-1.5
    adv = _rand(14, 2.0)
    adv[3, 4], adv[0, 2] = -1.0, -1.0  # A < 0 with ratio 4.5: dual-clip active; with ratio 0.22: clipped only
    out = ppo_clip_loss(lp, old, adv, _mask(), 0.2, 0.28, clip_ratio_c, mode, norm_constant=6.0)
    out.loss.backward()
    assert torch.isfinite(lp.grad).all() and (lp.grad[_mask() == 0] == 0).all()
    per_seq, clip_frac, dual_frac = ref_ppo(lp.detach(), old, adv, 0.2, 0.28, clip_ratio_c)
    _close(out.loss, ref_aggregate(per_seq, mode, 6.0))
    _close(out.clip_frac, clip_frac)
    _close(out.dual_clip_frac, dual_frac)
    assert 0 < clip_frac < 1 and (clip_ratio_c is None or dual_frac > 0)
    log_r = [float(lp.detach()[i, t]) - float(old[i, t]) for i in range(B) for t in _valid(i)]
    _close(out.approx_kl_k1, statistics.mean(-x for x in log_r))
    _close(out.approx_kl_k3, statistics.mean(math.exp(x) - 1 - x for x in log_r))


def test_ppo_dual_clip_hand_worked():
    # ratio, A:  (1.5,+1): max(-1.5,-1.2) = -1.2 clipped;  (0.5,+1): max(-0.5,-0.8) = -0.5;
    #            (5,-1): max(5, 1.2) = 5 -> dual-clip min(5, 3) = 3;  (0.5,-1): max(0.5, 0.8) = 0.8 clipped.
    # token-mean: (-1.2 - 0.5 + 3 + 0.8)/4 = 0.525 (without dual-clip: (-1.2 - 0.5 + 5 + 0.8)/4 = 1.025).
    lp = torch.log(torch.tensor([[1.5, 0.5, 5.0, 0.5]], dtype=torch.float64))
    old = torch.zeros_like(lp)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4)
    cfg = PolicyLossConfig(clip_ratio_c=3.0)
    out = compute_policy_loss(cfg, lp, old, adv, mask)
    _close(out.loss, 0.525)
    _close(out.clip_frac, 0.5)
    _close(out.dual_clip_frac, 0.25)
    _close(compute_policy_loss(PolicyLossConfig(), lp, old, adv, mask).loss, 1.025)
    with pytest.raises(ConfigError, match="clip_ratio_c must be > 1"):
        PolicyLossConfig(clip_ratio_c=0.5)


def test_ppo_gradient_is_zero_where_clipped():
    # d/dlogp of -A r is -A r where unclipped, 0 where the clipped branch is active; token-mean over 2 tokens.
    lp = torch.log(torch.tensor([[1.5, 0.9]], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    ppo_clip_loss(lp, torch.zeros(1, 2, dtype=torch.float64), adv, torch.ones(1, 2), 0.2, 0.2).loss.backward()
    _close(lp.grad, [[0.0, -0.9 / 2]])


def test_gspo_sequence_ratio_value_and_gradient():
    old = _rand(15, 0.3)
    lp = (old + _rand(16, 0.05)).clone().requires_grad_()
    adv = _broadcast_ref([1.0, -0.5, 2.0, -1.0, 0.0])
    adv_t = torch.tensor(adv, dtype=torch.float64)
    out = gspo_loss(lp, old, adv_t, _mask(), 3e-4, 4e-4)
    per_seq, grads = [], [[0.0] * T for _ in range(B)]
    n_seq = sum(1 for i in range(B) if _valid(i))
    for i in range(B):
        idx = _valid(i)
        if not idx:
            per_seq.append([])
            continue
        s = math.exp(statistics.mean(float(lp.detach()[i, t]) - float(old[i, t]) for t in idx))
        a = adv[i][idx[0]]
        l1, l2 = -a * s, -a * min(max(s, 1 - 3e-4), 1 + 4e-4)
        per_seq.append([max(l1, l2)] * len(idx))
        for t in idx:  # seq-mean-token-mean: each token's d/dlogp is -A s / (n_i N_seq) where unclipped, else 0
            grads[i][t] = (-a * s if l1 >= l2 else 0.0) / (len(idx) * n_seq)
    _close(out.loss, ref_aggregate(per_seq, LossAggregation.SEQ_MEAN_TOKEN_MEAN))
    out.loss.backward()
    _close(lp.grad, grads)  # exactly 0, not NaN, on the NaN-poisoned padding


def test_value_loss_clipped_against_loop():
    old_v, ret = _rand(17), _rand(18)
    v = old_v + _rand(19, 0.5)
    for clip in (0.2, None):
        out = value_loss(v, old_v, ret, _mask(), clip)
        per_seq, n_clip, n = [], 0, 0
        for i in range(B):
            row = []
            for t in _valid(i):
                vi, oi, ri = float(v[i, t]), float(old_v[i, t]), float(ret[i, t])
                e1 = (vi - ri) ** 2
                e2 = (min(max(vi, oi - clip), oi + clip) - ri) ** 2 if clip is not None else e1
                row.append(max(e1, e2))
                n_clip, n = n_clip + (e2 > e1), n + 1
            per_seq.append(row)
        _close(out.loss, 0.5 * ref_aggregate(per_seq, LossAggregation.TOKEN_MEAN))
        _close(out.clip_frac, n_clip / n)
        assert (clip is None) == (n_clip == 0)


def test_entropy_from_logits_and_aggregation():
    logits = _rand(20, 3.0, shape=(B, T, 7), poison=False)
    ent = entropy_from_logits(logits)
    expected = []
    for i in range(B):
        row = []
        for t in range(T):
            z = [float(x) for x in logits[i, t]]
            zmax = max(z)
            w = [math.exp(x - zmax) for x in z]
            p = [x / sum(w) for x in w]
            row.append(-sum(pi * math.log(pi) for pi in p))
        expected.append(row)
    _close(ent, expected)
    per_seq = [[expected[i][t] for t in _valid(i)] for i in range(B)]
    _close(aggregate_entropy(ent, _mask()), ref_aggregate(per_seq, LossAggregation.TOKEN_MEAN))


# --------------------------------------------------------------------------------------------- KL


def test_kl_estimators_match_formulas():
    lp, ref = _rand(21, poison=False), _rand(22, poison=False)
    formulas = {
        KLEstimator.K1: lambda a, b: a - b,
        KLEstimator.K2: lambda a, b: 0.5 * (a - b) ** 2,
        KLEstimator.K3: lambda a, b: math.exp(b - a) - (b - a) - 1,
        KLEstimator.ABS: lambda a, b: abs(a - b),
    }
    assert set(KL_ESTIMATORS) == set(formulas)
    for est, f in formulas.items():
        expected = [[f(float(lp[i, t]), float(ref[i, t])) for t in range(T)] for i in range(B)]
        _close(kl_divergence(lp, ref, est), expected)
    # k3 clamps: log-ratio to [-20, 20] and the estimate to [-10, 10]; both extremes give 10, not inf.
    far = kl_divergence(torch.tensor([0.0, 30.0]), torch.tensor([30.0, 0.0]), KLEstimator.K3)
    _close(far, [10.0, 10.0])
    assert kl_divergence(lp, ref, "low_var_kl").min() >= 0  # exact config value accepted; k3 >= 0


def test_k1_and_k3_are_unbiased_for_samples_from_the_policy():
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64)
    q = torch.tensor([0.3, 0.3, 0.2, 0.1, 0.1], dtype=torch.float64)
    true_kl = sum(float(pi) * math.log(float(pi) / float(qi)) for pi, qi in zip(p, q, strict=True))
    x = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(23))
    for est in (KLEstimator.K1, KLEstimator.K3):
        k = kl_divergence(p.log()[x], q.log()[x], est)
        stderr = float(k.std()) / math.sqrt(k.numel())
        assert abs(float(k.mean()) - true_kl) < 4 * stderr, (est, float(k.mean()), true_kl)


def test_apply_kl_penalty_and_kl_loss():
    r, lp, ref = _rand(24), _rand(25), _rand(26)
    out = apply_kl_penalty(r, lp, ref, _mask(), 0.1, KLEstimator.K1)
    kl = [[float(lp[i, t]) - float(ref[i, t]) if MASK_ROWS[i][t] else 0.0 for t in range(T)] for i in range(B)]
    _close(out.kl, kl)
    _close(
        out.rewards, [[float(r[i, t]) - 0.1 * kl[i][t] if MASK_ROWS[i][t] else 0.0 for t in range(T)] for i in range(B)]
    )
    _close(out.mean_kl, statistics.mean(statistics.mean(kl[i][t] for t in _valid(i)) for i in range(B) if _valid(i)))
    d = [[float(ref[i, t]) - float(lp[i, t]) for t in _valid(i)] for i in range(B)]
    k3 = [[min(math.exp(x) - x - 1, 10.0) for x in row] for row in d]  # k3 with its upper clamp at 10
    assert any(math.exp(x) - x - 1 > 10.0 for row in d for x in row)  # the clamp is exercised
    _close(kl_loss(lp, ref, _mask(), KLEstimator.K3), ref_aggregate(k3, LossAggregation.TOKEN_MEAN))


def test_adaptive_kl_controller_hand_worked():
    ctl = AdaptiveKLController(coef=0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=256)  # error 9/6 - 1 = 0.5 -> clipped 0.2; x (1 + 0.2*256/1e4) = 1.00512
    assert ctl.value == pytest.approx(0.100512, rel=1e-12)
    ctl.update(current_kl=5.4, n_steps=256)  # error -0.1; x (1 - 0.1*256/1e4) = 0.99744
    assert ctl.value == pytest.approx(0.100512 * 0.99744, rel=1e-12)
    ctl.update(current_kl=0.0, n_steps=100)  # error -1 -> clipped -0.2; x (1 - 0.2*100/1e4) = 0.998
    assert ctl.value == pytest.approx(0.100512 * 0.99744 * 0.998, rel=1e-12)
    fresh = AdaptiveKLController(1.0, 1.0, 1.0)
    fresh.load_state_dict(ctl.state_dict())
    assert fresh.value == ctl.value
    fixed = build_kl_controller(KLControllerConfig(coef=0.05))
    fixed.update(100.0, 1000)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.05
    assert isinstance(build_kl_controller(KLControllerConfig(KLControllerType.ADAPTIVE)), AdaptiveKLController)
    with pytest.raises(ConfigError, match="horizon > 0"):
        KLControllerConfig(KLControllerType.ADAPTIVE, horizon=0)


# --------------------------------------------------------------------------------------------- registries


def test_unknown_registry_keys_list_the_valid_ones():
    x = torch.zeros(2, 3)
    with pytest.raises(
        ConfigError, match=r"did you mean 'grpo'.*\['gae', 'grpo', 'reinforce_plus_plus', 'remax', 'rloo'\]"
    ):
        compute_advantages(AdvantageConfig(estimator="gpro"), AdvantageInputs(x, x))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"\['kl', 'mse', 'low_var_kl', 'abs'\]"):
        kl_divergence(x, x, "k3")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"did you mean 'token-mean'"):
        aggregate_loss(x, x, "token_mean")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"unknown policy loss 'ppo'.*\['cispo', 'gspo', 'ppo_clip', 'sapo'\]"):
        compute_policy_loss(PolicyLossConfig(loss="ppo"), x, x, x, x)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"\['fixed', 'adaptive'\]"):
        build_kl_controller(KLControllerConfig(kind="pid"))  # type: ignore[arg-type]
    assert registered(POLICY_LOSS) == ["cispo", "gspo", "ppo_clip", "sapo"]
    assert set(KL_CONTROLLERS) == set(KLControllerType)
