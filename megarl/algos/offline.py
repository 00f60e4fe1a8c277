"""Offline objectives: what one optimizer step of supervised fine-tuning, DPO or reward-model training minimises,
computed micro-batch by micro-batch (issue #44).

An objective is a frozen dataclass that crosses to the workers as an argument. The trained role computes its
model's outputs for a micro-batch (a language model's per-token log-probs and entropies, or a scalar head's value
at each row's last real token) and the objective turns them into that micro-batch's share of the global batch's
loss and metrics, normalised by :class:`Counts` of the whole batch (every micro-batch, every data-parallel rank),
so that the engine's sums over micro-batches and ranks are the batch's values, however the batch is split. Their
numbers are TRL 1.16's trainers' (``SFTTrainer``, ``DPOTrainer``, ``RewardTrainer``) on one process with the same
batch, and so are the metrics' names.

Rows: right-padded ``input_ids``/``attention_mask``; ``response_mask`` marks the tokens whose log-prob counts
(token-aligned: entry ``i`` is token ``i``'s); ``sample_mask`` is 1 on real rows (0 on the idle micro-batches of
expert parallelism). Preference rows come in pairs, chosen then rejected (rows ``2k``, ``2k + 1``): ``group = 2``
keeps each pair in one micro-batch.

Must not import: torch.distributed, megatron, Ray, vLLM, or any megarl layer above ``algos``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Protocol

import torch

from megarl.algos.preference import (
    DPOLoss,
    dpo_losses,
    kto_losses,
    kto_metrics,
    reward_model_losses,
    reward_model_metrics,
)
from megarl.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Counts:
    """The whole batch's counts (every data-parallel rank's shard)."""

    tokens: float  # counted tokens (``response_mask``)
    rows: float  # real rows (``sample_mask``)

    @staticmethod
    def of(response_mask: torch.Tensor, sample_mask: torch.Tensor) -> torch.Tensor:
        """This shard's counts as one float64 tensor, to all-reduce over the data-parallel ranks."""
        return torch.stack([response_mask.double().sum(), sample_mask.double().sum()])


def _report(terms: dict[str, float]) -> dict[str, float]:
    return terms


class LMObjective(Protocol):
    """An objective on a language model's per-token log-probs (temperature 1) and entropies."""

    group: ClassVar[int]  # consecutive rows that must share a micro-batch

    def loss(self, log_probs: torch.Tensor, entropy: torch.Tensor, mb: dict[str, torch.Tensor],
             counts: Counts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...

    def report(self, terms: dict[str, float]) -> dict[str, float]:
        """The step's metrics from the loss's terms summed over micro-batches and ranks (most: as they are)."""
        ...


class ScalarObjective(Protocol):
    """An objective on a scalar head's value at each row's last real token."""

    group: ClassVar[int]

    def loss(self, scores: torch.Tensor, mb: dict[str, torch.Tensor],
             counts: Counts) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...

    def extremes(self) -> dict[str, str]: ...

    def report(self, terms: dict[str, float]) -> dict[str, float]: ...


def _sequences(log_probs: torch.Tensor, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A micro-batch's counted-token mask [b, s], real-row mask [b] and each row's summed log-prob [b]."""
    mask = mb["response_mask"].to(log_probs.dtype)
    return mask, mb["sample_mask"].to(log_probs.dtype), (log_probs * mask).sum(-1)


def _sums_only(terms: dict[str, float]) -> dict[str, float]:
    """The loss terms that are sums for a report to finish (``*_sum``, ``count/*``), taken out of ``terms``."""
    return {k: terms.pop(k) for k in list(terms) if k.endswith("_sum") or k.startswith("count/")}


@dataclasses.dataclass(frozen=True)
class SFTObjective:
    """Supervised fine-tuning: the negative log-likelihood of the counted tokens, averaged over every counted token
    of the batch (TRL's ``SFTTrainer`` with ``loss_type="nll"``: the sum over the batch's label tokens divided by
    their number, ``num_items_in_batch``). Metrics: ``entropy`` (token mean over the counted tokens)."""

    group: ClassVar[int] = 1

    def loss(self, log_probs, entropy, mb, counts):
        mask = mb["response_mask"].to(log_probs.dtype) * mb["sample_mask"].to(log_probs.dtype)[:, None]
        loss = -(log_probs * mask).sum() / counts.tokens
        return loss, {"entropy": (entropy.detach() * mask).sum() / counts.tokens}

    report = staticmethod(_report)


@dataclasses.dataclass(frozen=True)
class DPOObjective:
    """DPO and its variants (:func:`megarl.algos.preference.dpo_losses`) on pairs of rows (chosen, rejected), with
    the reference's sequence log-probs in ``ref_logps`` [B]. A pair's log-prob is the sum over its counted tokens;
    IPO's log-ratios are each divided by the response's token count (TRL's length-normalised IPO). Loss: the mean
    over the batch's pairs. Metrics as TRL names them (means over the pairs): ``rewards/chosen``,
    ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins`` (the implicit rewards ``beta (pi - ref)``),
    ``logps/chosen``, ``logps/rejected``, and ``entropy`` (token mean over every counted token)."""

    beta: float = 0.1  # the KL regularisation's strength (IPO: its tau)
    loss_type: DPOLoss = DPOLoss.SIGMOID  # sigmoid (DPO), robust, hinge (RSO), ipo
    label_smoothing: float = 0.0  # robust only (TRL 1.16: the sigmoid loss has none)
    group: ClassVar[int] = 2

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ConfigError(f"offline.dpo.beta must be > 0, found {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"offline.dpo.label_smoothing must lie in [0, 0.5), found {self.label_smoothing}")
        if self.label_smoothing and self.loss_type is not DPOLoss.ROBUST:
            raise ConfigError(f"offline.dpo.label_smoothing applies to the robust loss only (TRL 1.16's "
                              f"{self.loss_type.value} has none); set it to 0 or loss_type to robust")

    def loss(self, log_probs, entropy, mb, counts):
        mask, real, logps = _sequences(log_probs, mb)
        ref = mb["ref_logps"].to(logps.dtype)
        pair_real = real.view(-1, 2)[:, 0]
        pairs = counts.rows / 2
        chosen, rejected = logps.view(-1, 2).unbind(-1)
        ref_chosen, ref_rejected = ref.view(-1, 2).unbind(-1)
        lengths = {}
        if self.loss_type is DPOLoss.IPO:  # each response's log-ratio per completion token (TRL's IPO)
            lengths = dict(zip(("chosen_lengths", "rejected_lengths"), mask.sum(-1).view(-1, 2).unbind(-1),
                               strict=True))
        out = dpo_losses(chosen, rejected, ref_chosen, ref_rejected, beta=self.beta, loss=self.loss_type,
                         label_smoothing=self.label_smoothing, **lengths)
        loss = (out.losses * pair_real).sum() / pairs
        c = self.beta * (chosen - ref_chosen).detach()
        r = self.beta * (rejected - ref_rejected).detach()

        def mean(x):  # this micro-batch's share of the mean over the batch's pairs
            return (x * pair_real).sum() / pairs

        return loss, {"rewards/chosen": mean(c), "rewards/rejected": mean(r),
                      "rewards/accuracies": mean((c > r).to(c.dtype)), "rewards/margins": mean(c - r),
                      "logps/chosen": mean(chosen.detach()), "logps/rejected": mean(rejected.detach()),
                      "entropy": (entropy.detach() * mask * real[:, None]).sum() / counts.tokens}

    report = staticmethod(_report)


@dataclasses.dataclass(frozen=True)
class BradleyTerryObjective:
    """Reward-model training (TRL's ``RewardTrainer``): each pair's ``-log sigma(r_chosen - r_rejected - margin)``
    (``margin`` [B] when the data has the column), averaged over the pairs, plus ``center_rewards_coefficient`` times
    the mean of ``(r_chosen + r_rejected)^2`` (Eisenstein et al. 2023). Metrics as TRL names them: ``accuracy``,
    ``margin`` (means over the pairs), ``mean_reward`` (over every row), ``min_reward`` and ``max_reward``
    (extremes: reduced by min / max)."""

    center_rewards_coefficient: float | None = None  # e.g. 0.01; null: no centering term
    group: ClassVar[int] = 2

    def loss(self, scores, mb, counts):
        real = mb["sample_mask"].view(-1, 2)[:, 0] > 0  # the real pairs (none in an idle micro-batch)
        chosen, rejected = (x[real] for x in scores.view(-1, 2).unbind(-1))
        margin = mb["margin"].to(scores.dtype).view(-1, 2)[:, 0][real] if "margin" in mb else None
        out = reward_model_losses(chosen, rejected, margin=margin,
                                  center_rewards_coefficient=self.center_rewards_coefficient)
        return out.losses.sum() / (counts.rows / 2), out.metric_sums()

    def extremes(self) -> dict[str, str]:
        return {"min_reward": "min", "max_reward": "max"}

    @staticmethod
    def report(terms: dict[str, float]) -> dict[str, float]:
        sums = _sums_only(terms)
        extremes = {k: terms.pop(k) for k in ("min_reward", "max_reward")}
        return terms | reward_model_metrics(sums | extremes)


@dataclasses.dataclass(frozen=True)
class KTOObjective:
    """KTO (Ethayarajh et al. 2024; TRL's ``KTOTrainer``, :func:`megarl.algos.preference.kto_losses`) on unpaired
    rows: ``label`` [B] (1: desirable), the reference's sequence log-probs ``ref_logps`` [B] and the batch's KL
    estimate ``kto_kl`` [B] (one value, from the mismatched prompt/completion rows: :func:`kto_kl`). Loss: the mean
    of every row's weighted term over the batch's rows. Metrics as TRL names them: ``kl``, ``rewards/chosen``,
    ``logps/chosen`` (means over the desirable rows, when the batch has any), the ``rejected`` ones likewise,
    ``rewards/margins`` (when it has both), ``entropy``."""

    beta: float = 0.1  # the KL regularisation's strength
    desirable_weight: float = 1.0  # lambda_D: weight of a desirable row's term
    undesirable_weight: float = 1.0  # lambda_U: weight of an undesirable row's term
    group: ClassVar[int] = 1

    def __post_init__(self) -> None:
        if not self.beta > 0 or self.desirable_weight < 0 or self.undesirable_weight < 0:
            raise ConfigError(f"offline.kto needs beta > 0 and weights >= 0, found beta={self.beta}, "
                              f"desirable_weight={self.desirable_weight}, undesirable_weight={self.undesirable_weight}")

    def loss(self, log_probs, entropy, mb, counts):
        mask, real, logps = _sequences(log_probs, mb)
        keep = real > 0  # the real rows (none in an idle micro-batch)
        out = kto_losses(logps[keep], mb["ref_logps"].to(logps.dtype)[keep], mb["label"][keep] > 0.5,
                         mb["kto_kl"][0], beta=self.beta, desirable_weight=self.desirable_weight,
                         undesirable_weight=self.undesirable_weight)
        return out.losses.sum() / counts.rows, out.metric_sums() | {
            "kl": (mb["kto_kl"].to(logps.dtype) * real).sum() / counts.rows,
            "entropy": (entropy.detach() * mask * real[:, None]).sum() / counts.tokens}

    @staticmethod
    def report(terms: dict[str, float]) -> dict[str, float]:
        sums = _sums_only(terms)
        return terms | kto_metrics(sums, terms["kl"])
