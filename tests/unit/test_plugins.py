"""Advantage estimators, policy losses and dynamic sampling's group filters as plug-ins (issue #43, item 2): given
by path, checked on a synthetic batch before any worker starts; the examples' Dr. GRPO against a float64 hand
computation, their GRPO and PPO surrogate against the built-ins (bit-exact), and a wrong plug-in's error naming the
file, the function, what was expected and what was found.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megarl.algos import AdvantageConfig, AdvantageInputs, PolicyLossConfig, compute_advantages, compute_policy_loss
from megarl.algos.plugins import (
    ESTIMATOR,
    GROUP_FILTER,
    POLICY_LOSS,
    REWARD_STAGE,
    check_plugins,
    registered,
    resolve,
)
from megarl.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plugins" / "algorithms.py"
REWARDS = EXAMPLE.parent / "rewards.py"


def _batch(dtype=torch.float64):
    g = torch.Generator().manual_seed(5)
    mask = (torch.rand(6, 5, generator=g) > 0.2).to(dtype)
    mask[:, 0] = 1.0
    rewards = torch.zeros(6, 5, dtype=dtype)
    scores = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.0, 0.75], dtype=dtype)
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & (mask > 0)  # each row's last counted token
    rewards[last] = scores
    return AdvantageInputs(rewards, mask, group_ids=torch.tensor([0, 0, 0, 1, 1, 1])), scores


def test_dr_grpo_by_hand():
    inputs, scores = _batch()
    out = compute_advantages(AdvantageConfig(estimator=f"{EXAMPLE}:dr_grpo"), inputs)
    means = [sum(scores[:3].tolist()) / 3, sum(scores[3:].tolist()) / 3]
    for i in range(6):
        expected = scores[i].item() - means[i // 3]  # no division by the group's std (Dr. GRPO)
        for t in range(5):
            assert out.advantages[i, t].item() == pytest.approx(expected if inputs.mask[i, t] else 0.0, abs=1e-12)
    assert "group_ids" in resolve(ESTIMATOR, f"{EXAMPLE}:dr_grpo").needs


def test_user_grpo_and_surrogate_equal_the_built_ins_bit_for_bit():
    inputs, _ = _batch(torch.float32)
    ours = compute_advantages(AdvantageConfig(estimator="grpo"), inputs)
    theirs = compute_advantages(AdvantageConfig(estimator=f"{EXAMPLE}:group_normalised"), inputs)
    assert torch.equal(ours.advantages, theirs.advantages) and torch.equal(ours.returns, theirs.returns)
    g = torch.Generator().manual_seed(7)
    lp, old, adv = (-torch.rand(6, 5, generator=g) for _ in range(3))
    adv = adv * inputs.mask
    for aggregation in ("token-mean", "seq-mean-token-mean"):
        cfgs = [PolicyLossConfig(loss=loss, clip_high=0.28, aggregation=aggregation)
                for loss in ("ppo_clip", f"{EXAMPLE}:clipped_surrogate")]
        a, b = (compute_policy_loss(c, lp.clone().requires_grad_(True), old, adv, inputs.mask) for c in cfgs)
        assert torch.equal(a.loss, b.loss) and torch.equal(a.clip_frac, b.clip_frac)
        assert torch.equal(a.approx_kl_k1, b.approx_kl_k1) and torch.equal(a.approx_kl_k3, b.approx_kl_k3)


def test_constant_normalised_surrogate_by_hand():
    """Dr. GRPO's aggregation: the per-token loss summed over each sequence, over (sequences x the constant)."""
    inputs, _ = _batch()
    adv = torch.linspace(-1, 1, 30, dtype=torch.float64).reshape(6, 5) * inputs.mask
    lp = torch.full((6, 5), -1.0, dtype=torch.float64)
    cfg = PolicyLossConfig(loss=f"{EXAMPLE}:constant_normalised_surrogate", norm_constant=8.0)
    out = compute_policy_loss(cfg, lp, lp.clone(), adv, inputs.mask)  # ratio 1: the loss is -A per token
    expected = sum(-adv[i, t].item() for i in range(6) for t in range(5) if inputs.mask[i, t]) / (6 * 8.0)
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)


BAD = '''
import torch
from megarl.algos import Advantages, advantage_estimator, policy_loss

def one_argument(inputs):
    return inputs

def returns_a_tensor(inputs, config):
    return inputs.token_rewards

def wrong_shape(inputs, config):
    return Advantages(inputs.token_rewards[:, :1], inputs.token_rewards)

def integer_advantages(inputs, config):
    return Advantages(inputs.mask.long(), inputs.token_rewards)

def raises(inputs, config):
    raise KeyError("no such column")

@policy_loss()
def marked_as_a_loss(inputs, config):
    return None

def per_token_loss(log_prob, old_log_prob, advantages, mask, config, normalizer):
    from megarl.algos.losses import PolicyLossOutput
    z = torch.zeros(())
    return PolicyLossOutput(-advantages * log_prob, z, z, z, z)

def detached_loss(log_prob, old_log_prob, advantages, mask, config, normalizer):
    from megarl.algos.losses import PolicyLossOutput
    z = torch.zeros(())
    return PolicyLossOutput((advantages * mask).sum(), z, z, z, z)

def not_an_output(log_prob, old_log_prob, advantages, mask, config, normalizer):
    return log_prob.sum()

def keeps_rows(scores, group_ids, num_groups):
    return scores > 0

def keeps_a_list(scores, group_ids, num_groups):
    return [True] * num_groups

def per_group_scores(inputs):
    return torch.zeros(2)

def nan_scores(inputs):
    return inputs.scores / 0 * 0

def stage_raises(inputs):
    return inputs.rows[0]["difficulty"]

def list_scores(inputs):
    return [0.0] * len(inputs.responses)
'''


@pytest.mark.parametrize("kind, name, match", [
    (ESTIMATOR, "one_argument", r"has signature \(inputs\), which cannot be called as fn\(inputs: AdvantageInputs, "
                                r"config: AdvantageConfig\)"),
    (ESTIMATOR, "returns_a_tensor", r"'.*bad\.py:returns_a_tensor' returned Tensor; expected Advantages"),
    (ESTIMATOR, "wrong_shape", r"its advantages must be a floating tensor of shape \(4, 3\).*found shape \(4, 1\)"),
    (ESTIMATOR, "integer_advantages", r"found shape \(4, 3\), torch.int64"),
    (ESTIMATOR, "raises", r"raised KeyError: 'no such column' when called on a synthetic batch"),
    (ESTIMATOR, "marked_as_a_loss", r"is marked as a policy loss \(@policy_loss\); expected @advantage_estimator"),
    (ESTIMATOR, "missing", r"bad\.py defines no 'missing'"),
    (POLICY_LOSS, "per_token_loss", r"its loss must be a scalar floating tensor, found shape \(4, 3\)"),
    (POLICY_LOSS, "detached_loss", r"does not depend on log_prob"),
    (POLICY_LOSS, "not_an_output", r"returned Tensor; expected a megarl.algos.PolicyLossOutput"),
    (GROUP_FILTER, "keeps_rows", r"must return a bool tensor of shape \(2,\).*found shape \(4,\), torch.bool"),
    (GROUP_FILTER, "keeps_a_list", r"must return a bool tensor of shape \(2,\).*found list"),
    (GROUP_FILTER, "one_argument", r"which cannot be called as fn\(scores, group_ids, num_groups\)"),
    (REWARD_STAGE, "per_group_scores", r"must return a floating tensor of shape \(4,\).*found shape \(2,\)"),
    (REWARD_STAGE, "list_scores", r"must return a floating tensor of shape \(4,\).*found list"),
    (REWARD_STAGE, "nan_scores", r"returned non-finite scores"),
    (REWARD_STAGE, "stage_raises", r"raised KeyError: 'difficulty' when called on a synthetic round"),
    (REWARD_STAGE, "keeps_rows", r"which cannot be called as fn\(inputs: RewardStageInputs\)"),
])
def test_a_wrong_plugin_is_named_before_any_worker_starts(tmp_path, kind, name, match):
    (tmp_path / "bad.py").write_text(BAD)
    spec = f"{tmp_path / 'bad.py'}:{name}"
    estimator = spec if kind == ESTIMATOR else "grpo"
    loss = spec if kind == POLICY_LOSS else "ppo_clip"
    with pytest.raises(ConfigError, match=match):
        check_plugins(estimator, loss, AdvantageConfig(), PolicyLossConfig(), spec if kind == GROUP_FILTER else None,
                      [spec] if kind == REWARD_STAGE else [])


def test_reward_stages_by_hand():
    """examples/plugins/rewards.py on a hand-made round: the filter cancels the reward of a banned response, the
    bonus goes to each differing group's best."""
    from megarl.algos import RewardStageInputs

    scores = torch.tensor([1.0, 0.0, 0.5, 0.5, 1.0, 1.0])
    inputs = RewardStageInputs(scores=scores, sources={"function": scores}, prompts=["p"] * 6,
                               responses=["7", "3", "17", "4", "2", "2"], rows=[{}] * 6,
                               group_ids=torch.tensor([0, 0, 1, 1, 2, 2]), response_lengths=torch.ones(6),
                               finish_reasons=["stop"] * 6)
    safety = resolve(REWARD_STAGE, f"{REWARDS}:safety_filter")(inputs)
    assert safety.tolist() == [-1.0, 0.0, -0.5, 0.0, 0.0, 0.0]
    bonus = resolve(REWARD_STAGE, f"{REWARDS}:group_best_bonus")(inputs)
    assert bonus.tolist() == pytest.approx([0.1, 0.0, 0.0, 0.0, 0.0, 0.0])  # groups 1 and 2 are ties


def test_builtins_are_registered_plugins_and_unknown_names_are_refused():
    assert registered(ESTIMATOR) == ["gae", "grpo", "reinforce_plus_plus", "remax", "rloo"]
    assert registered(POLICY_LOSS) == ["cispo", "gspo", "ppo_clip", "sapo"]
    assert registered(GROUP_FILTER) == ["differing_rewards"]
    assert resolve(ESTIMATOR, "gae").needs == {"values"} and resolve(ESTIMATOR, "remax").needs == {"baseline_rewards"}
    assert resolve(POLICY_LOSS, "gspo").sequence_ratio and resolve(POLICY_LOSS, "ppo_clip").dual_clip
    with pytest.raises(ConfigError, match=r"unknown policy loss 'ppo_clp' \(did you mean 'ppo_clip'\?\)"):
        check_plugins("grpo", "ppo_clp", AdvantageConfig(), PolicyLossConfig())


ROLLOUT_BAD = '''
from megarl.program import RolloutSample

def one_argument(requests):
    return []

def too_few(requests, ctx):
    return [RolloutSample(requests[0])]

def prompt_only(requests, ctx):
    return [RolloutSample(r) for r in requests]

def swapped(requests, ctx):
    samples = [RolloutSample(r) for r in reversed(requests)]
    for s, turn in zip(samples, ctx.generate([s.ids for s in samples])):
        s.add_model(turn)
    return samples

def raises(requests, ctx):
    return ctx.tokenizer.no_such_method()

def fine(requests, ctx):
    samples = [RolloutSample(r) for r in requests]
    for s, turn in zip(samples, ctx.generate([r.prompt_ids for r in requests], max_new_tokens=4)):
        s.add_model(turn)
        s.add_context(ctx.tokenizer.encode("=", add_special_tokens=False))
    return samples
'''


@pytest.mark.parametrize("name, match", [
    ("one_argument", r"has signature \(requests\), which cannot be called as fn\(requests: list\[RolloutRequest\]"),
    ("too_few", r"returned a list of 1: \['RolloutSample'\]; expected a list of 2 RolloutSample"),
    ("prompt_only", r"sample 0 holds no model tokens"),
    ("swapped", r"sample 0 is not its request's \(prompt group 1, expected 0\)"),
    ("raises", r"raised AttributeError: .*no_such_method.* when called on 2 synthetic requests"),
    ("fine", None),
])
def test_a_rollout_function_is_called_once_before_any_worker_starts(tmp_path, name, match):
    """With the run's tokenizer and a stand-in generate (megarl.trainer.checks.check_rollout_function)."""
    from megarl.config.train import load_config
    from megarl.testing.addition import make_tokenizer
    from megarl.trainer.checks import check_rollout_function

    (tmp_path / "loops.py").write_text(ROLLOUT_BAD)
    cfg = load_config(None, [f"rollout.function={tmp_path / 'loops.py'}:{name}"])
    tokenizer = make_tokenizer(None)
    if match is None:
        check_rollout_function(cfg, tokenizer, (tokenizer.eos_token_id,))
        return
    with pytest.raises(ConfigError, match=match):
        check_rollout_function(cfg, tokenizer, (tokenizer.eos_token_id,))
