"""TRL's top_entropy_quantile, unclamped and bias-corrected KL inside the policy update (issue #26), world of one.

The update's own forward stands in for the old log-probs (ratio 1, as TRL with one iteration), so with
PPO-clip the policy loss is ``-sum(A * keep) / N`` over the kept tokens and the KL loss is the token mean of
k3 (the ratio is 1 in value); one case hands in old log-probs 0.5 below (ratio e^0.5 on every token), which
the bias-corrected KL must carry. ``keep`` is TRL's ``get_high_entropy_mask`` computed here in float64 from
the entropies of a forward at the same weights; k3 is computed from the reference log-probs we hand in.
One micro-batch holds the whole batch, so the threshold's token set is TRL's on one process.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megarl.testing.dist import sgd_policy

pytestmark = pytest.mark.dist

PROMPTS = [[5, 17, 42], [8, 9], [100, 3, 4, 77, 12], [250], [31, 32, 33, 34], [60, 61]]


def _trl_keep(entropy: torch.Tensor, mask: torch.Tensor, rho: float) -> torch.Tensor:
    """TRL 1.16 ``GRPOTrainer.get_high_entropy_mask(entropies, mask, 1 - rho)``: the linear-interpolation quantile
    of the non-pad entropies (written out: position q (n - 1) of the sorted values); keep entropy >= it."""
    values = sorted(e for e, m in zip(entropy.flatten().tolist(), mask.flatten().tolist(), strict=True) if m)
    pos = (1.0 - rho) * (len(values) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    threshold = values[lo] + (pos - lo) * (values[hi] - values[lo])
    return (entropy.double() >= threshold) & (mask != 0)


@pytest.fixture(scope="module")
def policy(tiny_hf, tmp_path_factory):
    from megarl.algos.config import AlgorithmConfig
    from megarl.algos.correction import RolloutCorrectionConfig

    algorithm = AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(truncate=None))
    return sgd_policy(tiny_hf("qwen2_untied"), tmp_path_factory.mktemp("trl_options") / "mc", algorithm,
                      max_tokens=100_000, max_size=64)  # one micro-batch


@pytest.mark.parametrize("rho, clamp, bias_correction, shift", [
    (0.3, False, True, 0.0), (0.5, True, False, 0.0), (1.0, False, False, 0.0),
    (0.4, False, True, 0.5),  # old log-probs handed in 0.5 below: ratio e^0.5, which weights the KL
])
def test_entropy_mask_and_kl_in_the_update_equal_hand_computation(policy, rho, clamp, bias_correction, shift):
    from megarl.data.batch import Batch, prompt_batch
    from megarl.rollout.base import SamplingParams

    policy.sync_weights()
    rows = policy.generate(prompt_batch(PROMPTS), SamplingParams(n=3, temperature=1.0, max_new_tokens=7, seed=5))
    policy.to_train()
    forward = policy.compute_log_probs(rows.select("input_ids", "attention_mask"))
    mask = rows["response_mask"]
    # the reference 3 nats above the policy on every response token: k3 = e^3 - 3 - 1 = 16.09 (clamped: 10)
    ref = forward["log_probs"] + 3.0 * mask
    policy.algorithm = dataclasses.replace(policy.algorithm, top_entropy_quantile=rho, kl_loss_coef=0.5,
                                           kl_clamp=clamp, kl_loss_bias_correction=bias_correction,
                                           recompute_old_log_probs=shift != 0.0)
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3)) * mask
    extra = {"advantages": adv, "ref_log_probs": ref}
    if shift:
        extra["old_log_probs"] = forward["log_probs"] - shift * mask
    train = rows.select("input_ids", "attention_mask", "response_mask", "rollout_log_probs").update(
        Batch.from_dict(extra))
    terms = policy.update(train).terms

    keep = _trl_keep(forward["entropy"], mask, rho)
    n = float(mask.sum())
    r = math.exp(shift)  # TRL: per_token_loss = -min(r A, clip(r, 0.8, 1.2) A), times the entropy mask
    a = adv.double()
    per_token = -torch.minimum(r * a, min(max(r, 0.8), 1.2) * a)
    expected_pg = (per_token * keep).sum().item() / n
    assert abs(terms["pg_loss"] - expected_pg) <= 2e-5 * max(1.0, abs(expected_pg)), (terms["pg_loss"], expected_pg)
    expected_kl = (10.0 if clamp else math.exp(3.0) - 4.0) * (r if bias_correction else 1.0)
    assert abs(terms["kl_loss"] - expected_kl) <= 1e-4 * expected_kl, (terms["kl_loss"], expected_kl)
    if rho < 1.0:
        assert terms["entropy_mask_frac"] == pytest.approx(keep.sum().item() / n, abs=1e-9)
        assert 0 < keep.sum() < mask.sum()  # the mask does something on this batch
    else:
        assert "entropy_mask_frac" not in terms
