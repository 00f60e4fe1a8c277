"""Batch-major logits straight from megatron-core's output layer, so GPTModel's transpose copies nothing.

GPTModel's output layer (a ``ColumnParallelLinear``) maps hidden states [s, b, h] to logits
[s, b, V/tp], and GPTModel then returns ``logits.transpose(0, 1).contiguous()``: a second full copy
of every micro-batch's logits, the largest tensor of the pass. In backward the layer calls
``grad_output.contiguous()`` on the transposed gradient, another full copy. On CPU each such copy
is a fresh mmapped allocation that page-faults (engine benchmark, 2026-11-30: 4 copies per log-prob
pass, 8 per update; removing them took a TP1 log-prob pass from 4.89 to 4.12 s and its peak from
2.2x to 1.1x one micro-batch's logits).

:func:`make_logits_batch_major` installs two forward hooks on the output layer. Before it runs, the
hidden states become ``hidden.transpose(0, 1).contiguous()`` ([b, s, h]: h << V, a small copy), so
the GEMM writes [b, s, V/tp] contiguously; after it, the layer returns ``out.transpose(0, 1)``, the
[s, b, V/tp] view megatron expects, whose ``.transpose(0, 1).contiguous()`` is then a no-op. Backward
mirrors it: the layer receives a contiguous [b, s, V/tp] gradient.

Invariants: values are those of megatron's layout (each logit is the same dot product); parameters,
their names and state dicts are untouched (hooks, not a wrapper module). The layer's math is
row-order agnostic as long as nothing splits or gathers along dim 0: the vocab-parallel matmul,
the TP all-reduce of the input gradient, ``gather_output`` (last dim) and a weight passed in at
forward (tied embeddings) all qualify; sequence parallelism (input gathered along the sequence,
dim 0) does not, so such layers are left alone.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear


def _batch_major_input(module: torch.nn.Module, args: tuple) -> tuple:
    hidden, *rest = args  # GPTModel passes the hidden states positionally
    return (hidden.transpose(0, 1).contiguous(), *rest)


def _sequence_major_view(module: torch.nn.Module, args: tuple, output: tuple) -> tuple:
    logits, bias = output
    return logits.transpose(0, 1), bias


def make_logits_batch_major(chunk: torch.nn.Module) -> bool:
    """Install the hooks on ``chunk.output_layer`` when it is a vocabulary ``ColumnParallelLinear``
    without sequence parallelism; True if installed. Chunks of earlier pipeline stages have no output
    layer; scalar heads ([s, b, 1]) have nothing worth saving."""
    layer = getattr(chunk, "output_layer", None)
    if not isinstance(layer, ColumnParallelLinear) or layer.sequence_parallel:
        return False
    if _batch_major_input in layer._forward_pre_hooks.values():
        return True  # installed already; twice would transpose back
    layer.register_forward_pre_hook(_batch_major_input)
    layer.register_forward_hook(_sequence_major_view)
    return True
