"""Offline preference and reward-model losses (issue #44): DPO and its variants, KTO, and the Bradley-Terry reward
model loss, each as HuggingFace TRL 1.16 computes it (``trl/trainer/dpo_trainer.py``, ``kto_trainer.py``,
``reward_trainer.py``), with the metrics TRL logs under TRL's names. Pure: tensors in, tensors out, no
``torch.distributed``; a trainer that works micro-batch by micro-batch (and rank by rank) sums the per-row terms and
the metric sums and divides by the whole batch's counts, as documented per loss.

**DPO** (:func:`dpo_losses`). Inputs: each pair's policy and reference log-probability of the chosen and the
rejected response, *summed* over the response's tokens (TRL's ``logps``), for every loss type. With the log-ratios
``lc = pi_chosen - ref_chosen``, ``lr = pi_rejected - ref_rejected`` and ``delta = lc - lr``
(``dpo_trainer.py`` 1350-1351, 1383):

* ``sigmoid`` (DPO, Rafailov et al. 2023): ``-log sigma(beta delta)``. TRL 1.16 has no label smoothing here (no
  conservative DPO: ``label_smoothing`` is silently ignored by TRL for this loss, and refused here);
* ``robust`` (robust DPO, Chowdhury et al. 2024): ``(-(1 - eps) log sigma(beta delta) + eps log sigma(-beta
  delta)) / (1 - 2 eps)``, ``eps = label_smoothing`` in [0, 0.5);
* ``hinge`` (RSO, Liu et al. 2023): ``max(0, 1 - beta delta)``;
* ``ipo`` (Azar et al. 2023): ``(lc / n_chosen - lr / n_rejected - 1 / (2 beta))^2``: TRL divides each response's
  *log-ratio* by its completion token count (``completion_mask.sum(1).clamp(min=1)``, dpo_trainer.py 1393-1404),
  so the caller passes the summed log-probs as for the other losses plus ``chosen_lengths`` / ``rejected_lengths``
  (the number of completion tokens of each response, EOS included when the data has one).

TRL's loss is the mean of :attr:`PreferenceOutput.losses` over the batch's pairs. The implicit rewards are
``beta lc`` and ``beta lr`` (from the *summed* log-ratios for IPO too); the metrics (:meth:`PreferenceOutput.metrics`,
dpo_trainer.py 1580-1601) are ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies`` (strict
``>``), ``rewards/margins``, ``logps/chosen``, ``logps/rejected``, each a mean over the pairs.

**KTO** (:func:`kto_kl`, :func:`kto_losses`, :func:`kto_metrics`; kto_trainer.py 1370-1548). Unpaired rows, each
desirable (label true) or undesirable. A KL estimate ``z`` (:func:`kto_kl`) is formed first from the batch's
mismatched "KL pairs" and is a detached constant in the loss; each row's term is ``w_d (1 - sigma(beta (l - z)))``
for a desirable row and ``w_u (1 - sigma(beta (z - l)))`` for an undesirable one, ``l = pi - ref`` (summed
log-probs). TRL's loss is the mean of those terms over *all* rows of the batch, desirable and undesirable together
(``torch.cat(...).nanmean()``, 1479-1482, 1548): one denominator, not one per class. A batch without desirable (or
undesirable) rows is the mean of the other class's terms over all rows. The metrics are class means formed from sums
(:meth:`KTOOutput.metric_sums`, :func:`kto_metrics`).

**Reward model** (:func:`reward_model_losses`, :func:`reward_model_metrics`; reward_trainer.py 778-815): each pair's
scalar rewards ``r_c``, ``r_r`` (the sequence-classification head at the last non-pad token) and an optional
``margin``; TRL's loss is ``mean(-log sigma(r_c - r_r - margin)) + c mean((r_c + r_r)^2)``, ``c =
center_rewards_coefficient`` (no term when ``None``).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F  # noqa: N812


class DPOLoss(enum.Enum):
    SIGMOID = "sigmoid"
    ROBUST = "robust"
    HINGE = "hinge"
    IPO = "ipo"


@dataclasses.dataclass(frozen=True)
class PreferenceOutput:
    losses: torch.Tensor  # [pairs], differentiable in the policy's log-probs; TRL's loss is their mean
    chosen_rewards: torch.Tensor  # [pairs] beta (pi_chosen - ref_chosen), detached (summed log-probs, IPO too)
    rejected_rewards: torch.Tensor  # [pairs] beta (pi_rejected - ref_rejected), detached

    def metrics(self, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor) -> dict[str, float]:
        """TRL's names: the means over the pairs (``chosen_logps`` / ``rejected_logps``: the policy's summed
        log-probs, as passed to :func:`dpo_losses`)."""
        c, r = self.chosen_rewards, self.rejected_rewards
        return {"loss": self.losses.mean().item(), "rewards/chosen": c.mean().item(),
                "rewards/rejected": r.mean().item(), "rewards/accuracies": (c > r).float().mean().item(),
                "rewards/margins": (c - r).mean().item(), "logps/chosen": chosen_logps.detach().mean().item(),
                "logps/rejected": rejected_logps.detach().mean().item()}


def dpo_losses(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
               ref_rejected_logps: torch.Tensor, *, beta: float = 0.1, loss: DPOLoss = DPOLoss.SIGMOID,
               label_smoothing: float = 0.0, chosen_lengths: torch.Tensor | None = None,
               rejected_lengths: torch.Tensor | None = None) -> PreferenceOutput:
    """Each pair's loss by ``loss`` (module docstring) and the implicit rewards, as TRL 1.16's ``DPOTrainer``
    computes them. All four log-prob tensors are ``[pairs]`` sums over each response's completion tokens.
    ``label_smoothing``: ``robust`` only. ``chosen_lengths`` / ``rejected_lengths``: ``[pairs]`` completion token
    counts, required by (and only by) ``ipo``, which divides each log-ratio by its count (at least 1)."""
    if loss is DPOLoss.ROBUST and not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), found {label_smoothing}")
    if label_smoothing and loss is not DPOLoss.ROBUST:
        raise ValueError(f"label_smoothing applies to the robust loss only (TRL 1.16's {loss.value} loss has none), "
                         f"found {label_smoothing}")
    if (loss is DPOLoss.IPO) != (chosen_lengths is not None and rejected_lengths is not None):
        raise ValueError("chosen_lengths and rejected_lengths (completion token counts) are required by the ipo loss "
                         f"and by no other; loss {loss.value}")
    chosen_logratios = chosen_logps - ref_chosen_logps  # TRL's order of operations (rounding equal)
    rejected_logratios = rejected_logps - ref_rejected_logps
    delta = chosen_logratios - rejected_logratios
    eps = label_smoothing
    if loss is DPOLoss.SIGMOID:
        losses = -F.logsigmoid(beta * delta)
    elif loss is DPOLoss.ROBUST:
        clean = -(1 - eps) * F.logsigmoid(beta * delta)
        flipped = -eps * F.logsigmoid(-beta * delta)
        losses = (clean - flipped) / (1 - 2 * eps)
    elif loss is DPOLoss.HINGE:
        losses = torch.relu(1 - beta * delta)
    else:
        ipo_delta = chosen_logratios / chosen_lengths.clamp(min=1) - rejected_logratios / rejected_lengths.clamp(min=1)
        losses = (ipo_delta - 1 / (2 * beta)) ** 2
    return PreferenceOutput(losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach())


# --------------------------------------------------------------------------------------------------------- KTO


def kto_kl(kl_logps: torch.Tensor | Sequence[torch.Tensor],
           ref_kl_logps: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """KTO's KL estimate ``z``, detached, as TRL 1.16 forms it (kto_trainer.py 1443-1444): the mean over the KL
    pairs of ``policy - reference`` summed log-prob of the mismatched completion (prompt ``i`` with the completion
    of row ``i - 1`` of the same batch; the policy's pass is under ``no_grad``), averaged over processes, then
    clamped at 0.

    One tensor ``[rows]``: one process's KL pairs. A sequence of ``[rows_p]`` tensors: one per process; TRL
    gathers each process's *mean* and averages those means (equal to the mean over all rows only when the processes
    hold equally many rows), and clamps after averaging. TRL forms ``z`` anew in every ``compute_loss`` call, i.e.
    per accumulation micro-batch: with ``gradient_accumulation_steps=1`` it is the per-device batch's."""
    if isinstance(kl_logps, torch.Tensor):
        kl_logps, ref_kl_logps = [kl_logps], [ref_kl_logps]
    if len(kl_logps) != len(ref_kl_logps) or not kl_logps:
        raise ValueError(f"kto_kl: {len(kl_logps)} policy and {len(ref_kl_logps)} reference groups")
    means = torch.stack([(p.detach() - r.detach()).mean() for p, r in zip(kl_logps, ref_kl_logps, strict=True)])
    return means.mean().clamp(min=0)


@dataclasses.dataclass(frozen=True)
class KTOOutput:
    losses: torch.Tensor  # [rows] each row's weighted term, differentiable in logps; TRL's loss: sum / batch rows
    rewards: torch.Tensor  # [rows] beta (pi - ref), detached
    logps: torch.Tensor  # [rows] the policy's summed log-probs, detached
    labels: torch.Tensor  # [rows] bool: desirable

    def metric_sums(self) -> dict[str, torch.Tensor]:
        """This micro-batch's contributions, to be added over micro-batches and ranks before :func:`kto_metrics`:
        ``rewards/chosen_sum``, ``logps/chosen_sum``, ``count/chosen`` and the ``rejected`` ones (0-d tensors;
        the sums skip NaN as TRL's ``nansum`` does, the counts do not)."""
        c, r = self.labels, ~self.labels
        return {"rewards/chosen_sum": self.rewards[c].nansum(), "logps/chosen_sum": self.logps[c].nansum(),
                "count/chosen": c.sum().to(self.rewards.dtype),
                "rewards/rejected_sum": self.rewards[r].nansum(), "logps/rejected_sum": self.logps[r].nansum(),
                "count/rejected": r.sum().to(self.rewards.dtype)}


def kto_losses(logps: torch.Tensor, ref_logps: torch.Tensor, labels: torch.Tensor, kl: torch.Tensor | float, *,
               beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> KTOOutput:
    """Each row's KTO term (TRL 1.16 ``loss_type="kto"``, kto_trainer.py 1446-1482): ``desirable_weight (1 -
    sigma(beta ((pi - ref) - kl)))`` for a desirable row (``labels`` true), ``undesirable_weight (1 - sigma(beta
    (kl - (pi - ref))))`` for an undesirable one. ``logps`` / ``ref_logps``: ``[rows]`` summed over each
    completion's tokens; ``kl``: the batch's :func:`kto_kl` (a constant: no gradient flows through it).

    TRL's loss is ``losses.sum() / rows``, ``rows`` counting every row (both classes) of TRL's ``compute_loss``
    batch (the per-device micro-batch; with one process and no accumulation, the step's batch), so a trainer
    splitting that batch into micro-batches sums ``losses`` over them and divides by the batch's row count. TRL's
    ``nanmean`` leaves NaN terms out of both; here a NaN propagates."""
    labels = labels.to(torch.bool)
    kl = torch.as_tensor(kl, dtype=logps.dtype, device=logps.device).detach()
    logratios = logps - ref_logps
    chosen = desirable_weight * (1 - torch.sigmoid(beta * (logratios - kl)))
    rejected = undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratios)))
    return KTOOutput(torch.where(labels, chosen, rejected), beta * logratios.detach(), logps.detach(), labels)


def kto_metrics(sums: Mapping[str, torch.Tensor | float], kl: torch.Tensor | float) -> dict[str, float]:
    """TRL 1.16's KTO metrics of one ``compute_loss`` batch (kto_trainer.py 1484, 1524-1546) from the
    :meth:`KTOOutput.metric_sums` summed over its micro-batches and ranks: ``kl``; ``rewards/chosen`` and
    ``logps/chosen`` (sum / count of desirable rows), only when the batch has desirable rows; ``rewards/rejected``
    and ``logps/rejected`` likewise; ``rewards/margins`` = ``rewards/chosen - rewards/rejected``, only when it has
    both. A key TRL leaves out is left out here (TRL's logged step value averages the batches that had it).
    Not here (they need the model's outputs): ``entropy``, ``logits/chosen``, ``logits/rejected`` (token means
    over completion tokens), ``num_tokens`` (cumulative attention-mask tokens)."""
    s = {k: float(v) for k, v in sums.items()}
    out = {"kl": float(kl)}
    for side in ("chosen", "rejected"):
        n = s[f"count/{side}"]
        if n > 0:
            out[f"rewards/{side}"] = s[f"rewards/{side}_sum"] / n
            out[f"logps/{side}"] = s[f"logps/{side}_sum"] / n
    if s["count/chosen"] > 0 and s["count/rejected"] > 0:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out


# ------------------------------------------------------------------------------------------ Bradley-Terry reward model


@dataclasses.dataclass(frozen=True)
class RewardModelOutput:
    losses: torch.Tensor  # [pairs] -log sigma(r_c - r_r - margin) + c (r_c + r_r)^2; TRL's loss is their mean
    chosen_rewards: torch.Tensor  # [pairs] detached
    rejected_rewards: torch.Tensor  # [pairs] detached

    def metric_sums(self) -> dict[str, torch.Tensor]:
        """This micro-batch's contributions to :func:`reward_model_metrics`, combined over micro-batches and ranks
        by :func:`combine_metric_sums` (``min_reward`` / ``max_reward`` by min / max, the rest by addition)."""
        c, r = self.chosen_rewards, self.rejected_rewards
        both = torch.cat([c, r])
        inf = both.new_tensor(math.inf)  # no pair (an idle micro-batch): no extreme
        return {"count/pairs": torch.tensor(float(c.numel()), dtype=c.dtype, device=c.device),
                "accuracy_sum": (c > r).to(c.dtype).sum(), "margin_sum": (c - r).sum(), "reward_sum": both.sum(),
                "min_reward": both.min() if both.numel() else inf, "max_reward": both.max() if both.numel() else -inf}


def reward_model_losses(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, *,
                        margin: torch.Tensor | None = None,
                        center_rewards_coefficient: float | None = None) -> RewardModelOutput:
    """Each pair's Bradley-Terry term as TRL 1.16's ``RewardTrainer`` computes it (reward_trainer.py 788-795):
    ``-log sigma(r_c - r_r - margin)`` (``margin``: the dataset's ``[pairs]`` column, TRL makes it float32; none:
    0), plus ``center_rewards_coefficient (r_c + r_r)^2`` when that is not ``None``. TRL's loss is the mean over
    the batch's pairs (TRL takes the two means separately and adds them: equal but for rounding)."""
    diff = chosen_rewards - rejected_rewards
    if margin is not None:
        diff = diff - margin
    losses = -F.logsigmoid(diff)
    if center_rewards_coefficient is not None:
        losses = losses + center_rewards_coefficient * (chosen_rewards + rejected_rewards) ** 2
    return RewardModelOutput(losses, chosen_rewards.detach(), rejected_rewards.detach())


def combine_metric_sums(parts: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Micro-batches' (or ranks') ``metric_sums`` combined: keys starting ``min_`` by minimum, ``max_`` by
    maximum, all others by addition."""
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for k, v in part.items():
            if k not in out:
                out[k] = v
            elif k.startswith("min_"):
                out[k] = torch.minimum(out[k], v)
            elif k.startswith("max_"):
                out[k] = torch.maximum(out[k], v)
            else:
                out[k] = out[k] + v
    return out


def reward_model_metrics(sums: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """TRL 1.16's reward-model metrics of one batch (reward_trainer.py 802-815) from combined
    :meth:`RewardModelOutput.metric_sums`: ``min_reward``, ``mean_reward``, ``max_reward`` over every chosen and
    rejected reward; ``accuracy``, the fraction of pairs with ``r_c > r_r`` (strict); ``margin``, the mean of ``r_c -
    r_r`` (the dataset's margin not subtracted). TRL averages ``accuracy`` and ``margin`` per process and then over
    processes (equal to these when processes hold equally many pairs). Not here: ``num_tokens`` (cumulative
    attention-mask tokens)."""
    s = {k: float(v) for k, v in sums.items()}
    n = s["count/pairs"]
    return {"min_reward": s["min_reward"], "mean_reward": s["reward_sum"] / (2 * n), "max_reward": s["max_reward"],
            "accuracy": s["accuracy_sum"] / n, "margin": s["margin_sum"] / n}
