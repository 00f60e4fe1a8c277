"""Trainer callbacks: user code that observes (or records) the run at stage boundaries.

A callback is any object with these two methods; the trainer calls them in order of registration.
``on_stage_end`` receives the step's working :class:`Batch` after ``rollout``, ``reward``,
``advantages`` and ``step`` (after the updates), so a callback can log samples, export data or
raise to stop the run; with ReMax also ``baseline``: the prompt-indexed batch of greedy responses
(row ``i`` is prompt ``i``'s); and ``validation``: the scored validation samples. Callbacks must not
modify the batch. Pure protocol: no imports above ``data``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from megarl.data.batch import Batch

STAGES = ("rollout", "baseline", "reward", "advantages", "step", "validation")


@runtime_checkable
class Callback(Protocol):
    def on_stage_end(self, stage: str, step: int, batch: Batch) -> None: ...

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None: ...
