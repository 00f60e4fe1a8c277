"""Rollout-mismatch correction (issue #22, item 1) against float64 hand computations.

Ragged rows (different response lengths, one fully masked), written out with Python floats and
``math``: the reference never calls the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algos.correction import ISLevel, RolloutCorrectionConfig, rollout_correction
from megarl.errors import ConfigError

# log rho per token (old - rollout) on the counted tokens; row 2 has none
LOG_RHO = [[0.1, -0.2, 0.9, 0.0], [-1.0, 0.05, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0],
           [math.log(2.0), math.log(0.5), 0.3, 0.0]]
MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]


def _tensors():
    rollout = torch.tensor([[-1.0, -2.0, -0.5, -3.0]] * 3 + [[0.0, 0.0, -0.5, -3.0]], dtype=torch.float64)
    old = rollout + torch.tensor(LOG_RHO, dtype=torch.float64) * torch.tensor(MASK, dtype=torch.float64)
    return old, rollout, torch.tensor(MASK, dtype=torch.float64)


def _level(row: int, level: ISLevel) -> list[float]:
    """The log ratio each counted token of ``row`` is judged by."""
    counted = [x for x, m in zip(LOG_RHO[row], MASK[row], strict=True) if m]
    if level is ISLevel.TOKEN:
        return counted
    total = sum(counted)
    value = total / len(counted) if level is ISLevel.GEOMETRIC and counted else total
    return [value] * len(counted)


def _expected_weights(cfg: RolloutCorrectionConfig) -> list[list[float]]:
    out = []
    for row in range(4):
        weights = [1.0] * sum(MASK[row])
        if cfg.truncate is not None:
            weights = [w * min(math.exp(x), cfg.truncate_cap) for w, x in zip(weights, _level(row, cfg.truncate),
                                                                             strict=True)]
        if cfg.reject is not None:
            weights = [0.0 if not (cfg.reject_low <= math.exp(x) <= cfg.reject_high) else w
                       for w, x in zip(weights, _level(row, cfg.reject), strict=True)]
        out.append(weights + [0.0] * (4 - len(weights)))
    return out


CASES = {
    "token TIS": RolloutCorrectionConfig(truncate=ISLevel.TOKEN, truncate_cap=2.0),
    "sequence TIS": RolloutCorrectionConfig(truncate=ISLevel.SEQUENCE, truncate_cap=1.5),
    "geometric TIS": RolloutCorrectionConfig(truncate=ISLevel.GEOMETRIC, truncate_cap=1.1),
    "ICEPOP (token mask)": RolloutCorrectionConfig(truncate=None, reject=ISLevel.TOKEN, reject_low=0.5,
                                                   reject_high=2.0),
    "sequence MIS": RolloutCorrectionConfig(truncate=None, reject=ISLevel.SEQUENCE, reject_low=0.5, reject_high=2.0),
    "Geo-RS + token TIS": RolloutCorrectionConfig(truncate=ISLevel.TOKEN, truncate_cap=2.0, reject=ISLevel.GEOMETRIC,
                                                  reject_low=0.9, reject_high=1.2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_weights_and_metrics_equal_hand_computation(name):
    cfg = CASES[name]
    old, rollout, mask = _tensors()
    out = rollout_correction(old, rollout, mask, cfg)
    expected = _expected_weights(cfg)
    assert torch.allclose(out.weights, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0), name
    counted = [(x, w) for r in range(4) for x, w, m in zip(LOG_RHO[r], expected[r], MASK[r], strict=True) if m]
    n = len(counted)
    assert out.metrics["kl_k1"].item() == pytest.approx(sum(-x for x, _ in counted) / n, abs=1e-12)
    assert out.metrics["kl_k3"].item() == pytest.approx(sum(math.exp(x) - 1 - x for x, _ in counted) / n, abs=1e-12)
    assert out.metrics["ratio_mean"].item() == pytest.approx(sum(math.exp(x) for x, _ in counted) / n, abs=1e-12)
    assert out.metrics["weight_mean"].item() == pytest.approx(sum(w for _, w in counted) / n, abs=1e-12)
    assert out.ratio_max.item() == pytest.approx(max(math.exp(x) for x, _ in counted), abs=1e-12)
    assert out.ratio_min.item() == pytest.approx(min(math.exp(x) for x, _ in counted), abs=1e-12)
    rows = [r for r in range(4) if sum(MASK[r])]  # the fully masked row counts in no sequence mean
    ppl = [math.exp(-sum(_level(r, ISLevel.TOKEN)) / sum(MASK[r])) for r in rows]
    assert out.seq_metrics["ppl_ratio"].item() == pytest.approx(sum(ppl) / len(ppl), abs=1e-12)
    if cfg.truncate is not None:
        capped = sum(math.exp(x) > cfg.truncate_cap for r in range(4) for x in _level(r, cfg.truncate))
        assert out.metrics["truncated_frac"].item() == pytest.approx(capped / n, abs=1e-12)
    if cfg.reject is not None:
        outside = sum(not (cfg.reject_low <= math.exp(x) <= cfg.reject_high) for r in range(4)
                      for x in _level(r, cfg.reject))
        assert outside > 0 and out.metrics["masked_frac"].item() == pytest.approx(outside / n, abs=1e-12)


def test_ratios_exactly_at_the_bounds_are_kept_and_not_counted_as_truncated():
    """Row 3 has token ratios exactly 2 and 0.5 (its rollout log-probs are 0 there, so log rho is exact):
    inside [0.5, 2], and a cap of 2 leaves 2 unchanged."""
    old, rollout, mask = _tensors()
    only_row3 = torch.zeros_like(mask)
    only_row3[3, :2] = 1.0
    cfg = RolloutCorrectionConfig(truncate=ISLevel.TOKEN, truncate_cap=2.0, reject=ISLevel.TOKEN, reject_low=0.5,
                                  reject_high=2.0)
    out = rollout_correction(old, rollout, only_row3, cfg)
    assert out.weights[3, :2].tolist() == pytest.approx([2.0, 0.5], abs=1e-12)
    assert out.metrics["truncated_frac"].item() == 0.0 and out.metrics["masked_frac"].item() == 0.0


def test_all_masked_gives_zero_weights_and_finite_metrics():
    old, rollout, _ = _tensors()
    out = rollout_correction(old, rollout, torch.zeros(4, 4, dtype=torch.float64), RolloutCorrectionConfig())
    assert out.weights.abs().sum().item() == 0.0
    values = [*out.metrics.values(), *out.seq_metrics.values(), out.ratio_max, out.ratio_min]
    assert all(math.isfinite(v.item()) for v in values)


def test_weights_are_constants_of_the_update():
    old, rollout, mask = _tensors()
    old.requires_grad_(True)
    out = rollout_correction(old, rollout, mask, RolloutCorrectionConfig())
    assert not out.weights.requires_grad


@pytest.mark.parametrize("kwargs", [dict(truncate_cap=0.9), dict(reject_low=1.0), dict(reject_high=1.0)])
def test_bad_bounds_are_config_errors(kwargs):
    with pytest.raises(ConfigError, match="rollout_correction"):
        RolloutCorrectionConfig(**kwargs)
