"""Driver-side watch over the reward functions while they score: the columns they need, and scores that never vary.

:class:`RewardMonitor` is the state; the trainer's reward stage holds one and calls it around
:func:`~megarl.rewards.base.score_samples` for each named function:

- :meth:`RewardMonitor.check_columns` before scoring: the first time a function meets a set of columns,
  :meth:`~megarl.rewards.conventions.UserReward.check_columns` raises a ConfigError for a column it needs
  that no row of the batch has (before any update trains on a zero reward) and its warnings are logged once.
- :meth:`RewardMonitor.observe` after scoring: a function that gave every sample the same score over its
  first :data:`CONSTANT_BATCHES` scored batches gets ONE warning that names it, the value and the likely
  causes. A batch counts when at least one of its samples was scored (samples that failed and got
  ``error_score`` are left out: they are reported apart); every call of the reward stage is a batch (a
  training step's round, a validation pass, a ReMax baseline). A function whose scores once differ is not
  watched any more. A task too hard for the initial policy also scores 0 everywhere: the warning says so.

Pure module: no Ray, no torch.distributed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from megarl.rewards.base import ScoreInfo, describe
from megarl.rewards.conventions import UserReward

logger = logging.getLogger(__name__)

CONSTANT_BATCHES = 3  # scored batches of identical scores before the warning


@dataclasses.dataclass
class _Watch:
    batches: int = 0  # batches scored so far, all with the one value
    samples: int = 0
    value: float | None = None
    done: bool = False  # warned, or the scores differed


class RewardMonitor:
    """Column checks and the constant-score warning for the named reward functions (see the module)."""

    def __init__(self, constant_batches: int = CONSTANT_BATCHES) -> None:
        self.constant_batches = constant_batches
        self._checked: set[tuple[str, frozenset[str]]] = set()
        self._columns: dict[str, list[str]] = {}  # name -> the columns of the rows it last scored
        self._watch: dict[str, _Watch] = {}

    def check_columns(self, name: str, fn: Any, rows: Sequence[Mapping[str, Any]]) -> None:
        """Raise a ConfigError if ``fn`` cannot read what it needs from rows like these (once per column set)."""
        columns = frozenset(k for row in rows for k in row)
        self._columns[name] = sorted(columns, key=str)
        if (name, columns) in self._checked:
            return
        if isinstance(fn, UserReward):  # built-ins name a missing ground-truth column on each sample
            for warning in fn.check_columns(columns):
                logger.warning("%s", warning)
        self._checked.add((name, columns))

    def observe(self, name: str, spec: str | None, fn: Any, scores: torch.Tensor, info: ScoreInfo) -> bool:
        """Track ``fn``'s scores of one batch; True when this call logged the constant-score warning."""
        watch = self._watch.setdefault(name, _Watch())
        failed = set(info.failed)
        values = [v for i, v in enumerate(scores.tolist()) if i not in failed]
        if watch.done or not values:
            return False
        first = values[0] if watch.value is None else watch.value
        if any(v != first for v in values):
            watch.done = True
            return False
        watch.value, watch.batches, watch.samples = first, watch.batches + 1, watch.samples + len(values)
        if watch.batches < self.constant_batches:
            return False
        watch.done = True
        logger.warning("%s", self._constant_message(name, spec, fn, watch))
        return True

    def _constant_message(self, name: str, spec: str | None, fn: Any, watch: _Watch) -> str:
        label = repr(spec) if name == "function" else f"{name!r} ({spec!r})"
        call = fn.call_text() if isinstance(fn, UserReward) else f"{describe(fn)}(prompt, response, row)"
        return (f"reward function {label} gave every one of the {watch.samples} samples of its first {watch.batches} "
                f"scored batches the same score {watch.value:g}. Likely causes: a wrong calling convention (it is "
                f"called as {call}); a wrong column name (the rows have {self._columns.get(name, [])}); responses not "
                "in the format it parses (chat template, answer marker such as '####' or \\boxed{}). Equal scores give "
                "GRPO-style estimators zero advantages; if the task is only too hard for the initial policy yet, "
                "ignore this")
