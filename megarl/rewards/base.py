"""The reward-function contract, weighted combinations and the per-sample error policy.

Owns :class:`RewardFunction` (the one signature every scorer has), :class:`BatchRewardFunction` (a
scorer that also scores a whole batch in one call: TRL's batch style, see :mod:`megarl.rewards.conventions`),
:class:`WeightedReward`, and :func:`score_samples`, which runs a scorer over a batch of (prompt, response,
row) and turns it into a float32 tensor. Every failure is reported together with the sample that caused it: a raising
scorer, a non-numeric return value (``None``, a string, a bool) and a non-finite one (NaN, inf) are
all errors, never silently turned into a number. :class:`OnError` chooses between aborting
(``RAISE``) and scoring the sample with a fallback value that is counted and logged (``SCORE``).

Pure module: torch only. Must not import Ray, vLLM, torch.distributed or any megarl layer above
``rewards``.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from megarl.errors import ConfigError, MegarlError

logger = logging.getLogger(__name__)

_MAX_SHOWN_CHARS = 200  # prompt / response characters quoted in an error message


class RewardError(MegarlError):
    """A reward function failed on (or returned an unusable value for) a sample; the message names it."""


@runtime_checkable
class RewardFunction(Protocol):
    """Scores one response. ``row`` holds the dataset row's other columns (e.g. the ground truth)."""

    def __call__(self, prompt: str, response: str, row: Mapping[str, Any]) -> float: ...


@runtime_checkable
class BatchRewardFunction(Protocol):
    """A scorer whose :meth:`score_batch` returns one value per sample for a whole batch (a failure is the batch's)."""

    def __call__(self, prompt: str, response: str, row: Mapping[str, Any]) -> float: ...

    def score_batch(self, prompts: Sequence[str], responses: Sequence[str],
                    rows: Sequence[Mapping[str, Any]]) -> Sequence[Any]: ...


class OnError(enum.Enum):
    RAISE = "raise"  # abort the step with a RewardError naming the sample
    SCORE = "score"  # give the sample ``error_score``, count it and log the first failure


@dataclasses.dataclass(frozen=True)
class ScoreInfo:
    """What :func:`score_samples` saw besides the scores."""

    num_errors: int = 0
    first_error: str | None = None  # the first failure's message (sample, exception), if any
    failed: tuple[int, ...] = ()  # the samples that got error_score


def describe(fn: object) -> str:
    """A short human name for a scorer: a function's qualified name (an adapter's: its function's) or an
    object's class name."""
    fn = getattr(fn, "__wrapped__", fn)
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def as_score(value: object) -> float:
    """``value`` as a finite float; raises TypeError (not a number) or ValueError (NaN / inf).

    Accepts Python and numpy real numbers and one-element tensors. ``bool`` is rejected: a scorer that
    returns "correct?" should say which number that means."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"expected a real number, found a tensor of shape {tuple(value.shape)} ({value.dtype})")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"expected a real number (float or int), found {value!r} ({type(value).__name__})")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"expected a finite number, found {score}")
    return score


class WeightedReward:
    """``sum(weight * fn(prompt, response, row))`` over the terms; each term's value is checked. Terms are called
    per sample (a batch-style :class:`BatchRewardFunction` term with a batch of one)."""

    def __init__(self, terms: Sequence[tuple[RewardFunction, float]]) -> None:
        if not terms:
            raise ConfigError("WeightedReward needs at least one (function, weight) term, found none")
        for i, (fn, weight) in enumerate(terms):
            if not callable(fn):
                raise ConfigError(f"WeightedReward term {i}: expected a callable, found {fn!r}")
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
                raise ConfigError(
                    f"WeightedReward term {i} ({describe(fn)}): expected a finite weight, found {weight!r}"
                )
        self.terms = [(fn, float(weight)) for fn, weight in terms]

    def __call__(self, prompt: str, response: str, row: Mapping[str, Any]) -> float:
        total = 0.0
        for fn, weight in self.terms:
            value = fn(prompt, response, row)
            try:
                total += weight * as_score(value)
            except (TypeError, ValueError) as e:
                raise type(e)(f"term {describe(fn)}: {e}") from None
        return total

    def __repr__(self) -> str:
        return "WeightedReward(" + ", ".join(f"{describe(fn)}*{w:g}" for fn, w in self.terms) + ")"


def score_samples(
    fn: RewardFunction,
    prompts: Sequence[str],
    responses: Sequence[str],
    rows: Sequence[Mapping[str, Any]],
    on_error: OnError = OnError.RAISE,
    error_score: float = 0.0,
) -> tuple[torch.Tensor, ScoreInfo]:
    """Score every sample; returns ``(scores [n] float32, info)``.

    A sample whose scorer raises or returns a non-finite / non-numeric value is an error: with
    ``OnError.RAISE`` a :class:`RewardError` naming the sample (index, prompt, response, exception)
    is raised from the original exception; with ``OnError.SCORE`` it scores ``error_score``, is
    counted in ``info.num_errors`` and the first one is logged as a warning. A :class:`BatchRewardFunction`
    is called once for the batch; if that call fails, every sample has failed."""
    if not len(prompts) == len(responses) == len(rows):
        raise ValueError(f"need one prompt, response and row per sample, found {len(prompts)}, "
                         f"{len(responses)} and {len(rows)}")
    if not isinstance(on_error, OnError):
        raise ConfigError(f"on_error must be an OnError ({[m.value for m in OnError]}), found {on_error!r}")
    error_score = as_score(error_score)
    values: Sequence[Any] | None = None
    if isinstance(fn, BatchRewardFunction) and len(prompts):
        try:
            values = fn.score_batch(prompts, responses, rows)
        except Exception as e:
            where = f"the batch of {len(prompts)} samples, the first"
            message = _failure_message(fn, where, prompts[0], responses[0], e)
            if on_error is OnError.RAISE:
                raise RewardError(message + _HINT) from e
            return _all_failed(len(prompts), error_score, message)
    scores: list[float] = []
    failed: list[int] = []
    first_error = None
    for i, (prompt, response, row) in enumerate(zip(prompts, responses, rows, strict=True)):
        try:
            scores.append(as_score(fn(prompt, response, row) if values is None else values[i]))
        except Exception as e:
            message = _failure_message(fn, f"sample {i}", prompt, response, e)
            if on_error is OnError.RAISE:
                raise RewardError(message + _HINT) from e
            scores.append(error_score)
            failed.append(i)
            first_error = first_error or message
    if failed:
        _warn_failed(len(failed), len(scores), error_score, first_error)
    return torch.tensor(scores, dtype=torch.float32), ScoreInfo(len(failed), first_error, tuple(failed))


_HINT = "; set on_error to 'score' to give such samples error_score"


def _all_failed(n: int, error_score: float, message: str) -> tuple[torch.Tensor, ScoreInfo]:
    _warn_failed(n, n, error_score, message)
    return torch.full((n,), error_score, dtype=torch.float32), ScoreInfo(n, message, tuple(range(n)))


def _warn_failed(num_failed: int, n: int, error_score: float, first_error: str | None) -> None:
    logger.warning("%d of %d samples could not be scored and got %g; first: %s", num_failed, n, error_score,
                   first_error)


def _failure_message(fn: object, where: str, prompt: str, response: str, error: BaseException) -> str:
    return (f"reward function {describe(fn)} failed on {where} "
            f"(prompt={_clip(prompt)}, response={_clip(response)}): {type(error).__name__}: {error}")


def _clip(text: object) -> str:
    text = str(text)
    if len(text) <= _MAX_SHOWN_CHARS:
        return repr(text)
    return repr(text[:_MAX_SHOWN_CHARS]) + f"...(+{len(text) - _MAX_SHOWN_CHARS} chars)"
