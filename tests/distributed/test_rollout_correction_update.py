"""Rollout-mismatch correction inside the policy update (issue #22, item 1), in a world of one.

A deliberately mismatched rollout: the embedded engine samples at temperature T while the policy's
training log-probs assume 1.0, so ``rollout_log_probs`` are another distribution's. The update (its own
forward standing in for the old log-probs, as the trainer does with one optimizer step per batch) must
report mismatch metrics and apply weights equal to a float64 hand computation from the logged log-probs:
at ratio 1, PPO-clip's token-mean loss is ``-sum(A * w) / N``, so ``pg_loss`` shows the weights applied.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megarl.testing.dist import sgd_policy

pytestmark = pytest.mark.dist

PROMPTS = [[5, 17, 42], [8, 9], [100, 3, 4, 77, 12], [250], [31, 32, 33, 34], [60, 61]]


def _hand(old, rollout, mask, adv, cfg):
    """Weights, pg_loss and metrics from plain Python floats (float64), independent of megarl.algos."""
    from megarl.algos.correction import ISLevel

    weights, logs = [], []
    for o_row, r_row, m_row in zip(old.tolist(), rollout.tolist(), mask.tolist(), strict=True):
        counted = [(o - r) for o, r, m in zip(o_row, r_row, m_row, strict=True) if m]
        logs.extend(counted)
        seq = sum(counted)
        geo = seq / len(counted) if counted else 0.0
        row_w = []
        for x in counted:
            w = 1.0
            if cfg.truncate is not None:
                level = {ISLevel.TOKEN: x, ISLevel.SEQUENCE: seq, ISLevel.GEOMETRIC: geo}[cfg.truncate]
                w *= min(math.exp(level), cfg.truncate_cap)
            if cfg.reject is not None:
                level = {ISLevel.TOKEN: x, ISLevel.SEQUENCE: seq, ISLevel.GEOMETRIC: geo}[cfg.reject]
                w *= 0.0 if not (cfg.reject_low <= math.exp(level) <= cfg.reject_high) else 1.0
            row_w.append(w)
        weights.append(row_w)
    advs = [a for a_row, m_row in zip(adv.tolist(), mask.tolist(), strict=True)
            for a, m in zip(a_row, m_row, strict=True) if m]
    flat_w = [w for row in weights for w in row]
    n = len(flat_w)
    return {"pg_loss": -sum(a * w for a, w in zip(advs, flat_w, strict=True)) / n,
            "mismatch/weight_mean": sum(flat_w) / n,
            "mismatch/kl_k1": sum(-x for x in logs) / n,
            "mismatch/kl_k3": sum(math.exp(x) - 1 - x for x in logs) / n,
            "mismatch/ratio_max": max(math.exp(x) for x in logs),
            "mismatch/ratio_min": min(math.exp(x) for x in logs)}


@pytest.fixture(scope="module")
def policy(tiny_hf, tmp_path_factory):
    from megarl.algos.config import AlgorithmConfig

    return sgd_policy(tiny_hf("qwen2_untied"), tmp_path_factory.mktemp("correction") / "mc", AlgorithmConfig(),
                      max_tokens=24, max_size=3)  # several micro-batches


def _rollout(policy, temperature: float):
    from megarl.data.batch import prompt_batch
    from megarl.rollout.base import SamplingParams

    policy.sync_weights()
    rows = policy.generate(prompt_batch(PROMPTS), SamplingParams(n=3, temperature=temperature, max_new_tokens=7,
                                                                 seed=5))
    policy.to_train()
    old = policy.compute_log_probs(rows.select("input_ids", "attention_mask"))["log_probs"]
    return rows, old


def _update(policy, rows, cfg, old=None):
    """One update; with ``old`` (the recomputed old log-probs) as the trainer sends it when they are recomputed,
    else with the update's own forward standing in for them."""
    from megarl.data.batch import Batch

    policy.algorithm = dataclasses.replace(policy.algorithm, rollout_correction=cfg,
                                           recompute_old_log_probs=old is not None)
    adv = torch.randn(rows["input_ids"].shape, generator=torch.Generator().manual_seed(3)) * rows["response_mask"]
    extra = {"advantages": adv} | ({"old_log_probs": old} if old is not None else {})
    train = rows.select("input_ids", "attention_mask", "response_mask", "rollout_log_probs").update(
        Batch.from_dict(extra))
    return policy.update(train), adv


def test_mismatch_metrics_and_applied_weights_equal_hand_computation(policy):
    from megarl.algos.correction import ISLevel, RolloutCorrectionConfig

    cases = [
        (1.0, RolloutCorrectionConfig()),  # matched engines: weights 1
        (1.3, RolloutCorrectionConfig(truncate=ISLevel.TOKEN, truncate_cap=1.2, reject=ISLevel.TOKEN,
                                      reject_low=0.6, reject_high=3.0)),
        (1.6, RolloutCorrectionConfig(truncate=ISLevel.GEOMETRIC, truncate_cap=1.05, reject=ISLevel.SEQUENCE,
                                      reject_low=0.2, reject_high=5.0)),
    ]
    kl = []
    for i, (temperature, cfg) in enumerate(cases):
        rows, old = _rollout(policy, temperature)
        result, adv = _update(policy, rows, cfg, old=old if i == 2 else None)  # both sources of pi_old
        mask = rows["response_mask"]
        expected = _hand(old.double(), rows["rollout_log_probs"].double(), mask, adv.double(), cfg)
        for key, value in expected.items():
            got = result.terms[key]
            assert abs(got - value) <= 2e-5 * max(1.0, abs(value)), (temperature, key, got, value)
        kl.append(result.terms["mismatch/kl_k3"])
        if temperature == 1.0:
            assert abs(result.terms["mismatch/weight_mean"] - 1.0) < 1e-5 and result.terms["mismatch/kl_k3"] < 1e-7
        else:  # the gap truncates and rejects something, so the weights are not all 1
            assert result.terms["mismatch/truncated_frac"] > 0 and abs(result.terms["mismatch/weight_mean"] - 1) > 1e-3
    assert kl[0] < kl[1] < kl[2]  # a larger temperature gap: a larger measured mismatch

    # switched off (no truncation, no rejection): plain advantages, no mismatch metrics
    rows, old = _rollout(policy, 1.6)
    result, adv = _update(policy, rows, RolloutCorrectionConfig(truncate=None))
    mask = rows["response_mask"].double()
    assert not any(k.startswith("mismatch/") for k in result.terms)
    expected = -(adv.double() * mask).sum().item() / mask.sum().item()
    assert abs(result.terms["pg_loss"] - expected) <= 2e-5 * max(1.0, abs(expected))
