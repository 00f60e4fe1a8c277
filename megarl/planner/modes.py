"""Step time of the three schedules a split placement allows, predicted from measured stage times
(issue #23 item 7; docs/planner.md §8).

Pure module: arithmetic on seconds (no torch, no process group, no Ray). It predicts the ideal step
(no stragglers, no queueing, the driver never the bottleneck) from the times one step's stages took
when run one after the other (``timing/<stage>_s`` in metrics.jsonl, or ``tools/benchmark.py``):

* ``gen_s``: generation on the rollout engines (``timing/rollout_s``);
* ``reward_s``: the driver's scoring of what was generated (``timing/reward_s``); it belongs to the
  generation side, so in the overlapped modes it overlaps training too;
* ``train_s``: everything on the training pool: log-probs, reference, values, updates;
* ``sync_s``: one weight push (``timing/weight_sync_s``). Both pools take part in it (the training ranks
  send, the rollout ranks receive), and neither computes meanwhile.

With ``g = gen_s + reward_s``, ``t = train_s``, ``s = sync_s`` and pushes every ``K`` updates:

    sync          step = g + t + s            generation, training, sync in turn (colocated or split)
    one_step_off  step = max(g, t) + s        step k+1 generates while step k trains; push after each update
    async         step = max(g, t) + s / K    the rollout pool generates on; push every K updates

``async`` is never faster than either side's own cycle, ``g + s/K`` on the rollout pool and ``t + s/K``
on the trainer, and the formula is exactly the larger of the two; at K = 1 it equals ``one_step_off``
(the modes then differ in staleness, not in time). Busy share: the part of the step a pool computes,
``train_s / step`` for the training pool and ``gen_s / step`` for the rollout pool; colocated, one pool
does both, ``(gen_s + train_s) / step``.
"""

from __future__ import annotations

import dataclasses
import enum
import math

from megarl.errors import ConfigError


class Mode(enum.Enum):
    SYNC = "sync"  # generation, then training, then the weight sync, in turn
    ONE_STEP_OFF = "one_step_off"  # step k+1's generation overlaps step k's training; push after each update
    ASYNC = "async"  # the rollout pool generates continuously; weights pushed every K updates


@dataclasses.dataclass(frozen=True)
class StageTimes:
    """Measured seconds of one step's stages, run in turn (see the module docstring)."""

    gen_s: float
    train_s: float
    sync_s: float
    reward_s: float = 0.0

    def __post_init__(self) -> None:
        values = dataclasses.asdict(self)
        if not all(math.isfinite(v) and v >= 0 for v in values.values()):
            raise ConfigError(f"stage times must be finite and >= 0 seconds, found {values}.")
        if self.gen_s == 0 or self.train_s == 0:
            raise ConfigError(f"generation and training must take time (measured > 0 s), found gen {self.gen_s} s, "
                              f"train {self.train_s} s.")


@dataclasses.dataclass(frozen=True)
class StepPrediction:
    mode: Mode
    split: bool  # two pools (False: colocated, one pool does everything)
    push_every: int  # updates between weight pushes (1 except in async)
    step_s: float
    train_busy: float  # share of the step the training pool computes
    rollout_busy: float  # share of the step the rollout pool computes (colocated: the same pool, same share)


def predict_step(times: StageTimes, mode: Mode, *, split: bool = True, push_every: int = 1) -> StepPrediction:
    """The ideal step time and pool busy shares of ``mode`` (formulas in the module docstring)."""
    if not isinstance(push_every, int) or push_every < 1:
        raise ConfigError(f"push_every must be a positive integer (updates between weight pushes), found "
                          f"{push_every!r}.")
    if mode is not Mode.ASYNC and push_every != 1:
        raise ConfigError(f"{mode.value} pushes the weights after every update; push_every={push_every} applies to "
                          "async only.")
    if not split and mode is not Mode.SYNC:
        raise ConfigError(f"{mode.value} overlaps generation with training, which needs the rollout engines on a "
                          "pool of their own (split placement); colocated, the only mode is sync.")
    g, t, s = times.gen_s + times.reward_s, times.train_s, times.sync_s
    step = g + t + s if mode is Mode.SYNC else max(g, t) + s / push_every  # push_every is 1 for one_step_off
    if split:
        train_busy, rollout_busy = t / step, times.gen_s / step
    else:
        train_busy = rollout_busy = (times.gen_s + t) / step
    return StepPrediction(mode, split, push_every, step, train_busy, rollout_busy)


def predict_modes(times: StageTimes, *, split: bool = True, push_every: int = 1) -> list[StepPrediction]:
    """Every mode the placement allows (colocated: sync only; split: all three, async pushing every
    ``push_every`` updates), in :class:`Mode` order."""
    if not split and push_every != 1:
        raise ConfigError(f"push_every={push_every} applies to async, which needs split placement; colocated, the "
                          "weights are pushed after every update.")
    modes = list(Mode) if split else [Mode.SYNC]
    return [predict_step(times, m, split=split, push_every=push_every if m is Mode.ASYNC else 1) for m in modes]
