"""Core attention of megatron-core's local (pure PyTorch) layer spec through ``torch``'s fused
``scaled_dot_product_attention``.

Why: megatron-core's ``DotProductAttention`` materialises the ``[b, heads, s, s]`` scores, repeats
the KV heads for GQA and runs a Python softmax; on CPU that is 3x slower than PyTorch's fused SDPA
kernel forward (2x forward + backward) and holds ``s^2`` memory per head. GPU runs use Transformer
Engine's attention and never build this spec.

:class:`SDPAttention` subclasses ``DotProductAttention`` (same constructor, parameters and sharded
state dict: its heads per TP partition, softmax scale and dropout) and computes exactly the causal,
unmasked case megarl runs (right-padded rows, ``attention_mask=None``, no dropout, no sliding window,
vanilla softmax). Anything else goes to megatron-core's own forward, unchanged.
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPAttention(DotProductAttention):
    def _fused(self, attention_mask, attn_mask_type, attention_bias, packed_seq_params) -> bool:
        c = self.config
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        return (attention_mask is None and mask_type == AttnMaskType.causal and attention_bias is None
                and packed_seq_params is None and self.softmax_offset is None and c.window_size is None
                and not c.apply_query_key_layer_scaling
                and (self.attention_dropout.p == 0.0 or not self.training))

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if not self._fused(attention_mask, attn_mask_type, attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        # [s, b, heads, d] -> [b, heads, s, d]; GQA: the kernel maps each query head to its KV group
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                             enable_gqa=k.size(1) != q.size(1))
        # [b, heads, s, d] -> [s, b, heads * d]
        return out.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), self.hidden_size_per_partition)


def use_sdpa(layer_spec) -> None:
    """Swap the core attention of a local GPT layer spec (in place) for :class:`SDPAttention`."""
    attention = layer_spec.submodules.self_attention.submodules
    if attention.core_attention is not DotProductAttention:
        raise TypeError(f"expected megatron-core's local DotProductAttention in the spec, found "
                        f"{attention.core_attention!r}")
    attention.core_attention = SDPAttention
