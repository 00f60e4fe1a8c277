"""Shared primitives of the algorithm layer: masked reductions, whitening, loss aggregation, registry lookup.

Owns the meaning of a ``mask`` (shape of the token tensor, 1/True for response tokens that count,
0/False for prompt, padding and any other ignored position) and of the four loss-aggregation modes.
Every reduction here selects with the mask instead of multiplying by it, so NaN or garbage at masked
positions never leaks into a result. Nothing here synchronises with the device unless stated.

Must not import: torch.distributed, megatron, Ray, vLLM, or any other megarl layer except ``errors``.
A global batch split across micro-batches or data-parallel ranks is handled by passing a
:class:`LossNormalizer` computed over the whole global batch, never by a process group here.
"""

from __future__ import annotations

import difflib
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch

from megarl.errors import ConfigError

K = TypeVar("K", bound=enum.Enum)
V = TypeVar("V")


def as_member(enum_cls: type[K], key: K | str, what: str) -> K:
    """``key`` as an ``enum_cls`` member; a string must be a member's exact ``.value`` (as a YAML config holds)."""
    if isinstance(key, enum_cls):
        return key
    try:
        return enum_cls(key)
    except ValueError:
        raise _unknown(key, [m.value for m in enum_cls], what) from None


def lookup(registry: Mapping[K, V], key: K | str, enum_cls: type[K], what: str) -> V:
    """``registry[key]`` for an enum member or its exact value; an unknown key raises listing the valid ones."""
    valid = [k.value for k in registry]
    try:
        member = as_member(enum_cls, key, what)
    except ConfigError:
        raise _unknown(key, valid, what) from None
    if member not in registry:
        raise _unknown(key, valid, what)
    return registry[member]


def _unknown(key: object, valid: list[object], what: str) -> ConfigError:
    near = difflib.get_close_matches(str(getattr(key, "value", key)), [str(v) for v in valid], n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return ConfigError(f"unknown {what} {key!r}{hint}; valid {what}s: {valid}")


def _float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The mask as 0/1 in ``like``'s floating dtype (bool and float masks are both accepted)."""
    if mask.shape != like.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match tensor shape {tuple(like.shape)}")
    dtype = like.dtype if like.is_floating_point() else torch.get_default_dtype()
    return (mask != 0).to(dtype)


def zero_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` where counted, exactly 0 elsewhere; also blocks NaN/inf at masked positions from gradients."""
    return torch.where(mask != 0, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(x[i] for i where mask[i])`` over all elements (``dim=None``) or along ``dim``."""
    selected = zero_masked(x, mask)
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_count(mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Number of counted positions as a float64 tensor (exact far beyond 2**24 tokens), overall or along ``dim``."""
    counted = (mask != 0).to(torch.float64)
    return counted.sum() if dim is None else counted.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``masked_sum / count``; an empty selection (count 0) gives 0, not NaN."""
    m = _float_mask(mask, x)
    total = masked_sum(x, m, dim)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return total / count.clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None, unbiased: bool = True) -> torch.Tensor:
    """Variance over counted positions: ``sum((x - mean)^2) / (n - 1)`` (``n`` if not ``unbiased``).

    Fewer than two counted positions give variance 0 (the sum of squared deviations is 0 there), so
    the call never needs a host sync to check the count.
    """
    m = _float_mask(mask, x)
    mean = masked_mean(x, m, dim)
    centred = x - (mean if dim is None else mean.unsqueeze(dim))
    sq = masked_sum(centred * centred, m, dim)
    count = m.sum() if dim is None else m.sum(dim=dim)
    denom = count - 1.0 if unbiased else count
    return sq / denom.clamp(min=1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean and unbiased variance over all counted positions.

    With ``shift_mean=False`` the mean is added back (scale only). Masked positions are 0 in the
    result. This is the batch-wide advantage whitening of PPO/REINFORCE++ (as in verl and TRL).
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return zero_masked(whitened, mask)


class LossAggregation(enum.Enum):
    """How a ``[batch, response_len]`` loss matrix becomes a scalar (names as verl's ``loss_agg_mode``).

    With ``l`` the per-token loss, ``m`` the mask, ``n_i = sum_t m[i,t]``, ``N_tok = sum_i n_i`` and
    ``N_seq`` the number of sequences with ``n_i > 0``:

    - ``TOKEN_MEAN``:              ``sum_{i,t} m l / N_tok``        (every token weighs the same; DAPO)
    - ``SEQ_MEAN_TOKEN_SUM``:      ``sum_i (sum_t m l) / N_seq``
    - ``SEQ_MEAN_TOKEN_MEAN``:     ``sum_i (sum_t m l / n_i) / N_seq``  (original GRPO)
    - ``SEQ_MEAN_TOKEN_SUM_NORM``: ``sum_i (sum_t m l) / (N_seq * C)`` with a constant ``C``, usually the
      maximum response length (Dr. GRPO; TRL's ``dr_grpo`` loss). ``C`` must be given explicitly.
    """

    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"


@dataclass(frozen=True)
class LossNormalizer:
    """Denominators of :func:`aggregate_loss` measured over a whole global batch.

    ``token_count`` is ``N_tok`` and ``seq_count`` is ``N_seq`` (sequences with at least one counted
    token). Build one per micro-batch with :meth:`of`, add them up (``sum(..., LossNormalizer.zero())``)
    and, across data-parallel ranks, all-reduce :meth:`as_tensor` in the worker layer.
    """

    token_count: torch.Tensor | float
    seq_count: torch.Tensor | float

    @staticmethod
    def of(mask: torch.Tensor) -> LossNormalizer:
        """The counts of one (micro-)batch."""
        per_seq = masked_count(mask, dim=-1)
        return LossNormalizer(per_seq.sum(), (per_seq > 0).to(per_seq.dtype).sum())

    @staticmethod
    def zero() -> LossNormalizer:
        return LossNormalizer(0.0, 0.0)

    def __add__(self, other: LossNormalizer) -> LossNormalizer:
        return LossNormalizer(self.token_count + other.token_count, self.seq_count + other.seq_count)

    def as_tensor(self) -> torch.Tensor:
        """``[token_count, seq_count]`` as one float64 tensor, for a single all-reduce."""
        return torch.stack([torch.as_tensor(self.token_count), torch.as_tensor(self.seq_count)]).double()

    @staticmethod
    def from_tensor(t: torch.Tensor) -> LossNormalizer:
        return LossNormalizer(t[0], t[1])


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggregation,
    normalizer: LossNormalizer | None = None,
    norm_constant: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar with ``mode`` (formulas on :class:`LossAggregation`).

    Without ``normalizer`` the denominators ``N_tok``/``N_seq`` are this batch's own. With a
    ``normalizer`` measured over the global batch, every mode is a sum of per-token or per-sequence
    terms over one fixed denominator, so the losses of the micro-batches (and of the data-parallel
    ranks) *add up* to exactly the global-batch loss, whatever the split and the padding. The caller
    must then sum, not average: no division by the number of micro-batches (Megatron: use
    ``calculate_per_token_loss`` or undo its division), and where the data-parallel gradient
    reduction averages over ranks, multiply the loss by the data-parallel size.
    """
    mode = as_member(LossAggregation, mode, "loss aggregation")
    m = _float_mask(mask, loss_mat)
    norm = normalizer if normalizer is not None else LossNormalizer.of(m)
    if mode is LossAggregation.TOKEN_MEAN:
        total, denom = masked_sum(loss_mat, m), _positive(norm.token_count)
    else:
        seq_sum = masked_sum(loss_mat, m, dim=-1)
        denom = _positive(norm.seq_count)
        if mode is LossAggregation.SEQ_MEAN_TOKEN_SUM:
            total = seq_sum.sum()
        elif mode is LossAggregation.SEQ_MEAN_TOKEN_MEAN:
            total = (seq_sum / m.sum(dim=-1).clamp(min=1.0)).sum()
        else:
            if norm_constant is None or norm_constant <= 0:
                raise ConfigError(
                    f"loss aggregation {mode.value!r} needs a positive constant normaliser, found "
                    f"{norm_constant!r}; set it to the maximum response length so it is the same for every batch"
                )
            total, denom = seq_sum.sum(), denom * norm_constant
    # Counts are float64 (exact for huge batches); the loss keeps the dtype it came in.
    return (total / denom).to(loss_mat.dtype)


def _positive(count: torch.Tensor | float) -> torch.Tensor | float:
    """A denominator that is at least 1 (an empty batch contributes 0, not NaN)."""
    if isinstance(count, torch.Tensor):
        return count.clamp(min=1.0)
    return max(float(count), 1.0)
