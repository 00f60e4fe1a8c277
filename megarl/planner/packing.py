"""Padding of the engine's micro-batches, padded against packed, for given sequence lengths or a response-length
distribution (docs/planner.md §12).

The engine (``MegatronEngine._micro_batches``) forms each rank's micro-batches with
:func:`megarl.engine.micro_batches.plan`, longest sequences first; this module runs the same plan and prices each
micro-batch as the engine lays it out:

* padded (``packing: false``): ``rows x width``, the width its longest row rounded up to ``multiple`` (the TP size
  with sequence parallelism, else 1);
* packed (``packing: true``, the default): every sequence's extent its length rounded up to ``align`` (``2 cp``, times
  the TP size with sequence parallelism; 1 without context parallelism), the last extent padded so that the stream is
  a multiple of ``multiple`` (without context parallelism only).

The padding fraction of a pass is ``1 - real tokens / tokens computed`` over its micro-batches, what the engine
reports as ``last_padding_fraction`` (for the rank's last pass). A :class:`ResponseLengths` distribution stands for a
batch by its quantiles: ``n`` sequences of a prompt and the response lengths at ``(i + 1/2) / n``, i = 0 .. n-1, the
batch a large sample's sorted lengths approach. Not counted: prompt lengths that vary (they add padding without
packing), expert parallelism's extra micro-batches (``micro_batches.spread``) and idle ones.

Pure arithmetic on lengths: torch only through the pure micro-batch plan; no process group, no megatron-core.
"""

from __future__ import annotations

import dataclasses
import math

from megarl.engine import micro_batches
from megarl.engine.micro_batches import UNALIGNED, Alignment
from megarl.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class PassTokens:
    """The tokens of one pass's micro-batches: real ones, and those the model computes padded and packed."""

    real: int
    padded: int  # computed without packing
    packed: int  # computed with packing
    padded_micro_batches: int
    packed_micro_batches: int
    largest_packed: int  # the fullest packed micro-batch's computed tokens (what the activations are sized by)

    def fraction(self, packed: bool) -> float:
        """Padding fraction: 1 - real / computed."""
        computed = self.packed if packed else self.padded
        return 1.0 - self.real / computed if computed else 0.0

    def __add__(self, other: PassTokens) -> PassTokens:
        return PassTokens(self.real + other.real, self.padded + other.padded, self.packed + other.packed,
                          self.padded_micro_batches + other.padded_micro_batches,
                          self.packed_micro_batches + other.packed_micro_batches,
                          max(self.largest_packed, other.largest_packed))


def padded_tokens(lengths: list[int], multiple: int = 1) -> int:
    """Tokens a padded micro-batch of rows of ``lengths`` computes: rows x the longest, rounded up to ``multiple``."""
    return len(lengths) * Alignment(multiple=multiple).width(max(lengths))


def packed_tokens(lengths: list[int], alignment: Alignment = UNALIGNED) -> int:
    """Tokens a packed micro-batch of ``lengths`` computes (``Packing.of``'s stream: aligned extents, at least one
    ``align`` each, the stream a multiple of ``multiple``)."""
    return sum(alignment.extents(lengths))


def pass_tokens(lengths: list[int], max_tokens: int, max_size: int, alignment: Alignment = UNALIGNED) -> PassTokens:
    """One rank's pass over rows of ``lengths``: the engine's micro-batch plan padded and packed, and their tokens."""
    if not lengths or min(lengths) < 1:
        raise ValueError(f"a pass needs rows of >= 1 token, found lengths {lengths[:8]}")
    padded = micro_batches.plan(lengths, max_tokens, max_size)
    packed = micro_batches.plan(lengths, max_tokens, max_size, packed=True)
    per_packed = [packed_tokens([lengths[i] for i in rows], alignment) for rows in packed]
    return PassTokens(real=sum(lengths),
                      padded=sum(padded_tokens([lengths[i] for i in rows], alignment.multiple) for rows in padded),
                      packed=sum(per_packed), padded_micro_batches=len(padded), packed_micro_batches=len(packed),
                      largest_packed=max(per_packed))


@dataclasses.dataclass(frozen=True)
class ResponseLengths:
    """Response lengths of a step: a share ``at_max`` runs to the limit ``high`` (cut at ``max_new_tokens``), the
    others stop early, uniformly on ``low .. high``."""

    low: int
    high: int
    at_max: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high or not 0.0 <= self.at_max <= 1.0:
            raise ConfigError(f"response lengths need 1 <= low <= high and 0 <= at_max <= 1, found low {self.low}, "
                              f"high {self.high}, at_max {self.at_max}.")

    @classmethod
    def from_mean(cls, high: int, mean: float, low: int = 1) -> ResponseLengths:
        """The distribution of mean ``mean`` on ``low .. high``: uniform on ``low .. high`` with the share at the limit
        that lifts its mean to ``mean`` when that is at least the midpoint; else uniform on ``low .. 2 mean - low``
        (every response stops early)."""
        if not low <= mean <= high:
            raise ConfigError(f"a mean response length of {mean} is outside {low} .. {high}: give a mean between the "
                              "shortest and the longest response.")
        mid = (low + high) / 2
        if mean >= mid:
            return cls(low, high, 0.0 if high == mid else (mean - mid) / (high - mid))
        return cls(low, max(low, round(2 * mean - low)))

    @property
    def mean(self) -> float:
        return self.at_max * self.high + (1 - self.at_max) * (self.low + self.high) / 2

    def quantile(self, u: float) -> int:
        """The length at quantile ``u`` in [0, 1): the discrete uniform ``low .. high`` below ``1 - at_max``, then
        ``high``."""
        early = 1.0 - self.at_max
        if u >= early:
            return self.high
        return min(self.high, self.low + math.floor(u / early * (self.high - self.low + 1)))

    def quantiles(self, n: int) -> list[int]:
        """``n`` lengths at the quantiles ``(i + 1/2) / n``: a batch of ``n`` typical responses."""
        return [self.quantile((i + 0.5) / n) for i in range(n)]


def expected_padding(responses: ResponseLengths, *, prompt_tokens: int, sequences: int, max_tokens: int,
                     max_size: int, alignment: Alignment = UNALIGNED) -> PassTokens:
    """A rank's pass over ``sequences`` rows of ``prompt_tokens`` + the distribution's quantile responses."""
    if sequences < 1 or prompt_tokens < 0:
        raise ConfigError(f"need >= 1 sequence per rank and >= 0 prompt tokens, found {sequences}, {prompt_tokens}.")
    return pass_tokens([prompt_tokens + r for r in responses.quantiles(sequences)], max_tokens, max_size, alignment)
