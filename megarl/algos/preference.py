"""Preference losses (issue #44, first piece): DPO and its common variants over sequence log-probabilities.

Given each pair's policy and reference log-probability of the chosen and the rejected response (summed over the
response's tokens; IPO's are averaged over them, as TRL's ``DPOTrainer`` does for ``loss_type="ipo"``), with
``logits = (pi_chosen - pi_rejected) - (ref_chosen - ref_rejected)``:

* ``sigmoid`` (DPO, Rafailov et al. 2023; conservative DPO with ``label_smoothing``):
  ``-(1 - eps) log sigma(beta logits) - eps log sigma(-beta logits)``;
* ``robust`` (robust DPO, Chowdhury et al. 2024): ``(-(1 - eps) log sigma(beta logits) + eps log sigma(-beta
  logits)) / (1 - 2 eps)``;
* ``hinge`` (RSO, Liu et al. 2023): ``max(0, 1 - beta logits)``;
* ``ipo`` (Azar et al. 2023): ``(logits - 1 / (2 beta))^2``.

The implicit rewards are ``beta (pi - ref)`` of each response; the metrics are named as TRL names them
(``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``,
``logps/rejected``). Pure: tensors in, tensors out.
"""

from __future__ import annotations

import dataclasses
import enum

import torch
import torch.nn.functional as F  # noqa: N812


class DPOLoss(enum.Enum):
    SIGMOID = "sigmoid"
    ROBUST = "robust"
    HINGE = "hinge"
    IPO = "ipo"


@dataclasses.dataclass(frozen=True)
class PreferenceOutput:
    losses: torch.Tensor  # [pairs], differentiable in the policy's log-probs
    chosen_rewards: torch.Tensor  # [pairs] beta (pi_chosen - ref_chosen), detached
    rejected_rewards: torch.Tensor  # [pairs] beta (pi_rejected - ref_rejected), detached

    def metrics(self, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor) -> dict[str, float]:
        """TRL's names: the means over the pairs."""
        c, r = self.chosen_rewards, self.rejected_rewards
        return {"loss": self.losses.mean().item(), "rewards/chosen": c.mean().item(),
                "rewards/rejected": r.mean().item(), "rewards/accuracies": (c > r).float().mean().item(),
                "rewards/margins": (c - r).mean().item(), "logps/chosen": chosen_logps.detach().mean().item(),
                "logps/rejected": rejected_logps.detach().mean().item()}


def dpo_losses(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
               ref_rejected_logps: torch.Tensor, *, beta: float = 0.1, loss: DPOLoss = DPOLoss.SIGMOID,
               label_smoothing: float = 0.0) -> PreferenceOutput:
    """Each pair's loss by ``loss`` (module docstring), and the implicit rewards."""
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), found {label_smoothing}")
    if label_smoothing and loss not in (DPOLoss.SIGMOID, DPOLoss.ROBUST):
        raise ValueError(f"label_smoothing applies to the sigmoid and robust losses, not {loss.value}")
    logits = (chosen_logps - rejected_logps) - (ref_chosen_logps - ref_rejected_logps)
    eps = label_smoothing
    if loss is DPOLoss.SIGMOID:
        losses = -F.logsigmoid(beta * logits) * (1 - eps) - F.logsigmoid(-beta * logits) * eps
    elif loss is DPOLoss.ROBUST:
        losses = (-F.logsigmoid(beta * logits) * (1 - eps) + F.logsigmoid(-beta * logits) * eps) / (1 - 2 * eps)
    elif loss is DPOLoss.HINGE:
        losses = torch.relu(1 - beta * logits)
    else:
        losses = (logits - 1 / (2 * beta)) ** 2
    return PreferenceOutput(losses, beta * (chosen_logps - ref_chosen_logps).detach(),
                            beta * (rejected_logps - ref_rejected_logps).detach())
