"""Training rows from rollout outputs: what a generation call hands the trainer.

Pure: torch, :mod:`megarl.data.batch` and the rollout contract (:mod:`megarl.rollout.base`); the driver
imports it (the asynchronous producer assembles rows itself) without megatron-core.
"""

from __future__ import annotations

import torch

from megarl.data.batch import Batch
from megarl.rollout.base import RolloutOutput


def generation_rows(prompts: Batch, ids: list[list[int]], outputs: list[RolloutOutput], pad_token_id: int,
                    metrics: dict[str, float]) -> Batch:
    """What a generation call returns: training rows of ``outputs`` (:func:`rollout_batch`), each with its
    prompt's per-prompt fields of ``prompts`` (e.g. a global prompt id; all but ``prompt_ids`` and
    ``prompt_lengths``), and ``metrics`` with ``rollout/num_tokens`` in ``meta["metrics"]``."""
    batch = rollout_batch(ids, outputs, pad_token_id)
    per_prompt = [k for k in prompts.tensors.keys() if k not in ("prompt_ids", "prompt_lengths")]  # noqa: SIM118
    if per_prompt:
        batch = batch.update(Batch.from_dict({k: prompts[k][batch["prompt_index"]] for k in per_prompt}))
    batch.meta["metrics"] = metrics | {"rollout/num_tokens": float(batch["response_lengths"].sum())}
    return batch


def rollout_batch(prompts: list[list[int]], outputs: list[RolloutOutput], pad_token_id: int) -> Batch:
    """Training rows [prompt | response | pad] from rollout outputs (rows grouped by prompt).

    Fields: ``input_ids``, ``attention_mask``, ``response_mask`` (1 on response tokens),
    ``rollout_log_probs`` (token-aligned: entry i is the log-prob of token i), ``prompt_index``,
    ``response_lengths``, ``cached_tokens`` when every output reports it (prompt tokens the engine did not compute
    again), ``routed_experts`` when every output recorded its MoE routing (token-aligned
    [rows, width, layers, top_k]); non-tensor ``finish_reasons``. Built with whole-batch tensor ops (no per-row
    loop: a few hundred rows cost ~50 ms that way on a CPU).
    """
    width_new = max(out.responses.shape[1] for out in outputs)
    responses = torch.cat([_pad_columns(out.responses.cpu().long(), width_new, pad_token_id) for out in outputs])
    log_probs = torch.cat([_pad_columns(out.log_probs.cpu().float(), width_new, 0.0) for out in outputs])
    index = torch.cat([out.prompt_index.cpu().long() for out in outputs])
    n = torch.cat([out.response_lengths.cpu().long() for out in outputs])
    prompt_lengths = torch.tensor([len(p) for p in prompts])
    start, end = prompt_lengths[index], prompt_lengths[index] + n  # response columns [start, end) per row
    width = int(end.max())
    table = torch.full((len(prompts), int(prompt_lengths.max())), pad_token_id, dtype=torch.long)
    for i, p in enumerate(prompts):  # one row per prompt, not per response
        table[i, : len(p)] = torch.as_tensor(p)
    ids = torch.full((len(n), width + 1), pad_token_id, dtype=torch.long)  # the last column takes the overflow
    lps = torch.zeros(len(n), width + 1)
    k = min(table.shape[1], width)
    ids[:, :k] = table[index, :k]
    j = torch.arange(width_new)
    cols = torch.where(j[None, :] < n[:, None], start[:, None] + j[None, :], width)  # beyond a response: dropped
    ids.scatter_(1, cols, responses)
    lps.scatter_(1, cols, log_probs)
    col = torch.arange(width)[None, :]
    fields = {"input_ids": ids[:, :width].contiguous(), "attention_mask": (col < end[:, None]).float(),
              "response_mask": ((col >= start[:, None]) & (col < end[:, None])).float(),
              "rollout_log_probs": lps[:, :width].contiguous(), "prompt_index": index, "response_lengths": n}
    if all(out.cached_tokens is not None for out in outputs):
        fields["cached_tokens"] = torch.cat([out.cached_tokens.cpu().long() for out in outputs])
    if all(out.routed_experts is not None for out in outputs):
        fields["routed_experts"] = torch.cat([pad_routing(out.routed_experts.cpu(), width) for out in outputs])
    return Batch.from_dict(fields,
                           non_tensors={"finish_reasons": [reason for out in outputs for reason in out.finish_reasons]})


def pad_routing(t: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, W, layers, k] -> [rows, width, layers, k]: extra columns take experts 0..k-1 (never fed)."""
    if t.shape[1] >= width:
        return t[:, :width]
    k = t.shape[-1]
    pad = torch.arange(k, dtype=t.dtype).expand(t.shape[0], width - t.shape[1], t.shape[2], k)
    return torch.cat([t, pad], dim=1)


def _pad_columns(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
    return t if t.shape[1] == width else torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)
