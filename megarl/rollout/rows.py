"""Training rows: the one place rows are built, from whatever generated them.

:func:`rollout_batch` lays out rows ``[prompt | continuation | pad]``. A continuation is what follows the prompt: the
model's tokens (trained; each with its rollout log-prob and the policy version of the weights that sampled it) and,
in a conversation, the observation tokens between model turns (context only; ``response_mask`` 0). Its callers:

* a generation call (:func:`generation_rows`; every token of it has the version its engine holds);
* the asynchronous producer's responses, continued across weight pushes
  (:func:`megarl.trainer.asynchronous.groups_batch`; each token its own version);
* conversations (:func:`megarl.multiturn.rollout.conversations_batch`; model segments of several calls and versions,
  observations between them).

Pure: torch, :mod:`megarl.data.batch` and the rollout contract (:mod:`megarl.rollout.base`); the driver
imports it without megatron-core.
"""

from __future__ import annotations

import dataclasses

import torch

from megarl.data.batch import Batch
from megarl.rollout.base import RolloutOutput


@dataclasses.dataclass
class Sampled:
    """A response's tokens as generation calls return them, several calls where a partial rollout is continued across
    weight pushes: each token with its rollout log-prob and the policy version that sampled it; MoE: the experts of
    each position of the sequence (from its first token) as the call that first fed it routed it, in chunks."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    routing: list[torch.Tensor] = dataclasses.field(default_factory=list)  # chunks of [positions, layers, top_k]
    routed: int = 0  # positions whose routing is recorded

    def add(self, tokens: list[int], log_probs: list[float], version: int, keep: int,
            routing: torch.Tensor | None = None, before: int = 0) -> None:
        """A call's first ``keep`` of its new ``tokens``, sampled by ``version``; ``routing``: the call's
        ``[positions, layers, top_k]`` from the sequence's first token, ``before`` the sequence's tokens ahead of
        this response (the call fed them, the tokens so far and its new ones but the last)."""
        if routing is not None:
            fed = before + len(self.tokens) + min(len(tokens) - 1, keep)
            if fed > self.routed:
                self.routing.append(routing[self.routed:fed].clone())
                self.routed = fed
        self.tokens += tokens[:keep]
        self.log_probs += log_probs[:keep]
        self.versions += [version] * keep


def generation_rows(prompts: Batch, ids: list[list[int]], outputs: list[RolloutOutput], pad_token_id: int,
                    metrics: dict[str, float], version: int) -> Batch:
    """What a generation call returns: training rows of ``outputs`` (:func:`rollout_batch`) sampled by weights of
    policy ``version`` (every token's ``rollout_versions``, every row's ``policy_version``), each with its prompt's
    per-prompt fields of ``prompts`` (e.g. a global prompt id; all but ``prompt_ids`` and ``prompt_lengths``), and
    ``metrics`` with ``rollout/num_tokens`` in ``meta["metrics"]``."""
    for out in outputs:
        out.versions = torch.full(out.responses.shape, version, dtype=torch.long)
    batch = rollout_batch(ids, outputs, pad_token_id)
    per_prompt = [k for k in prompts.tensors.keys() if k not in ("prompt_ids", "prompt_lengths")]  # noqa: SIM118
    if per_prompt:
        batch = batch.update(Batch.from_dict({k: prompts[k][batch["prompt_index"]] for k in per_prompt}))
    batch.meta["metrics"] = metrics | {"rollout/num_tokens": float(batch["response_lengths"].sum())}
    return batch


def rollout_batch(prompts: list[list[int]], outputs: list[RolloutOutput], pad_token_id: int) -> Batch:
    """Training rows [prompt | continuation | pad] from rollout outputs (rows grouped by prompt; module docstring).

    Fields: ``input_ids``, ``attention_mask``, ``response_mask`` (1 on the model's tokens: the outputs'
    ``response_mask`` in place), ``rollout_log_probs`` (token-aligned: entry i is the log-prob of token i),
    ``prompt_index``, ``response_lengths`` (the model's tokens of each row), ``rollout_versions`` and
    ``policy_version`` (each row's oldest model token's version) when every output has ``versions``,
    ``cached_tokens`` when every output reports it (prompt tokens the engine did not compute again),
    ``routed_experts`` when every output recorded its MoE routing (token-aligned [rows, width, layers, top_k]);
    non-tensor ``finish_reasons``. Built with whole-batch tensor ops (no per-row loop: a few hundred rows cost
    ~50 ms that way on a CPU).
    """
    width_new = max(out.responses.shape[1] for out in outputs)

    def placed(field: str, value, dtype) -> torch.Tensor:  # the outputs' per-token field, padded to width_new
        return torch.cat([_pad_columns(getattr(out, field).cpu().to(dtype), width_new, value) for out in outputs])

    index = torch.cat([out.prompt_index.cpu().long() for out in outputs])
    n = torch.cat([out.response_lengths.cpu().long() for out in outputs])
    prompt_lengths = torch.tensor([len(p) for p in prompts])
    start, end = prompt_lengths[index], prompt_lengths[index] + n  # continuation columns [start, end) per row
    width = int(end.max())
    table = torch.full((len(prompts), int(prompt_lengths.max())), pad_token_id, dtype=torch.long)
    for i, p in enumerate(prompts):  # one row per prompt, not per response
        table[i, : len(p)] = torch.as_tensor(p)
    j = torch.arange(width_new)
    cols = torch.where(j[None, :] < n[:, None], start[:, None] + j[None, :], width)  # beyond a row's end: dropped

    def scattered(values: torch.Tensor, fill) -> torch.Tensor:  # [rows, width]; the last column takes the overflow
        out = torch.full((len(n), width + 1), fill, dtype=values.dtype)
        return out.scatter_(1, cols, values)[:, :width].contiguous()

    ids = scattered(placed("responses", pad_token_id, torch.long), pad_token_id)
    k = min(table.shape[1], width)
    prompt_cols = torch.arange(k)[None, :] < start[:, None]
    ids[:, :k] = torch.where(prompt_cols, table[index, :k], ids[:, :k])
    mask = scattered(placed("response_mask", False, torch.bool), False)
    log_probs = scattered(placed("log_probs", 0.0, torch.float32), 0.0)
    fields = {"input_ids": ids, "attention_mask": (torch.arange(width)[None, :] < end[:, None]).float(),
              "response_mask": mask.float(), "rollout_log_probs": log_probs, "prompt_index": index,
              "response_lengths": mask.sum(-1)}
    if all(out.versions is not None for out in outputs):
        versions = scattered(placed("versions", 0, torch.long), 0) * mask
        oldest = versions.masked_fill(~mask, torch.iinfo(torch.long).max).amin(-1)
        fields |= {"rollout_versions": versions, "policy_version": torch.where(mask.any(-1), oldest, 0)}
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
