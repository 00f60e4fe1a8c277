"""RL algorithm math: advantage estimators, policy/value losses, KL terms and controllers, loss aggregation.

Pure functions of tensors. Advantage estimators and policy losses are plug-ins (:mod:`megarl.algos.plugins`):
the built-ins are registered by name with the decorators users mark their own with, and a config names either
(an unknown name raises ``ConfigError`` listing the registered ones); KL estimators and controllers are chosen
through registries keyed by enums. Token tensors are ``[batch, response_len]`` with a mask of the
same shape (1 for response tokens that count). No I/O, no process groups, no Ray, no megatron:
the driver and the workers call into this package, never the other way round.

- :mod:`megarl.algos.ops`        masked reductions, whitening, :class:`LossAggregation`, :class:`LossNormalizer`
- :mod:`megarl.algos.plugins`    :func:`advantage_estimator`, :func:`policy_loss`, :func:`group_filter`,
  :func:`reward_stage`: the plug-in seam, its checks
- :mod:`megarl.algos.advantages` GAE, GRPO, RLOO, REINFORCE++, ReMax
- :mod:`megarl.algos.losses`     PPO clip (+ dual-clip), GSPO, CISPO, SAPO; value loss; entropy
- :mod:`megarl.algos.kl`         ``KL_ESTIMATORS`` (k1, k2, k3, abs), KL penalty and loss, KL controllers
- :mod:`megarl.algos.correction` rollout-training mismatch: truncated / masked importance weights, diagnostics
- :mod:`megarl.algos.preference` DPO and its variants (robust, hinge, IPO) over sequence log-probs (issue #44)
- :mod:`megarl.algos.offline` offline objectives per micro-batch: SFT, DPO, KTO, Bradley-Terry reward model
- :mod:`megarl.algos.objective`  what an update optimises: token-level reward shaping (:func:`token_rewards`) and
  the policy objective of one micro-batch (:func:`policy_objective`: correction, masks, loss, entropy, KL)
"""

from megarl.algos.advantages import (
    AdvantageConfig,
    AdvantageInputs,
    Advantages,
    RewardScale,
    compute_advantages,
    discounted_returns,
    gae,
    grpo,
    reinforce_plus_plus,
    remax,
    rloo,
)
from megarl.algos.correction import CorrectionOutput, ISLevel, RolloutCorrectionConfig, rollout_correction
from megarl.algos.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    KLControllerConfig,
    KLControllerType,
    KLEstimator,
    KLPenalty,
    apply_kl_penalty,
    build_kl_controller,
    kl_divergence,
    kl_loss,
)
from megarl.algos.losses import (
    PolicyLossConfig,
    PolicyLossOutput,
    ValueLossOutput,
    aggregate_entropy,
    cispo_loss,
    compute_policy_loss,
    entropy_from_logits,
    gspo_loss,
    high_entropy_mask,
    ppo_clip_loss,
    sapo_loss,
    value_loss,
)
from megarl.algos.objective import (
    ObjectiveInputs,
    ObjectiveOutput,
    RewardKLPenalty,
    TeacherKL,
    TokenRewards,
    policy_objective,
    token_rewards,
)
from megarl.algos.offline import (
    BradleyTerryObjective,
    Counts,
    DPOObjective,
    KTOObjective,
    LMObjective,
    ScalarObjective,
    SFTObjective,
)
from megarl.algos.ops import (
    LossAggregation,
    LossNormalizer,
    aggregate_loss,
    masked_count,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    zero_masked,
)
from megarl.algos.plugins import (
    Plugin,
    RewardStageInputs,
    advantage_estimator,
    check_plugins,
    group_filter,
    policy_loss,
    reward_stage,
    rollout_function,
)
from megarl.algos.preference import DPOLoss, kto_kl

__all__ = [
    "BradleyTerryObjective",
    "Counts",
    "DPOLoss",
    "DPOObjective",
    "KTOObjective",
    "LMObjective",
    "SFTObjective",
    "ScalarObjective",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "AdvantageConfig",
    "AdvantageInputs",
    "Advantages",
    "CorrectionOutput",
    "FixedKLController",
    "ISLevel",
    "KLController",
    "KLControllerConfig",
    "KLControllerType",
    "KLEstimator",
    "KLPenalty",
    "LossAggregation",
    "LossNormalizer",
    "ObjectiveInputs",
    "ObjectiveOutput",
    "Plugin",
    "PolicyLossConfig",
    "PolicyLossOutput",
    "RewardKLPenalty",
    "RewardScale",
    "RolloutCorrectionConfig",
    "TeacherKL",
    "TokenRewards",
    "ValueLossOutput",
    "advantage_estimator",
    "aggregate_entropy",
    "aggregate_loss",
    "apply_kl_penalty",
    "build_kl_controller",
    "check_plugins",
    "cispo_loss",
    "compute_advantages",
    "compute_policy_loss",
    "discounted_returns",
    "entropy_from_logits",
    "gae",
    "group_filter",
    "reward_stage",
    "rollout_function",
    "RewardStageInputs",
    "grpo",
    "gspo_loss",
    "high_entropy_mask",
    "kl_divergence",
    "kl_loss",
    "kto_kl",
    "masked_count",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "policy_objective",
    "ppo_clip_loss",
    "reinforce_plus_plus",
    "remax",
    "rloo",
    "rollout_correction",
    "sapo_loss",
    "token_rewards",
    "value_loss",
    "zero_masked",
]
