"""Build megatron-core GPTModels from a :class:`ModelSpec` for any TP/PP/VPP layout.

The decoder layers use Transformer Engine's spec when TE is importable (GPU clusters) and
megatron-core's local spec (pure PyTorch) otherwise. Parallel state must already be initialised
(``megarl.parallel.init.init_distributed``); pre/post-process stages follow from it. This module
also maps a built model's parameters to global names (stage-local layer index -> global), which
conversion, resharding and tests share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer import TransformerConfig

from megarl.models.local_layers import LocalNorm, use_local_layers, use_local_norms
from megarl.models.mapping import local_name, split_expert_name, split_layer_name, with_expert, with_layer
from megarl.models.padding_idx import use_padding_idx
from megarl.models.spec import Head, ModelSpec
from megarl.parallel import cpu_compat, mcore_compat
from megarl.parallel.layout import ParallelLayout


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    """How to build the model (not what the model is: that is the ModelSpec)."""

    dtype: torch.dtype = torch.float32
    use_te: bool | None = None  # None: TE when available
    init_weights: bool = True  # False: leave parameters uninitialised (they will be loaded)
    vocab_divisible_by: int = 128
    vocab_tp: int | None = None  # pad the vocabulary as for this TP size (None: the layout's)
    dropout: float = 0.0
    seed: int = 0  # initial scalar-head weights (identical on every rank: the head is replicated)
    local_layers: bool = True  # local spec: megarl/models/local_layers.py (SDPA attention, lean SwiGLU, RMSNorm)
    moe_aux_loss_coeff: float = 0.0  # MoE: weight of the router's load-balancing loss in training
    router_replay: bool = False  # MoE: megatron-core's RouterReplay on every router (targets set per micro-batch)
    sequence_parallel: bool = False  # megatron-core's sequence parallelism (at tp > 1; ignored at tp 1)
    # transformers' nn.Embedding(padding_idx=pad_token_id): the pad row gets no gradient from the input lookup
    # (megarl/models/padding_idx.py); False: megatron-core's embedding as it is, every row trained by its lookups
    padding_idx: bool = True


class ScalarHead(torch.nn.Module):
    """One value per token, in place of megatron's vocabulary output layer ([s, b, h] -> [s, b, 1]).

    Replicated over tensor-parallel ranks (hidden states are identical there), called like
    megatron's ``ColumnParallelLinear`` output layer. Checkpointed as a replicated tensor. With
    sequence parallelism each TP rank receives its part of the sequence: the head gathers the whole
    sequence first, and in backward each rank keeps its own part of the (identical) gradient, so the
    weight's gradient is whole on every TP rank and needs no reduction.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, seed: int, init: bool,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        if init:
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                self.weight.copy_(torch.randn(1, hidden_size, generator=gen) / hidden_size**0.5)

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_states, self.weight), None


def transformer_config(spec: ModelSpec, layout: ParallelLayout, opts: BuildOptions) -> TransformerConfig:
    spec.check_layout(layout)
    on_gpu = torch.cuda.is_available()
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        hidden_dropout=opts.dropout,
        attention_dropout=opts.dropout,
        tensor_model_parallel_size=layout.tp,
        context_parallel_size=layout.cp,
        cp_comm_type="p2p" if layout.cp > 1 else None,  # Transformer Engine's ring; megarl's CPU attention all-gathers
        sequence_parallel=opts.sequence_parallel and layout.tp > 1,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        params_dtype=opts.dtype,
        pipeline_dtype=opts.dtype,
        bf16=opts.dtype == torch.bfloat16,
        fp16=opts.dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        perform_initialization=opts.init_weights,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        variable_seq_lengths=layout.pp > 1,  # micro-batches are cut to their own longest sequence
        moe_token_dispatcher_type="alltoall",  # "allgather" rejects variable sequence lengths
        **_moe_config(spec, layout, opts),
    )


def _moe_config(spec: ModelSpec, layout: ParallelLayout, opts: BuildOptions) -> dict:
    """megatron-core's MoE settings that reproduce the HF router: softmax over all experts then top-k
    (``pre_softmax``), or top-k logits then a softmax over those k, which equals renormalised top-k
    probabilities (``norm_topk_prob``); router in fp32 like transformers; experts as one MLP each
    (no grouped GEMM, whose parameter names and kernels differ), expert tensor parallelism 1."""
    if spec.moe is None:
        return {}
    m = spec.moe
    return dict(
        num_moe_experts=m.num_experts,
        moe_router_topk=m.top_k,
        moe_ffn_hidden_size=m.ffn_hidden_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not m.norm_topk_prob,
        moe_router_dtype="fp32",
        moe_grouped_gemm=False,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=opts.moe_aux_loss_coeff,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=1,
        moe_enable_routing_replay=opts.router_replay,
    )


def padded_vocab_size(spec: ModelSpec, layout: ParallelLayout, opts: BuildOptions) -> int:
    return spec.padded_vocab_size(opts.vocab_tp or layout.tp, opts.vocab_divisible_by)


def build_model(spec: ModelSpec, layout: ParallelLayout, opts: BuildOptions = BuildOptions()) -> list[GPTModel]:
    """This rank's model chunks (one per virtual pipeline stage; one without VPP)."""
    config = transformer_config(spec, layout, opts)
    if spec.moe is not None:
        cpu_compat.redirect_moe()
    use_te = mcore_compat.transformer_engine_available() if opts.use_te is None else opts.use_te
    num_experts = spec.moe.num_experts if spec.moe else None
    layer_spec = mcore_compat.gpt_layer_spec(use_te=use_te, qk_layernorm=spec.qk_layernorm, num_experts=num_experts)
    if not use_te and opts.local_layers:
        use_local_layers(layer_spec)
    mcore_compat.vectorize_thd_rope()  # packed micro-batches (the engine's default) apply RoPE per sequence
    if config.sequence_parallel or layout.cp > 1:  # context parallelism gathers with the same functions
        cpu_compat.redirect_sequence_parallel()
    # lean RMSNorms with the local layers; sequence parallelism needs these norms either way (TE's support it)
    local_norms = not use_te and (opts.local_layers or config.sequence_parallel)
    if local_norms:
        use_local_norms(layer_spec)
    chunks = []
    for vp in range(layout.vpp_size):
        vp_stage = vp if layout.vpp else None
        block_spec = layer_spec
        if local_norms:  # the decoder's final norm too
            block_spec = mcore_compat.decoder_block_spec(config, layer_spec, vp_stage, layer_norm=LocalNorm)
        model = GPTModel(
            config=config,
            transformer_layer_spec=block_spec,
            vocab_size=padded_vocab_size(spec, layout, opts),
            max_sequence_length=spec.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
            rope_scaling=spec.rope_scaling_factor is not None,
            rope_scaling_factor=spec.rope_scaling_factor or 8.0,
            vp_stage=vp_stage,
        )
        if opts.padding_idx and spec.embedding_padding_idx is not None and model.pre_process:
            use_padding_idx(model.embedding.word_embeddings, spec.embedding_padding_idx)
        if spec.head is Head.SCALAR and model.post_process:
            model.output_layer = ScalarHead(spec.hidden_size, opts.dtype, opts.seed, opts.init_weights,
                                            sequence_parallel=config.sequence_parallel)
        if not opts.init_weights:
            mark_tensor_parallel_weights(model)
        # megatron's local-spec norms ignore params_dtype; keep one dtype like Float16Module does
        model.to(dtype=opts.dtype)
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def mark_tensor_parallel_weights(model: torch.nn.Module) -> None:
    """Mark each tensor-parallel weight as split (``tensor_model_parallel``, its partition dim), as megatron-core's
    own initialisation does: built without it (``perform_initialization=False``: the weights are loaded),
    megatron-core's local layers leave the mark off, and its gradient-norm (``param_is_not_tensor_parallel_duplicate``)
    then counts every TP rank's shard of those weights but rank 0's as a duplicate: at TP2 the norm, and with
    ``clip_grad`` the clipped update, came out wrong (0.90x of TP1's on the tiny model). Transformer Engine's layers
    mark their weights themselves."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    dims = ((ColumnParallelLinear, 0), (RowParallelLinear, 1), (VocabParallelEmbedding, 0))
    for module in model.modules():
        dim = next((d for cls, d in dims if isinstance(module, cls)), None)
        weight = getattr(module, "weight", None)
        if dim is not None and isinstance(weight, torch.nn.Parameter) and not hasattr(weight, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(weight, True, dim, 1)


def global_named_parameters(model: GPTModel) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(global local-spec name, parameter) of one model chunk; layer indices made global.

    Uses each layer's own ``layer_number`` (megatron computes the pipeline offset, including
    uneven and VPP layouts), never a recomputed offset, and each MoE layer's own expert-parallel
    group for the global expert index. The tied output layer copy on the last stage is skipped: the
    embedding owns the shared weight.
    """
    offsets = {f"decoder.layers.{i}.": layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
    expert_offsets = {i: layer.mlp.experts.ep_group.rank() * layer.mlp.experts.num_local_experts
                      for i, layer in enumerate(model.decoder.layers) if hasattr(layer.mlp, "experts")}
    for name, param in model.named_parameters():
        name = name.removeprefix("module.")
        if model.share_embeddings_and_output_weights and name == "output_layer.weight":
            continue
        layer, suffix = split_layer_name(name)
        if layer is not None:
            expert, _ = split_expert_name(suffix)
            if expert is not None:
                name = with_expert(name, expert_offsets[layer] + expert)
            name = with_layer(name, offsets[f"decoder.layers.{layer}."])
        yield local_name(name), param
