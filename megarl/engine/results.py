"""What one optimizer step reports back to the driver (pure: the driver imports it without megatron-core)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One optimizer step over a mini-batch (every DP rank's shard): the loss, the optimizer's state and the
    loss function's named terms, each a global token mean (e.g. ``pg_loss``, ``entropy``, ``clip_frac``;
    a term whose name has a ``/``, like ``rollout/logprob_abs_diff``, names its own metric namespace)."""

    loss: float
    grad_norm: float  # NaN when the step was skipped
    lr: float
    step_skipped: bool  # NaN/inf loss or gradients: no update was applied
    skipped_steps: int  # skipped so far in this run
    terms: dict[str, float] = dataclasses.field(default_factory=dict)

    def metrics(self, prefix: str) -> dict[str, float]:
        """Flat metrics, keys under ``prefix`` (e.g. ``actor/``) unless a term names its namespace."""
        own = {"loss": self.loss, "grad_norm": self.grad_norm, "lr": self.lr, "step_skipped": float(self.step_skipped),
               "skipped_steps": float(self.skipped_steps)}
        return {(k if "/" in k else prefix + k): v for k, v in (own | self.terms).items()}


def mean_metrics(results: list[StepResult], prefix: str) -> dict[str, float]:
    """Means over several steps' metrics (an update of several mini-batches and epochs)."""
    per_step = [r.metrics(prefix) for r in results]
    return {k: sum(m[k] for m in per_step) / len(per_step) for k in per_step[0]}
