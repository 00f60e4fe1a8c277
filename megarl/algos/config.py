"""The algorithm section of a run (``algorithm:`` in the YAML): estimator, losses, KL terms, epochs.

The policy and critic roles receive this object itself (with the sampling temperature), so every
algorithm default lives here once. Pure module.
"""

from __future__ import annotations

import dataclasses

from megarl.algos.advantages import AdvantageConfig, estimator
from megarl.algos.correction import RolloutCorrectionConfig
from megarl.algos.dapo import DynamicSamplingConfig
from megarl.algos.kl import KLControllerConfig, KLEstimator
from megarl.algos.losses import PolicyLossConfig


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    advantage: AdvantageConfig = AdvantageConfig(estimator="grpo")
    policy_loss: PolicyLossConfig = PolicyLossConfig()
    entropy_coef: float = 0.0  # subtract coef x entropy from the policy loss
    kl_penalty: KLControllerConfig | None = None  # KL to the reference subtracted from the reward
    kl_loss_coef: float = 0.0  # KL to the reference as a loss term (GRPO style); 0 = off
    kl_estimator: KLEstimator = KLEstimator.K3  # of KL(policy || reference): kl (k1), abs, mse (k2), low_var_kl (k3)
    # low_var_kl clamps its log-ratio to +-20 and its value to +-10 as verl does (a token past 10 then gets no
    # KL gradient); false is the plain k3 of TRL
    kl_clamp: bool = True  # low_var_kl: clamp (verl); false: unclamped k3 (TRL)
    # TRL's use_bias_correction_kl (its default: true; DeepSeek-V3.2): the ratio keeps its gradient, which makes
    # the KL gradient the unbiased reverse-KL one even on policy
    kl_loss_bias_correction: bool = False  # KL loss x importance ratio pi / pi_old (needs kl_loss_coef > 0)
    # TRL's top_entropy_quantile ("Beyond the 80/20 rule", arXiv 2506.01939, recommends 0.2); the quantile is
    # taken over each micro-batch's counted tokens on its rank (docs/trl.md)
    top_entropy_quantile: float = 1.0  # policy loss only on the top share of tokens by entropy; 1 = all
    value_clip: float | None = 0.2  # critic (GAE only)
    ppo_epochs: int = 1  # passes over each batch
    mini_batches: int = 1  # optimizer steps per epoch
    # A training-model forward after each rollout for the PPO ratio's old log-probs (and the rollout
    # check). None = auto: only where something needs them; with one optimizer step per batch
    # (ppo_epochs = mini_batches = 1) and no kl_penalty, the update's own forward is at the same
    # weights and stands in (ratio 1, as TRL and verl do), measuring rollout/logprob_abs_diff and
    # applying rollout.engine.max_logprob_abs_diff there. true: always; false where they are needed: ConfigError.
    recompute_old_log_probs: bool | None = None  # null: only where needed (see above); true: always
    # importance weights on pi_old / pi_rollout against the engines' mismatch (megarl.algos.correction)
    rollout_correction: RolloutCorrectionConfig = RolloutCorrectionConfig()
    # DAPO dynamic sampling: train only on prompt groups whose rewards differ (megarl.algos.dapo); null: off
    dynamic_sampling: DynamicSamplingConfig | None = None
    mask_truncated: bool = False  # DAPO overlong filtering: responses cut at max_new_tokens count in no loss term

    @property
    def needs_reference(self) -> bool:
        return self.kl_penalty is not None or self.kl_loss_coef > 0

    def old_log_probs_needed_because(self) -> str | None:
        """Why old log-probs must come from a forward of their own; None when the update's can stand in."""
        if self.ppo_epochs != 1 or self.mini_batches != 1:
            return (f"ppo_epochs={self.ppo_epochs} x mini_batches={self.mini_batches} optimizer steps per batch: "
                    "after the first, the policy is no longer the one that sampled")
        if self.kl_penalty is not None:
            return "kl_penalty subtracts KL(old policy || reference) from the rewards before the update"
        return None

    @property
    def recomputes_old_log_probs(self) -> bool:
        """``recompute_old_log_probs`` with auto (None) resolved."""
        if self.recompute_old_log_probs is None:
            return self.old_log_probs_needed_because() is not None
        return self.recompute_old_log_probs

    @property
    def needs_critic(self) -> bool:
        return "values" in estimator(self.advantage).needs

    @property
    def needs_greedy_baseline(self) -> bool:
        """ReMax: each step also samples one greedy response per prompt; its reward is the baseline."""
        return "baseline_rewards" in estimator(self.advantage).needs
