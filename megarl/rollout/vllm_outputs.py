"""vLLM's ``RequestOutput``s as megarl's :class:`~megarl.rollout.base.RolloutOutput` (rows grouped by prompt, the
sampled tokens' log-probs, finish reasons, prefix-cache hits and, for router replay, routed experts). Reads the
objects' attributes only: imports torch and megarl, never vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megarl.rollout.base import FINISH_LENGTH, FINISH_STOP, RolloutOutput
from megarl.rollout.vllm_routing import routed_experts, stack_routing

_VLLM_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH}


def to_rollout_output(request_outputs: Sequence[Any], n: int, pad_token_id: int, *,
                      routing: tuple[int, int] | None = None) -> RolloutOutput:
    """:class:`RolloutOutput` from vLLM ``RequestOutput``s (one per prompt, in prompt order).

    Reads ``request.outputs[j].index``, ``.token_ids``, ``.logprobs`` (per position a mapping token id ->
    ``Logprob`` with ``.logprob``; it must hold the sampled token) and ``.finish_reason`` ("stop"/"length").
    A request with a single completion stands for ``n`` identical rows (greedy: vLLM samples it once).
    Stop tokens are part of ``token_ids`` (vLLM appends a token before ``check_stop``), so they stay in the
    response, as the contract wants.

    ``routing`` (MoE layers, top-k): also reads each completion's ``routed_experts`` (vLLM's
    ``enable_return_routed_experts``: the experts of every token the engine fed, prompt then response,
    [tokens, layers, k]) and ``request.prompt_token_ids`` into :attr:`RolloutOutput.routed_experts`.
    """
    rows: list[tuple[int, list[int], list[float], str]] = []
    routed: list[torch.Tensor] = []
    for i, request in enumerate(request_outputs):
        completions = sorted(request.outputs, key=lambda c: c.index)
        if len(completions) == 1 < n:
            completions = completions * n
        if len(completions) != n:
            raise RuntimeError(f"vLLM returned {len(completions)} completions for prompt {i}, expected {n}")
        for c in completions:
            ids = [int(t) for t in c.token_ids]
            rows.append((i, ids, _sampled_log_probs(c, ids, i), _finish_reason(c, i)))
            if routing is not None:
                routed.append(routed_experts(c, len(request.prompt_token_ids) + len(ids), routing, i))
    width = max((len(ids) for _, ids, _, _ in rows), default=0)
    responses = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    log_probs = torch.zeros((len(rows), width), dtype=torch.float32)
    for k, (_, ids, lps, _) in enumerate(rows):
        responses[k, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        log_probs[k, : len(ids)] = torch.tensor(lps, dtype=torch.float32)
    lengths = torch.tensor([len(ids) for _, ids, _, _ in rows], dtype=torch.long)
    return RolloutOutput(
        prompt_index=torch.tensor([i for i, _, _, _ in rows], dtype=torch.long),
        responses=responses,
        response_mask=torch.arange(width)[None, :] < lengths[:, None],
        log_probs=log_probs,
        response_lengths=lengths,
        finish_reasons=[reason for _, _, _, reason in rows],
        routed_experts=None if routing is None else stack_routing(routed, routing),
        cached_tokens=_cached_tokens(request_outputs, [i for i, _, _, _ in rows]),
    )


def _cached_tokens(request_outputs: Sequence[Any], prompt_of_row: list[int]) -> torch.Tensor | None:
    """Each row's prompt tokens vLLM found in its prefix cache, or None where a release does not report them."""
    cached = [getattr(request, "num_cached_tokens", None) for request in request_outputs]
    return None if None in cached else torch.tensor([cached[i] for i in prompt_of_row], dtype=torch.long)


def _sampled_log_probs(completion: Any, ids: list[int], prompt: int) -> list[float]:
    positions = completion.logprobs
    if positions is None or len(positions) != len(ids):
        found = "none" if positions is None else f"{len(positions)} positions"
        raise RuntimeError(f"vLLM returned {found} of log-probs for a {len(ids)}-token response of prompt {prompt}; "
                           "it must be asked for logprobs=0 (the sampled token's)")
    out = []
    for j, (entry, token) in enumerate(zip(positions, ids, strict=True)):
        if token not in entry:
            raise RuntimeError(f"vLLM's log-probs at position {j} of prompt {prompt} lack the sampled token {token}")
        out.append(float(entry[token].logprob))
    return out


def _finish_reason(completion: Any, prompt: int) -> str:
    reason = _VLLM_FINISH.get(completion.finish_reason)
    if reason is None:
        raise RuntimeError(f"vLLM finished a response of prompt {prompt} with {completion.finish_reason!r}; "
                           f"expected one of {sorted(_VLLM_FINISH)}")
    return reason


# ------------------------------------------------------------------------------------------ environment
