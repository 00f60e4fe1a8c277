"""The rollout-engine contract: sampling parameters, the output batch, the engine protocol and the sampler.

Owns the definitions every rollout engine (embedded HF decode loop, vLLM, ...) and the training side agree
on: how rows are ordered (grouped by prompt), how responses are padded, when a row finishes, and what a
per-token log-prob means (:func:`sample_next`). Pure: imports torch and megarl.errors only -- no Ray,
no process groups, no transformers, no vLLM.

Log-prob definition (the training side compares against it): the log-prob of the sampled token under
``softmax(logits / temperature)`` computed in float32 *before* the repetition penalty and min-p / top-k / top-p
truncation (the policy's own distribution, which the training forward computes); greedy decoding (temperature 0)
uses temperature 1. With a vocabulary limit, logits at ids >= the limit are -inf first (they get probability 0
and are never sampled).

What is sampled from, in vLLM's order (vllm/v1/sample/sampler.py): the repetition penalty on the raw logits
(every token of the prompt or the response so far: a positive logit divided by the penalty, a negative one
multiplied, as in transformers and vLLM), then the temperature, then min-p (tokens whose probability is below
``min_p`` times the most likely token's are dropped), then top-k, then top-p over what is left. Greedy decoding
takes the argmax of the penalised logits.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from megarl.errors import ConfigError, MegarlError

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


class WeightUpdateError(MegarlError, ValueError):
    """A weight sync that does not fit the rollout model: unknown name, wrong shape, or missing tensors."""


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How each response is drawn (``rollout.sampling`` / ``rollout.validation`` in a run's YAML).
    ``temperature=0`` is greedy; ``top_k=0`` and ``top_p=1`` are off."""

    n: int = 1  # responses per prompt
    temperature: float = 1.0  # softmax temperature; 0 = greedy
    top_p: float = 1.0  # nucleus: the smallest set of tokens with this much probability; 1 = off
    top_k: int = 0  # only the k most likely tokens; 0 = off
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one; 0 = off
    repetition_penalty: float = 1.0  # divide (positive) / multiply (negative) logits of tokens already seen; 1 = off

    def __post_init__(self) -> None:
        checks = [
            (self.n >= 1, "n", "an integer >= 1", self.n),
            (self.temperature >= 0, "temperature", ">= 0 (0 = greedy)", self.temperature),
            (0 < self.top_p <= 1, "top_p", "in (0, 1] (1 = off)", self.top_p),
            (self.top_k >= 0, "top_k", "an integer >= 0 (0 = off)", self.top_k),
            (0 <= self.min_p <= 1, "min_p", "in [0, 1] (0 = off)", self.min_p),
            (self.repetition_penalty > 0, "repetition_penalty", "> 0 (1 = off)", self.repetition_penalty),
        ]
        for ok, name, expected, found in checks:
            if not ok:
                raise ConfigError(f"{type(self).__name__}.{name} must be {expected}; found {found!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True, kw_only=True)
class SamplingParams(SamplingConfig):
    """One generation call: how to sample (:class:`SamplingConfig`) and when a response ends.

    A row finishes when it emits one of ``stop_token_ids`` (the stop token is part of the response,
    as in vLLM) or after ``max_new_tokens`` tokens. ``seed=None`` draws fresh randomness.
    """

    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_new_tokens < 1:
            raise ConfigError(f"SamplingParams.max_new_tokens must be an integer >= 1; found {self.max_new_tokens!r}")
        if not isinstance(self.stop_token_ids, tuple) or any(t < 0 for t in self.stop_token_ids):
            raise ConfigError(
                f"SamplingParams.stop_token_ids must be a tuple of non-negative token ids; "
                f"found {self.stop_token_ids!r}"
            )


@dataclass
class RolloutOutput:
    """Sampled responses, one row per sample, rows grouped by prompt (prompt 0's ``n`` samples first).

    ``responses`` is right-padded with the engine's pad token to the longest response ``R``;
    ``response_mask`` is True on the model's tokens (an engine's: every real token; a conversation's rows, built
    by :func:`megarl.multiturn.rollout.conversations_batch`, hold observation tokens between model turns, False
    here); ``log_probs`` (float32) is 0 on padding. ``versions`` (long [rows, R]): the policy version of the
    weights that sampled each token, set by the training side (:mod:`megarl.rollout.rows`); engines leave None.
    ``routed_experts`` (MoE models, engines that record routing): each row's ``top_k`` experts per token of its
    whole sequence (prompt then response, left-aligned like a training row) and MoE layer, [rows, W, layers,
    top_k]; positions the engine never fed (padding, each row's last token) hold experts ``0..top_k-1``.
    ``cached_tokens`` (engines that report it): per row, how many leading prompt tokens the engine did not
    compute again because it kept their KV cache from an earlier call (or, vLLM, found them in its prefix cache).
    """

    prompt_index: torch.Tensor  # long [rows]
    responses: torch.Tensor  # long [rows, R]
    response_mask: torch.Tensor  # bool [rows, R]
    log_probs: torch.Tensor  # float32 [rows, R]
    response_lengths: torch.Tensor  # long [rows]
    finish_reasons: list[str]  # FINISH_STOP or FINISH_LENGTH per row
    routed_experts: torch.Tensor | None = None  # int16 [rows, W, layers, top_k] (MoE), else None
    cached_tokens: torch.Tensor | None = None  # long [rows], else None
    versions: torch.Tensor | None = None  # long [rows, R] (the training side's; module docstring)

    def __len__(self) -> int:
        return len(self.finish_reasons)

    def token_lists(self) -> list[list[int]]:
        """Each row's response token ids, without padding."""
        return [row[:n].tolist() for row, n in zip(self.responses, self.response_lengths.tolist(), strict=True)]

    def log_prob_lists(self) -> list[list[float]]:
        """Each row's per-token log-probs, without padding."""
        return [row[:n].tolist() for row, n in zip(self.log_probs, self.response_lengths.tolist(), strict=True)]


@runtime_checkable
class RolloutEngine(Protocol):
    """What the RL loop needs from a rollout engine.

    Weight sync: ``wake_up()`` (or a fresh engine), then ``update_weights`` once per bucket of full HF-named
    tensors, then ``finish_weight_update()`` which raises if any parameter was not loaded since the sync began.
    ``weight_buffer`` offers the engine's own storage of a tensor for the sync to receive into in place (no
    staging copy; ``update_weights`` then finds the tensor already there), or None where the engine loads a copy.
    ``sleep()`` frees weights and caches between rollouts (e.g. while training runs on the same device)
    where the engine can (``sleep_frees_memory``); elsewhere it only ends the engine's readiness.
    """

    sleep_frees_memory: bool

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutOutput: ...

    def update_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...

    def weight_buffer(self, name: str, shape: Sequence[int], dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor | None: ...

    def finish_weight_update(self) -> None: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def close(self) -> None: ...


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """Reference log-prob of ``tokens`` under ``softmax(logits / T)`` in float32 (``T=0`` counts as 1).

    ``logits`` is ``[..., V]`` and ``tokens`` ``[...]``; vocabulary masking, if any, is the caller's.
    """
    t = 1.0 if temperature == 0 else temperature
    logp = torch.log_softmax(logits.float() / t, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _top_mass(scaled: torch.Tensor, lse: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` logits (sorted) and ids, ``k`` the smallest of 256, 1024, ... (or the vocabulary) whose
    probability reaches ``top_p`` in every row: the nucleus without sorting a large vocabulary."""
    vocab = scaled.shape[-1]
    k = 256 if vocab > 1024 else vocab  # a small vocabulary is sorted at once
    while True:
        values, ids = torch.topk(scaled, k, dim=-1)
        if k == vocab or bool((torch.exp(values - lse[:, None]).sum(-1) >= top_p).all()):
            return values, ids
        k = min(4 * k, vocab)


def _candidates(
    scaled: torch.Tensor, lse: torch.Tensor, top_k: int, top_p: float
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(candidate ids [B, k] or None for the whole vocabulary, unnormalised sampling weights): the top-k, then
    the smallest nucleus of (the renormalised top-k) holding ``top_p`` of the mass; the first token always stays.
    ``lse``: the log-sum-exp of ``scaled`` (a probability mass of 1 over what ``scaled`` does not rule out)."""
    if 0 < top_k < scaled.shape[-1]:
        values, ids = torch.topk(scaled, top_k, dim=-1)
        norm = torch.logsumexp(values, dim=-1, keepdim=True)
    elif top_p < 1.0:
        values, ids = _top_mass(scaled, lse, top_p)
        norm = lse[:, None]
    else:
        return None, torch.exp(scaled - lse[:, None])
    probs = torch.exp(values - norm)
    if top_p < 1.0:  # drop a token once the tokens ranked above it hold top_p of the mass
        probs = probs.masked_fill(probs.cumsum(dim=-1) - probs > top_p, 0.0)
    return ids, probs


def penalize_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """``logits [B, V]`` with every ``seen [B, V]`` token's logit divided by ``penalty`` where positive and
    multiplied by it where negative (transformers' RepetitionPenaltyLogitsProcessor, vLLM's repetition penalty)."""
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def sample_next(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    vocab_limit: int | None = None,
    seen: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from ``logits [B, V]``; returns (tokens long [B], log-probs float32 [B]) (module
    docstring). ``seen`` (bool [B, V]): the tokens of each row's prompt and response so far, which
    ``params.repetition_penalty`` penalises; required when it is not 1."""
    logits = logits.float()
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = logits.clone()
        logits[:, vocab_limit:] = float("-inf")
    t = 1.0 if params.greedy else params.temperature
    scaled = logits if t == 1.0 else logits / t
    lse = torch.logsumexp(scaled, dim=-1)
    if params.repetition_penalty != 1.0:
        if seen is None:
            raise ValueError("repetition_penalty needs the tokens each row has seen (seen=[B, V] bool)")
        sampled = penalize_repetition(logits, seen, params.repetition_penalty)
        sampled = sampled if t == 1.0 else sampled / t
    else:
        sampled = scaled
    if params.greedy:
        tokens = sampled.argmax(dim=-1)
    else:
        sampled_lse = lse if sampled is scaled else torch.logsumexp(sampled, dim=-1)
        if params.min_p > 0:  # relative to the most likely token: exp(x - max) < min_p
            sampled = sampled.masked_fill(sampled - sampled.amax(-1, keepdim=True) < math.log(params.min_p),
                                          float("-inf"))
            sampled_lse = torch.logsumexp(sampled, dim=-1)
        ids, weights = _candidates(sampled, sampled_lse, params.top_k, params.top_p)
        choice = torch.multinomial(weights, 1, generator=generator).squeeze(-1)
        tokens = choice if ids is None else ids.gather(-1, choice.unsqueeze(-1)).squeeze(-1)
    return tokens, scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse
