"""What the policy update optimises: token-level reward shaping and the policy objective of one micro-batch.

Two pure compositions of the other ``algos`` modules, so that the roles and the trainer only move tensors:

- :func:`token_rewards` (the driver, before the advantages): each response's score on its last counted
  token, plus an on-policy distillation teacher's negative reverse KL on every counted token
  (:class:`TeacherKL`), minus a KL penalty to the reference (:class:`RewardKLPenalty`,
  :func:`~megarl.algos.kl.apply_kl_penalty`). The KL controller's coefficient is an input: the controller
  is stateful and stays with the trainer, which feeds it :attr:`TokenRewards.mean_kl`.
- :func:`policy_objective` (the policy role, inside its loss function, per micro-batch): the rollout-mismatch
  correction weights on the advantages (:mod:`megarl.algos.correction`), the top-entropy mask, the policy
  loss, the entropy bonus and the KL loss, with their metrics.

Metrics of :func:`policy_objective` are shares of global means: a token mean of the micro-batch is
multiplied by its share of the global batch's counted tokens (a sequence mean by its share of the
sequences), and the loss terms are already divided by the global :class:`~megarl.algos.ops.LossNormalizer`,
so the sums over micro-batches and data-parallel ranks are the global batch's means. The exceptions
are ``mismatch/ratio_max`` and ``mismatch/ratio_min``: extremes, to be reduced by max / min.

Must not import: torch.distributed, megatron, Ray, vLLM, or any megarl layer above ``algos``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.algos.config import AlgorithmConfig
from megarl.algos.correction import rollout_correction
from megarl.algos.kl import KLEstimator, apply_kl_penalty, kl_divergence, kl_loss
from megarl.algos.losses import aggregate_entropy, compute_policy_loss, high_entropy_mask
from megarl.algos.ops import LossNormalizer, masked_mean, zero_masked
from megarl.algos.plugins import POLICY_LOSS, resolve

# ---------------------------------------------------------------------------------------- token rewards


@dataclass(frozen=True)
class TeacherKL:
    """On-policy distillation: every counted token's reward gains ``coef * (log pi_teacher - log pi_student)``,
    the negative of a one-sample estimate of the reverse KL(student || teacher)."""

    coef: float
    teacher_log_probs: torch.Tensor  # [B, S] the teacher's log-probs of the sampled tokens
    student_log_probs: torch.Tensor  # [B, S] the policy's, at the weights that sampled them


@dataclass(frozen=True)
class RewardKLPenalty:
    """``coef * KL(pi_old || pi_ref)`` per token subtracted from the rewards
    (:func:`~megarl.algos.kl.apply_kl_penalty`)."""

    coef: float  # the KL controller's current value
    log_probs: torch.Tensor  # [B, S] the policy's log-probs at the sampling weights ("old")
    ref_log_probs: torch.Tensor  # [B, S]
    estimator: KLEstimator
    clamp: bool = True  # low_var_kl's clamps (``algorithm.kl_clamp``)


@dataclass(frozen=True)
class TokenRewards:
    rewards: torch.Tensor  # [B, S] the token rewards the advantage estimator reads
    mean_kl: torch.Tensor | None  # the KL penalty's controller input (None without a penalty)
    metrics: dict[str, float]  # ``kl_coef`` and ``reward_kl`` with a KL penalty, else empty


def token_rewards(scores: torch.Tensor, mask: torch.Tensor, *, teacher: TeacherKL | None = None,
                  kl_penalty: RewardKLPenalty | None = None) -> TokenRewards:
    """Shaped token rewards from one score per response ``scores`` [B] and the response ``mask`` [B, S].

    The score sits on the last counted token of its row (a row with no counted token gets none); the
    teacher's term then adds on every counted token; the KL penalty (last) zeroes every uncounted token.
    """
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & (mask != 0)
    rewards = torch.where(last, scores.unsqueeze(-1), torch.zeros_like(mask))
    if teacher is not None:
        rewards = rewards + teacher.coef * mask * (teacher.teacher_log_probs - teacher.student_log_probs)
    if kl_penalty is None:
        return TokenRewards(rewards, None, {})
    pen = apply_kl_penalty(rewards, kl_penalty.log_probs, kl_penalty.ref_log_probs, mask, kl_penalty.coef,
                           kl_penalty.estimator, kl_penalty.clamp)
    return TokenRewards(pen.rewards, pen.mean_kl, {"kl_coef": kl_penalty.coef, "reward_kl": pen.mean_kl.item()})


# ---------------------------------------------------------------------------------------- policy objective


@dataclass(frozen=True)
class ObjectiveInputs:
    """One micro-batch's token tensors, all [B, S] and token-aligned."""

    log_probs: torch.Tensor  # the policy's log-probs of the sampled tokens, differentiable
    entropy: torch.Tensor  # the policy's per-token entropy, differentiable
    advantages: torch.Tensor
    mask: torch.Tensor  # 1 on response tokens that count
    # the PPO ratio's denominator; None: this forward is at the sampling weights and stands in (ratio 1), and
    # the metrics then also carry ``kl``, the token-mean KL(policy || reference) of these log-probs
    old_log_probs: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None  # the rollout engine's; with it the mismatch correction applies
    ref_log_probs: torch.Tensor | None = None  # the reference's; needed with ``kl_loss_coef``


@dataclass(frozen=True)
class ObjectiveOutput:
    loss: torch.Tensor  # scalar, differentiable: this micro-batch's share of the global batch's loss
    metrics: dict[str, torch.Tensor]  # detached; shares of global means (see the module docstring)


def policy_objective(cfg: AlgorithmConfig, x: ObjectiveInputs, normalizer: LossNormalizer) -> ObjectiveOutput:
    """The policy loss of one micro-batch with ``cfg``'s terms, ``normalizer`` counting the global batch.

    ``loss = policy_loss(A') - entropy_coef * entropy bonus + kl_loss_coef * kl_loss`` where ``A'`` is the
    advantage times the mismatch correction's weight on ``pi_old / pi_rollout`` (where ``rollout_log_probs``
    is given and ``cfg.rollout_correction`` is active) times the top-entropy mask (``top_entropy_quantile <
    1``: the tokens below the quantile keep their place in every denominator and in the KL term, and the
    bonus counts only the kept tokens' entropy). Metrics: ``pg_loss``, ``entropy``, the policy loss's
    diagnostics, ``mismatch/*``, ``entropy_mask_frac``, ``kl_loss`` and ``kl`` where they apply.
    """
    a, loss_cfg, lp, ent = cfg, cfg.policy_loss, x.log_probs, x.entropy
    mask = x.mask.to(lp.dtype)
    old = lp.detach() if x.old_log_probs is None else x.old_log_probs
    # token-mean metrics of this micro-batch, weighted so that they add up to global means
    weight = mask.sum() / normalizer.token_count
    advantages, metrics = x.advantages, {}
    if x.rollout_log_probs is not None and a.rollout_correction.active:
        corr = rollout_correction(old, x.rollout_log_probs, mask, a.rollout_correction)
        advantages = advantages * corr.weights
        seq_weight = (mask.sum(-1) > 0).sum() / normalizer.seq_count
        metrics = ({f"mismatch/{k}": v * weight for k, v in corr.metrics.items()}
                   | {f"mismatch/{k}": v * seq_weight for k, v in corr.seq_metrics.items()}
                   | {"mismatch/ratio_max": corr.ratio_max, "mismatch/ratio_min": corr.ratio_min})
    keep = None
    if a.top_entropy_quantile < 1.0:  # every policy loss is linear in A: a zero A is TRL's zeroed token loss,
        # with the denominators (and the KL term) still over every counted token, as there
        keep = high_entropy_mask(ent, mask, a.top_entropy_quantile)
        advantages = advantages * keep
        metrics["entropy_mask_frac"] = keep.sum() / normalizer.token_count
    out = compute_policy_loss(loss_cfg, lp, old, advantages, mask, normalizer)
    entropy = aggregate_entropy(ent, mask, loss_cfg.aggregation, normalizer, loss_cfg.norm_constant)
    bonus = entropy if keep is None else aggregate_entropy(
        zero_masked(ent, keep), mask, loss_cfg.aggregation, normalizer, loss_cfg.norm_constant)
    loss = out.loss - a.entropy_coef * bonus if a.entropy_coef else out.loss
    metrics |= {k: v * weight for k, v in out.metrics().items() if k != "loss"}
    if a.kl_loss_coef:
        kl, kl_metrics = _kl_term(a, x, mask, old, normalizer, weight)
        loss = loss + a.kl_loss_coef * kl
        metrics |= kl_metrics
    return ObjectiveOutput(loss, {"pg_loss": out.loss.detach(), "entropy": entropy.detach(), **metrics})


def _kl_term(a: AlgorithmConfig, x: ObjectiveInputs, mask: torch.Tensor, old: torch.Tensor,
             normalizer: LossNormalizer, weight: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The KL loss to the reference (aggregated like the policy loss) and its metrics."""
    if x.ref_log_probs is None:
        raise ValueError(f"algorithm.kl_loss_coef={a.kl_loss_coef} needs the reference's log-probs, found none: "
                         "pass ref_log_probs (the trainer sends them whenever kl_loss_coef > 0)")
    loss_cfg = a.policy_loss
    kl = kl_loss(x.log_probs, x.ref_log_probs, mask, a.kl_estimator, loss_cfg.aggregation, normalizer,
                 loss_cfg.norm_constant, a.kl_clamp, old if a.kl_loss_bias_correction else None,
                 sequence_ratio=resolve(POLICY_LOSS, loss_cfg.loss).sequence_ratio)
    metrics = {"kl_loss": kl.detach()}
    if x.old_log_probs is None:
        per_token = kl_divergence(x.log_probs.detach(), x.ref_log_probs, a.kl_estimator, a.kl_clamp)
        metrics["kl"] = masked_mean(per_token, mask) * weight
    return kl, metrics
