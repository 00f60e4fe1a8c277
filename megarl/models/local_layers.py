"""Faster, leaner drop-ins for three modules of megatron-core's local (pure PyTorch) layer spec.

GPU runs use Transformer Engine's spec and never build these. Each class subclasses the
megatron-core module it replaces (same constructor, parameters and sharded state dict), computes
exactly the case megarl runs, and hands anything else to megatron-core's own forward, unchanged.

- :class:`SDPAttention` (core attention): megatron-core's ``DotProductAttention`` materialises the
  ``[b, heads, s, s]`` scores, repeats the KV heads for GQA and runs a Python softmax; on CPU that
  is 3x slower than PyTorch's fused SDPA kernel forward (2x forward + backward) and holds ``s^2``
  memory per head. Fused case: causal, unmasked (right-padded rows, ``attention_mask=None``), no
  dropout, no sliding window, vanilla softmax.
- :class:`SwiGLUMLP` (MLP): megatron-core's unfused SwiGLU, ``silu(gate) * (up + offset)`` on
  views of the fc1 output, leaves autograd holding the whole fc1 output (through the ``gate``
  view), ``silu(gate)``, a copy of ``up`` and (in fc2) the product: 2.5x the fc1 output per layer.
  :class:`SwiGLUMLP` keeps the fc1 output alone: :class:`SwiGLU` saves just its input, and fc2's
  saved input is packed as a recipe that recomputes the product from that same tensor when fc2's
  backward needs it (and hands its ``silu(gate)`` on to SwiGLU's backward, which runs next). Same
  kernels on the same inputs, so bit-identical; costs one ``silu`` and one product per layer in
  backward. 30M model, 64 x 76 tokens: saved for backward 2.46 -> 1.39 GB (transformers' Qwen2:
  2.15 GB). Fused case: gated SiLU, no fc1 bias, no clamp, zero linear offset, no per-token scale.
  (megatron-core's own ``CheckpointWithoutOutput`` would do the same but snapshots CUDA RNG states
  per call, which on CPU queues a formatted stack trace in ``torch.cuda`` forever.)

- :class:`LocalNorm` (norms, built by :func:`use_local_norms`, the decoder's final norm too): RMSNorm as
  :class:`LeanRMSNorm`, which saves its input and ``1/rms`` only (torch's composite CPU ``rms_norm``
  also keeps the normalised input: 0.15 GB of the 30M model's 1.24 GB saved per 64 x 68-token
  micro-batch); and what the local spec lacks for sequence parallelism: megatron-core's
  ``WrappedTorchNorm`` refuses it, :class:`LocalNorm` marks its parameters for the TP gradient sum.
- :class:`NativeColumnParallelLinear` / :class:`NativeRowParallelLinear` (the layers' linears, experts'
  included): where megatron-core's linear autograd function has nothing to do (no input-gradient all-reduce,
  no sequence parallelism, no fused weight-gradient accumulation, no deferred embedding gradient: TP 1, and
  every row-parallel linear), ``F.linear``: the same GEMMs through torch's C++ autograd instead of two Python
  calls per linear per micro-batch (tiny example, 4 micro-batches: the update 77 -> 70 ms).
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from megarl.models.context_parallel import context_parallel_attention, packed_causal_attention, packed_plan


class SDPAttention(DotProductAttention):
    """megatron-core's local core attention, fused on CPU, with packed sequences and context parallelism (which
    megatron-core's own leaves to Transformer Engine: it refuses ``context_parallel_size`` > 1 at construction)."""

    def __init__(self, config, *args, **kwargs):
        cp = config.context_parallel_size
        if cp > 1:  # megatron-core's constructor asserts cp == 1; nothing it builds depends on cp
            config = copy.copy(config)
            config.context_parallel_size = 1
        super().__init__(config, *args, **kwargs)
        self.cp_group = None
        if cp > 1:
            from megatron.core import parallel_state

            self.cp_group = parallel_state.get_context_parallel_group()

    def _fused(self, attention_mask, attn_mask_type, attention_bias) -> bool:
        c = self.config
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        return (attention_mask is None and mask_type == AttnMaskType.causal and attention_bias is None
                and self.softmax_offset is None and c.window_size is None
                and not c.apply_query_key_layer_scaling
                and (self.attention_dropout.p == 0.0 or not self.training))

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        fused = self._fused(attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params is not None:
            if not fused:
                raise NotImplementedError(
                    "megarl's CPU attention runs packed sequences (THD) causal, without an attention mask, bias, "
                    "sliding window, softmax offset or attention dropout; this model has one of them: set the "
                    "role's packing: false")
            return self._packed(query, key, value, packed_seq_params)
        if self.cp_group is not None:
            raise NotImplementedError("context parallelism runs on packed sequences (the engine packs them)")
        if not fused:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        # [s, b, heads, d] -> [b, heads, s, d]; GQA: the kernel maps each query head to its KV group.
        # ``value`` is a view into the fused QKV projection output: copy it, or the tensor autograd
        # saves for backward keeps that whole output (queries and pre-RoPE keys too) alive.
        q, k = (t.permute(1, 2, 0, 3) for t in (query, key))
        v = value.permute(1, 2, 0, 3).contiguous()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                             enable_gqa=k.size(1) != q.size(1))
        # [b, heads, s, d] -> [s, b, heads * d]
        return out.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), self.hidden_size_per_partition)

    def _packed(self, query, key, value, params):
        """THD: [t, heads, d] tokens of sequences laid end to end; each attends causally within its extent. With
        context parallelism ``t`` is this rank's share of the stream (megatron-core's load-balanced chunks of every
        sequence) and the offsets are the whole stream's."""
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        if self.cp_group is None:  # the plan once per micro-batch: every layer gets the same parameters object
            offsets = cu.tolist()
            plan = getattr(params, "_megarl_plan", None)
            if plan is None:
                plan = params._megarl_plan = packed_plan(offsets, query.device)
            out = packed_causal_attention(query, key, value, offsets, self.softmax_scale, plan)
        else:
            out = context_parallel_attention(query, key, value, cu.tolist(), self.softmax_scale, self.cp_group)
        return out.reshape(query.size(0), self.hidden_size_per_partition)


class SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` of ``y = [gate | up]`` (last dimension), saving only ``y``; backward runs the
    kernels autograd would (``silu_backward`` and two products), so its gradient is bit-identical.
    ``stash`` (a dict) may hand backward ``silu(gate)`` under ``"silu"``, computed since the forward
    (by fc2's recomputation), instead of computing it again."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, stash: dict) -> torch.Tensor:
        ctx.save_for_backward(y)
        ctx.stash = stash
        return swiglu(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (y,) = ctx.saved_tensors
        gate, up = y.chunk(2, dim=-1)
        grad_y = torch.empty_like(y)
        grad_gate, grad_up = grad_y.chunk(2, dim=-1)
        act = ctx.stash.pop("silu", None)
        if act is None:
            act = F.silu(gate)
        torch.mul(grad, act, out=grad_up)
        torch.mul(grad, up, out=act)  # d loss / d silu(gate), reusing the buffer
        torch.ops.aten.silu_backward.grad_input(act, gate, grad_input=grad_gate)
        return grad_y, None


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``y = [gate | up]`` (last dimension; each TP rank holds its own halves)."""
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


_RECOMPUTED = object()  # marks fc2's saved input, packed as (marker, shape)


class SwiGLUMLP(MLP):
    def _fused(self) -> bool:
        c = self.config
        return (c.gated_linear_unit and self.activation_func is F.silu and not c.add_bias_linear
                and not c.use_te_activation_func and not c.bias_activation_fusion
                and c.activation_func_clamp_value is None and c.glu_linear_offset == 0)

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is not None or not self._fused():
            return super().forward(hidden_states, per_token_scale, **kwargs)
        y, _ = self.linear_fc1(hidden_states)  # no bias: add_bias_linear is off
        if not torch.is_grad_enabled():
            return self.linear_fc2(swiglu(y))
        stash: dict[str, torch.Tensor] = {}
        act = SwiGLU.apply(y, stash)
        # fc2 saves its input (act, or a 2-D view of it) for its weight gradient: keep a recipe instead,
        # recomputed from y (which SwiGLU keeps anyway) when fc2's backward unpacks it; SwiGLU's backward,
        # which runs next, reuses the silu(gate) computed for it
        ptr, numel, source = act.data_ptr(), act.numel(), y.detach()

        def pack(t: torch.Tensor):
            return (_RECOMPUTED, t.shape) if t.data_ptr() == ptr and t.numel() == numel else t

        def unpack(packed):
            if isinstance(packed, tuple) and packed[0] is _RECOMPUTED:
                gate, up = source.chunk(2, dim=-1)
                with torch.no_grad():
                    stash["silu"] = F.silu(gate)
                    return (stash["silu"] * up).view(packed[1])
            return packed

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return self.linear_fc2(act)


def _native(kwargs: dict) -> bool:
    """Whether megatron-core's linear function would only run the linear (the arguments it is called with)."""
    return not (kwargs.get("allreduce_dgrad") or kwargs.get("sequence_parallel")
                or kwargs.get("gradient_accumulation_fusion") or kwargs.get("grad_output_buffer") is not None)


class _NativeLinear:
    """Mixin before megatron-core's Column/RowParallelLinear: ``F.linear`` where :func:`_native` holds."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        if not args and _native(kwargs):
            return F.linear(input, weight, kwargs.get("bias"))
        return super()._forward_impl(input, weight, *args, **kwargs)


class NativeColumnParallelLinear(_NativeLinear, ColumnParallelLinear):
    pass


class NativeRowParallelLinear(_NativeLinear, RowParallelLinear):
    pass


_NATIVE = {ColumnParallelLinear: NativeColumnParallelLinear, RowParallelLinear: NativeRowParallelLinear}


def _use_native_linears(submodules) -> None:
    for name in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"):
        cls = getattr(submodules, name, None)
        if cls in _NATIVE:
            setattr(submodules, name, _NATIVE[cls])


def use_local_layers(layer_spec) -> None:
    """Swap core attention, MLP and linears of a local GPT layer spec (in place) for the classes above. An
    MoE layer (megatron-core's ``MoELayer``, whose experts megatron builds as plain ``MLP``s) is kept, with
    its experts' linears swapped."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    attention = layer_spec.submodules.self_attention.submodules
    mlp = layer_spec.submodules.mlp
    if attention.core_attention is not DotProductAttention or mlp.module not in (MLP, MoELayer):
        raise TypeError(f"expected megatron-core's local DotProductAttention and MLP (or MoELayer) in the spec, "
                        f"found {attention.core_attention!r} and {mlp.module!r}")
    attention.core_attention = SDPAttention
    _use_native_linears(attention)
    if mlp.module is MLP:
        mlp.module = SwiGLUMLP
        _use_native_linears(mlp.submodules)
    else:
        for experts in (mlp.submodules.experts, mlp.submodules.shared_experts):
            if experts is not None:
                _use_native_linears(experts.submodules)
    logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_known_mlp_subclass)


def _known_mlp_subclass(record: logging.LogRecord) -> bool:
    """Drop megatron-core's per-layer "Unknown MLP type" warning: it passes ``tp_group`` only to an
    exact ``MLP``, and a subclass falls back to the default tensor-parallel group, the same group."""
    return not record.getMessage().startswith("Unknown MLP type")


def _opmath(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype torch's ``rms_norm`` computes in: float32 for half inputs, else its own."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


class RMSNormFunction(torch.autograd.Function):
    """``torch.rms_norm`` over the last dimension with a weight, saving its input and ``1/rms`` for
    backward. PyTorch's composite CPU ``rms_norm`` saves the normalised input too (a second tensor of the
    input's size per norm: 17 of them, 0.15 GB, in the 30M model's 64 x 68-token micro-batch); backward
    recomputes it with one product. Forward runs torch's ops in torch's order (bit-identical output);
    backward is the closed form ``r * (g - x_hat * mean(g * x_hat))`` with ``g = grad * weight`` in the
    computation dtype (float32 for half inputs, as torch upcasts), so it differs from autograd's chain
    by rounding only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        up = _opmath(x)
        r = torch.rsqrt(up.pow(2).mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, r, weight)
        return up.mul(r).mul(weight).type_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, r, weight = ctx.saved_tensors
        up = _opmath(x)
        x_hat = up * r
        grad_up = grad.to(up.dtype)
        grad_weight = (grad_up * x_hat).reshape(-1, x.shape[-1]).sum(0).type_as(weight)
        g = grad_up * weight
        grad_x = r * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
        return grad_x.type_as(x), grad_weight, None


class LeanRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (same parameters and state dict) through :class:`RMSNormFunction` when training."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or self.weight is None or len(self.normalized_shape) != 1:
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return RMSNormFunction.apply(x, self.weight, eps)


class LocalNorm:
    """The local spec's norm (``WrappedTorchNorm``), with RMSNorm as :class:`LeanRMSNorm` and sequence
    parallelism accepted: megatron-core's ``WrappedTorchNorm`` refuses a config with ``sequence_parallel``,
    though a norm computes each token on its own and is indifferent to which tokens a rank holds. What it
    lacks is the gradient reduction: with the sequence split over TP ranks each rank's weight gradient covers
    its tokens only. The norm is built without the flag and its parameters are marked ``sequence_parallel``,
    which makes megatron-core's ``finalize_model_grads`` sum their gradients over the TP group (as Transformer
    Engine's norms are marked; the router marks its own). q/k norms, which megatron-core sums over TP anyway,
    are summed once."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm") -> torch.nn.Module:
        plain = copy.copy(config)  # WrappedTorchNorm reads a few fields; no __post_init__ runs again
        plain.sequence_parallel = False
        norm = WrappedTorchNorm(plain, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
        if type(norm) is torch.nn.RMSNorm:
            norm = LeanRMSNorm(norm.normalized_shape, eps=norm.eps, elementwise_affine=norm.elementwise_affine)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def use_local_norms(layer_spec) -> None:
    """Swap the ``WrappedTorchNorm``s of a local GPT layer spec (in place) for :class:`LocalNorm`: the layer's
    input and pre-MLP norms and the attention's q/k norms. The decoder's final norm is the block's
    (``mcore_compat.decoder_block_spec``)."""
    layer = layer_spec.submodules
    attention = layer.self_attention.submodules
    for owner, name in ((layer, "input_layernorm"), (layer, "pre_mlp_layernorm"), (attention, "q_layernorm"),
                        (attention, "k_layernorm")):
        if getattr(owner, name) is WrappedTorchNorm:
            setattr(owner, name, LocalNorm)
    left = [n for n in ("input_layernorm", "pre_mlp_layernorm") if getattr(layer, n) is not LocalNorm]
    if left:
        raise TypeError(f"expected megatron-core's local WrappedTorchNorm for {left} in the spec, found "
                        f"{[getattr(layer, n) for n in left]!r}")
