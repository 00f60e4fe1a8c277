"""vLLM's per-rank parameters of a Llama/Qwen2-family model, built from HF-space rollout shards.

vLLM fuses q/k/v into ``qkv_proj`` (rank block ``[q_g; k_g; v_g]``, not interleaved per group) and
gate/up into ``gate_up_proj`` (``[gate_g; up_g]``), keeps o/down split on the input dimension, and
gives every rank ``ceil(V/64)*64 / TP_g`` vocabulary rows (zero beyond V). These rules belong to the
receiving side of a resharding plan (a vLLM worker extension copies the results into its live
parameters); they are pure tensor code.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from megarl.resharding.plan import VLLM_VOCAB_PADDING

_FUSED = (
    (re.compile(r"^(.*)\.self_attn\.q_proj\.(weight|bias)$"), "self_attn.{k}_proj", "self_attn.qkv_proj", "qkv"),
    (re.compile(r"^(.*)\.mlp\.gate_proj\.weight$"), "mlp.{k}_proj", "mlp.gate_up_proj", "gate_up"),
)
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def vllm_params(shards: Mapping[str, torch.Tensor], *, vocab_size: int, rollout_tp: int) -> dict[str, torch.Tensor]:
    """vLLM parameter name -> this rank's tensor, from HF name -> this rank's HF-space shard."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for name in shards:
        for pattern, part, fused, group in _FUSED:
            m = pattern.match(name)
            if not m:
                continue
            prefix = m.group(1)
            suffix = name.rsplit(".", 1)[1]
            keys = ("q", "k", "v") if group == "qkv" else ("gate", "up")
            names = [f"{prefix}.{part.format(k=k)}.{suffix}" for k in keys]
            out[f"{prefix}.{fused}.{suffix}"] = torch.cat([shards[n] for n in names], dim=0)
            used.update(names)
    for name, tensor in shards.items():
        if name in used:
            continue
        if name in _VOCAB:
            rows = -(-vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING // rollout_tp
            padded = tensor.new_zeros((rows, *tensor.shape[1:]))
            padded[: tensor.shape[0]] = tensor
            tensor = padded
        out[name] = tensor
    return out
