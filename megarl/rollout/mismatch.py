"""How far the rollout engine's log-probs are from the training model's on the same tokens.

The two engines differ in kernels, dtype and (later) weight version, so their log-probs of a sampled
token differ; a large mean gap means the weight sync or the name mapping is broken. The measure is
``rollout/logprob_abs_diff``: the mean ``|training - rollout|`` log-prob over response tokens. Pure module.
"""

from __future__ import annotations

import torch

from megarl.errors import MegarlError
from megarl.rollout.config import LoRASync


class RolloutMismatchError(MegarlError):
    """Rollout log-probs disagree with the training model's: the weight sync or the mapping is broken."""


def logprob_abs_diff(training: torch.Tensor, rollout: torch.Tensor, response_mask: torch.Tensor) -> float:
    """Mean |training - rollout| log-prob over response tokens (float64)."""
    mask = response_mask.to(torch.float64)
    return float(((training.double() - rollout.double()).abs() * mask).sum() / mask.sum().clamp(min=1))


def sync_suspect(lora_sync: LoRASync) -> str:
    """What else a gap right after a sync points at, by how the sync works."""
    if lora_sync is LoRASync.ADAPTER:
        return (" With rollout.engine.lora_sync=adapter: vLLM generated with another adapter than the version just "
                "synced (a stale LoRARequest, e.g. a name or id reused across versions, which vLLM keeps serving, or "
                "none passed to generate), or the adapter's peft layout is broken.")
    return ""


def mismatch_error(diff: float, limit: float, lora_sync: LoRASync = LoRASync.MERGED) -> RolloutMismatchError:
    return RolloutMismatchError(
        f"rollout log-probs differ from the training model's by {diff:.3g} on average (limit {limit}); the "
        "weight sync or the name mapping is broken, or the rollout dtype is too coarse for this limit."
        + sync_suspect(lora_sync)
    )
