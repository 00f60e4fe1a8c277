"""Per-device memory arithmetic for one role of one layout: training state, activations, rollout
weights, KV cache and the resharding transient (either end of it with split placement). Bytes, per rank,
as pure functions.

Pure module: no torch.distributed, no megatron-core, no Ray. Parameter counts come from the same
name/shape rules the engine and the converters use (:mod:`megarl.models.mapping`), so padding of
the vocabulary, replicated norms, the tied output-layer copy and the scalar head are counted the
way Megatron allocates them. Ranks of one pipeline stage are identical (TP shards are equal; the
distributed optimizer's DP shards differ by padding only), so everything is given per stage.

Training state per parameter a rank holds (megarl's engine: ``grad_reduce_in_fp32=True``):

* bf16: weights 2 B, gradient buffer 4 B, optimizer 4 B fp32 master + 4 B x Adam moments
  (= 12 B), divided by DP with the distributed optimizer (docs/planner.md §3.1).
* fp32: weights 4 B, gradients 4 B, optimizer 4 B x moments (the fp32 weights are the master copy).

Mixture-of-Experts models (``spec.moe``) at expert parallelism ``ep`` (docs/planner.md §10): a rank holds
the ``E/ep`` experts of its expert-parallel rank in every MoE layer of its stage, whole (expert tensor
parallelism is 1: tensor parallelism does not divide them); the router and everything else are counted as
for a dense model. The distributed optimizer shards the dense parameters over DP and the expert parameters
over the expert-data-parallel group (``tp*dp/ep`` ranks: megatron-core's expert DP), each with its own
ceiling. Gradient buffers are not sharded, as for dense parameters.

Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv 2205.05198), section 4, re-derived for the Llama-style block (GQA, SwiGLU, RMSNorm,
no dropout) with tensor parallelism t. Per token and layer, in units of the activation itemsize (2 B in bf16):

    replicated over TP:  4h          two norm inputs, the qkv input, the fc1 input
    split over TP:      (2*n_h*d + 2*n_g*d + 4F) / t   q and the o_proj input, k and v, [gate; up],
                                                       silu(gate) and the fc2 input
    attention scores:    n_h * s / t  the softmax output (2 B each), kept only without recompute

With GPT's block (MHA, 4h GeLU MLP, dropout masks) the same bookkeeping gives the paper's
``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` bytes (Eq. 2). ``SELECTIVE`` recomputes the attention core
(or runs flash attention): no ``s^2`` term (Eq. 6). ``FULL`` keeps each layer's input (``h``
values per token) and rebuilds one layer at a time.

An MoE layer replaces ``4F/t`` by its dispatched tokens: every token reaches ``k`` experts (top-k), each
copy keeping the expert's input, the SwiGLU's ``4I`` and the combine's (probability-weighted) input, whole
on its rank: ``k*(2h + 4I)`` values per token, plus the router's fp32 probabilities (``4E`` bytes); the
router's input is the ``h`` the dense block counts as the fc1 input. Balanced routing: every rank receives
``k`` copies per token it routes, whatever ``ep``.

Sequence parallelism (megarl's default for an MoE model at t > 1, :func:`sequence_parallel`; what megatron-core
needs to train MoE layers at TP > 1) splits the sequence over the TP ranks outside attention and the MLP: the
replicated ``4h``, the dispatched copies, the router's probabilities and a fully recomputed layer's input are
divided by ``t`` too (the paper's Eq. 4: every term over ``t``).

Packed micro-batches (``EngineConfig.packing``, the default; :mod:`megarl.planner.packing`): the budget counts real
tokens and first fit fills each micro-batch to it, so the fullest one holds ``max(budget, s)`` tokens (a longer
sequence travels alone); padded micro-batches hold ``budget // s`` rows of ``s`` (every row planned at the longest).

Context parallelism (``cp``, docs/planner.md §12): every sequence is cut into ``2 cp`` chunks, a rank holds two, so
each rank keeps the activations of ``tokens / cp`` of every micro-batch (every per-token term above, the scores'
``s`` still the whole sequence's: a query attends to its sequence's keys on every rank), and its logits. Attention
gathers the micro-batch's keys and values over the CP group one layer at a time: ``2 n_g d / t`` values per token of
the whole micro-batch, a transient of one layer (Transformer Engine's ring holds less: two ranks' chunks in
flight). Weights and gradients are replicated over CP; the distributed optimizer shards over DP x CP
(megatron-core's ``intra_dp_cp_group``: ``distributed_data_parallel.py`` allocates the buffers over it and
``optimizer/__init__.py`` hands it to the distributed optimizer), experts over the expert-data-parallel group
(``tp cp dp / ep`` ranks).

The 1F1B schedule holds ``pp - stage`` micro-batches on a stage; the interleaved schedule (VPP v) holds
Megatron's warm-up count ``2*(pp - stage - 1) + (v - 1)*pp + 1`` chunks of ``L/(pp*v)`` layers (the paper's
``1 + (p-1)/(p*v)`` factor on the first stage). The last stage of an LM head also keeps fp32 logits and their
softmax (8 B x tokens x V/t).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math

from megarl.engine.config import EngineConfig, Precision
from megarl.errors import ConfigError
from megarl.models.mapping import mcore_shape, split_expert_name, split_layer_name, tensor_maps
from megarl.models.spec import Head, ModelSpec
from megarl.parallel.layout import ParallelLayout
from megarl.resharding.plan import HFTensor, dest_range, hf_tensors

GB = 1e9  # decimal gigabytes, as docs/planner.md counts them (M = 141.1 GB for 70.55 B bf16 parameters)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class Recompute(enum.Enum):
    NONE = "none"  # every activation kept (unfused attention: the s^2 scores too)
    SELECTIVE = "selective"  # attention core recomputed, or flash attention: no s^2 term
    FULL = "full"  # only each layer's input kept; one layer rebuilt at a time


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Training state of one rank: weights, gradient buffer, optimizer (master copy + moments)."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def param_bytes(precision: Precision) -> int:
    """Bytes per weight; the planner plans GPU runs, where ``auto`` is bfloat16."""
    return 2 if precision.resolve(cuda=True) is Precision.BF16 else 4


def itemsize(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPE_BYTES)}.")
    return DTYPE_BYTES[dtype]


# -------------------------------------------------------------------------------------- parameters


def stage_of_layers(spec: ModelSpec, layout: ParallelLayout) -> dict[int, int]:
    """Global layer index -> pipeline rank holding it (all virtual stages)."""
    out = {}
    for pp in range(layout.pp):
        for vp in range(layout.vpp_size):
            out.update(dict.fromkeys(layout.layers_of_stage(spec.num_layers, pp, vp), pp))
    return out


@functools.lru_cache(maxsize=256)  # plain ints of frozen (spec, layout) pairs: propose() asks many times
def _stage_shards(spec: ModelSpec, layout: ParallelLayout) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """Per pipeline stage: (dense shards, expert shards) of one of its ranks; element counts of every Megatron
    parameter it holds (TP shards of split tensors, whole replicated ones; Megatron's padded vocabulary;
    experts whole, those of expert-parallel rank 0: every expert-parallel rank holds as many)."""
    vp = spec.padded_vocab_size(layout.tp)
    stage_of = stage_of_layers(spec, layout)
    mine = layout.experts_of(spec.moe.num_experts, 0) if spec.moe else range(0)
    dense: list[list[int]] = [[] for _ in range(layout.pp)]
    experts: list[list[int]] = [[] for _ in range(layout.pp)]
    for first, layer, expert, split, n in _parameter_sizes(spec, vp):
        stage = stage_of[layer] if layer is not None else (0 if first else layout.pp - 1)
        if expert is not None:
            if expert in mine:
                experts[stage].append(n)  # tp_dim is None: an expert is whole on its rank
            continue
        dense[stage].append(n // layout.tp if split else n)
    if spec.tie_word_embeddings and spec.head is Head.LM and layout.pp > 1:
        dense[-1].append(vp // layout.tp * spec.hidden_size)  # the last stage's copy of the tied output layer
    return tuple((tuple(d), tuple(e)) for d, e in zip(dense, experts, strict=True))


@functools.lru_cache(maxsize=16)
def _parameter_sizes(spec: ModelSpec, padded_vocab: int) -> tuple[tuple[bool, int | None, int | None, bool, int], ...]:
    """(on the first stage, layer, expert, split by TP, elements) of every Megatron parameter: the mapping read
    once per model (an MoE model has ~10^4 parameters; propose() lays it out many times)."""
    return tuple((m.mcore.startswith("embedding"), m.layer, m.expert, m.tp_dim is not None,  # embedding first
                  math.prod(mcore_shape(m, spec, padded_vocab))) for m in tensor_maps(spec))


def stage_parameter_shards(spec: ModelSpec, layout: ParallelLayout) -> tuple[tuple[int, ...], ...]:
    """Per pipeline stage: the element count of every Megatron parameter one of its ranks holds (TP shards
    of split tensors, whole replicated ones; Megatron's padded vocabulary; its expert-parallel share of the
    experts, whole)."""
    return tuple(d + e for d, e in _stage_shards(spec, layout))


def stage_parameters(spec: ModelSpec, layout: ParallelLayout) -> list[int]:
    """Parameters held by one rank of each pipeline stage."""
    return [sum(s) for s in stage_parameter_shards(spec, layout)]


def stage_expert_parameters(spec: ModelSpec, layout: ParallelLayout) -> list[int]:
    """Expert parameters (MoE experts, not the router) held by one rank of each pipeline stage; 0 when dense."""
    return [sum(e) for _, e in _stage_shards(spec, layout)]


def training_state_bytes(
    spec: ModelSpec,
    layout: ParallelLayout,
    precision: Precision,
    distributed_optimizer: bool,
    *,
    optimizer_states: int = 2,
) -> list[StateBytes]:
    """Weights, gradient buffer and optimizer bytes of one rank of each pipeline stage.

    ``optimizer_states``: fp32 tensors per parameter besides the master copy (Adam: 2; SGD with
    momentum: 1; 0 gives what exists before the first step, when Adam's moments are not yet made).
    """
    p = param_bytes(precision)
    master = 4 if p == 2 else 0
    out = []
    for n, e in zip(stage_parameters(spec, layout), stage_expert_parameters(spec, layout), strict=True):
        # the distributed optimizer: dense parameters over DP x CP, experts over the expert-data-parallel group
        shard = (math.ceil((n - e) / optimizer_shards(layout)) + math.ceil(e / layout.expert_dp)
                 if distributed_optimizer else n)
        out.append(StateBytes(params=n * p, grads=n * 4, optimizer=shard * (master + 4 * optimizer_states)))
    return out


def optimizer_shards(layout: ParallelLayout) -> int:
    """Ranks the distributed optimizer shards a dense parameter's state over: megatron-core's DP x CP group
    (``intra_dp_cp_group``; context-parallel ranks hold the same weights and reduce their gradients together)."""
    return layout.dp * layout.cp


# ------------------------------------------------------------------------------------- activations


def micro_batch_shape(micro_batch_tokens: int, seq_len: int) -> tuple[int, int]:
    """(sequences, sequence length) of a full micro-batch: the engine packs rows while
    ``rows * longest <= max_tokens``, and a longer sequence travels alone."""
    if micro_batch_tokens < 1 or seq_len < 1:
        raise ValueError(f"micro-batch tokens and sequence length must be >= 1, found {micro_batch_tokens}, {seq_len}")
    return max(1, micro_batch_tokens // seq_len), seq_len


def micro_batch_fill(budget: int, seq_len: int, packed: bool) -> int:
    """Tokens of the fullest micro-batch of sequences up to ``seq_len`` under a ``budget`` of tokens: packed, the
    budget (first fit fills it with real tokens) or one longer sequence alone; padded, ``budget // seq_len`` rows of
    ``seq_len`` (:func:`micro_batch_shape`). Alignment padding (docs/planner.md §12.2) is not counted."""
    b, s = micro_batch_shape(budget, seq_len)
    return max(budget, s) if packed else b * s


def sequence_parallel(spec: ModelSpec, tp: int) -> bool:
    """Whether a training engine runs ``spec`` at ``tp`` with sequence parallelism by default
    (``EngineConfig.sequence_parallel: null``: an MoE model at tp > 1)."""
    return EngineConfig().uses_sequence_parallel(spec.moe is not None, tp)


def layer_activation_bytes(spec: ModelSpec, tp: int, tokens: int, seq_len: int, recompute: Recompute,
                           act_bytes: int) -> int:
    """Activations one layer keeps for one micro-batch of ``tokens`` tokens (sequences of ``seq_len``)."""
    h, d, f = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    sp = tp if sequence_parallel(spec, tp) else 1  # the sequence-split parts are divided by this
    if recompute is Recompute.FULL:
        return tokens * h * act_bytes // sp
    m = spec.moe
    mlp_split = 4 * f if m is None else 0  # an MoE layer's experts are whole on their rank (no TP)
    per_token = 4 * h / sp + (2 * spec.num_attention_heads * d + 2 * spec.num_query_groups * d + mlp_split) / tp
    router = 0
    if m is not None:  # k dispatched copies of each token; the router's fp32 probabilities
        per_token += m.top_k * (2 * h + 4 * m.ffn_hidden_size) / sp
        router = tokens * 4 * m.num_experts // sp
    if recompute is Recompute.NONE:
        per_token += spec.num_attention_heads * seq_len / tp
    return int(tokens * per_token * act_bytes) + router


def in_flight_layers(spec: ModelSpec, layout: ParallelLayout, stage: int) -> int:
    """Layer-micro-batches whose activations a stage holds at its peak (1F1B or interleaved warm-up)."""
    p, v = layout.pp, layout.vpp_size
    chunk = spec.num_layers // (p * v)
    chunks = p - stage if v == 1 else 2 * (p - stage - 1) + (v - 1) * p + 1
    return chunks * chunk


def activation_bytes(spec: ModelSpec, layout: ParallelLayout, stage: int, *, micro_batch_tokens: int, seq_len: int,
                     recompute: Recompute, act_bytes: int = 2, packed: bool = False) -> int:
    """Peak activation bytes of one rank of ``stage`` while training (see the module docstring): ``packed``
    micro-batches fill the token budget (:func:`micro_batch_fill`); with context parallelism a rank keeps its
    ``1/cp`` of every micro-batch's tokens, plus one layer's keys and values of the whole micro-batch."""
    tokens = micro_batch_fill(micro_batch_tokens, seq_len, packed)
    local = -(-tokens // layout.cp)  # this CP rank's share (sequences are padded to 2 cp chunks)
    kept = in_flight_layers(spec, layout, stage) * layer_activation_bytes(spec, layout.tp, local, seq_len, recompute,
                                                                          act_bytes)
    if recompute is Recompute.FULL:  # the one layer being rebuilt for its backward pass
        kept += layer_activation_bytes(spec, layout.tp, local, seq_len, Recompute.SELECTIVE, act_bytes)
    kept += cp_gather_bytes(spec, layout, tokens, act_bytes)
    if stage == layout.pp - 1 and spec.head is Head.LM:
        kept += 8 * local * spec.padded_vocab_size(layout.tp) // layout.tp
    return kept


def cp_gather_bytes(spec: ModelSpec, layout: ParallelLayout, tokens: int, act_bytes: int) -> int:
    """Context parallelism's transient: one layer's keys and values of the whole micro-batch of ``tokens``, gathered
    over the CP group (this TP rank's ``n_g / t`` KV heads); 0 at cp 1."""
    if layout.cp == 1:
        return 0
    return tokens * 2 * spec.num_query_groups * spec.head_dim // layout.tp * act_bytes


# ------------------------------------------------------------------------------ rollout and resharding


@functools.lru_cache(maxsize=64)  # propose() asks once per candidate; an MoE model has ~10^4 HF tensors
def rollout_weight_bytes(spec: ModelSpec, rollout_tp: int, dtype_bytes: int) -> int:
    """Rollout weights on the fullest rollout TP rank (vLLM's layout: vocabulary rows padded to 64 and
    split evenly, KV heads replicated when rollout tp exceeds the KV groups), from the resharding
    plan's own range rules. MoE experts: vLLM's fused-MoE layer (no expert parallelism) splits every
    expert's intermediate dimension over its TP ranks, ``ceil(I/G)`` rows or columns each; the router is
    replicated."""
    tensors = hf_tensors(spec, ParallelLayout())

    def held(t: HFTensor, g: int) -> int:
        if spec.moe is not None and _is_expert(t.mcore):
            inter = spec.moe.ffn_hidden_size  # gate/up [I, H], down [H, I]
            return math.prod(t.shape) // inter * math.ceil(inter / rollout_tp)
        lo, hi = dest_range(t, spec, rollout_tp, g)
        return (hi - lo) * t.row_elems

    return max(sum(held(t, g) for t in tensors) for g in range(rollout_tp)) * dtype_bytes


def _is_expert(mcore: str) -> bool:
    return split_expert_name(split_layer_name(mcore)[1])[0] is not None


def kv_cache_bytes(spec: ModelSpec, rollout_tp: int, dtype_bytes: int, tokens: int) -> int:
    """KV cache on one GPU for ``tokens`` cached tokens of its rollout replica:
    ``2 * layers * kv_heads/TP_g * head_dim * bytes * tokens`` (at least one KV head per GPU)."""
    heads = max(1, spec.num_query_groups // rollout_tp)
    return 2 * spec.num_layers * heads * spec.head_dim * dtype_bytes * tokens


def reshard_transient_bytes(spec: ModelSpec, layout: ParallelLayout, rollout_tp: int, *, param_dtype_bytes: int,
                            rollout_dtype_bytes: int, bucket_bytes: int) -> int:
    """Extra memory of one weight sync into vLLM (megarl.resharding.transport with ``full_tensors``): the
    bucket cap, or the largest single HF tensor when that exceeds the cap (it travels alone, received into
    a full-shape buffer), plus the pieces of the largest Megatron parameter shard being split on the
    sending side. ``rollout_tp`` does not change it: vLLM's loaders take full-shape tensors at any tp."""
    return (receive_transient_bytes(spec, layout, rollout_dtype_bytes=rollout_dtype_bytes, bucket_bytes=bucket_bytes)
            + largest_shard_bytes(spec, layout, param_dtype_bytes))


def receive_transient_bytes(spec: ModelSpec, layout: ParallelLayout, *, rollout_dtype_bytes: int,
                            bucket_bytes: int) -> int:
    """The receiving side of a weight sync (a rollout rank of a split placement only receives): the bucket
    cap, or the largest HF tensor in full shape when that exceeds the cap."""
    return max(bucket_bytes, _largest_hf_tensor(spec) * rollout_dtype_bytes)


@functools.lru_cache(maxsize=16)
def _largest_hf_tensor(spec: ModelSpec) -> int:
    """Elements of the model's largest HF tensor (shapes do not depend on the layout)."""
    return max(math.prod(t.shape) for t in hf_tensors(spec, ParallelLayout()))


def send_transient_bytes(spec: ModelSpec, layout: ParallelLayout, *, param_dtype_bytes: int, bucket_bytes: int) -> int:
    """The sending side of a weight sync (a training rank of a split placement only sends): one bucket of
    outgoing slab copies (within the cap: a tensor over it travels in parts cut to fit) plus the converted
    pieces of the largest Megatron parameter shard. An upper bound: a model smaller than the cap sends less."""
    return bucket_bytes + largest_shard_bytes(spec, layout, param_dtype_bytes)


def largest_shard_bytes(spec: ModelSpec, layout: ParallelLayout, param_dtype_bytes: int) -> int:
    """The largest Megatron parameter shard any rank holds, in the training dtype."""
    return max(max(s) for s in stage_parameter_shards(spec, layout)) * param_dtype_bytes


# ------------------------------------------------------------------------------- vLLM's own reservations
#
# vLLM 0.32 on CUDA (v1/worker/gpu_worker.py, v1/worker/utils.py): at start-up it requires free memory >=
# ceil(gpu_memory_utilization x total) (``request_memory``, a ValueError otherwise), then sizes its KV cache as
# that budget less ``non_kv_cache_memory`` (its weights, the activation peak of ``profile_run`` at
# max_num_batched_tokens, the non-torch memory it added since its snapshot) less the CUDA-graph memory it profiles
# (``profile_cudagraph_memory``; none with enforce_eager). The graph pool is not in the cuMem pool that sleep
# frees (``sleep_mode_offload_cudagraph`` is off by default): it stays resident while the policy trains.

# max_num_batched_tokens and max_num_seqs of the LLM class megarl builds (engine/arg_utils.py get_batch_defaults):
# on a GPU of >= 70 GiB 16384 and 1024 (an A100 gets the small pair: the planner does not know the GPU's name and
# takes the large one, which only over-counts), below it 8192 and 256
VLLM_LARGE_GPU = 70 * 2**30
VLLM_BATCH_LARGE, VLLM_BATCH_SMALL = (16384, 1024), (8192, 256)
VLLM_MAX_GRAPH_TOKENS = 512  # config/vllm.py: max_cudagraph_capture_size = min(2 x max_num_seqs, 512)
VLLM_GRAPH_OVERHEAD = 2**20  # v1/worker/gpu/cudagraph_utils.py _MIN_PER_GRAPH_BYTES: the floor per captured graph


def vllm_batch(gpu_bytes: int) -> tuple[int, int]:
    """vLLM's default (max_num_batched_tokens, max_num_seqs) on a GPU of ``gpu_bytes``."""
    return VLLM_BATCH_LARGE if gpu_bytes >= VLLM_LARGE_GPU else VLLM_BATCH_SMALL


def vllm_profile_bytes(spec: ModelSpec, rollout_tp: int, dtype_bytes: int, batched_tokens: int,
                       max_seqs: int) -> int:
    """The activation peak of vLLM's ``profile_run``: one forward of ``batched_tokens`` tokens (attention skipped)
    whose largest layer transient is the hidden state and residual (2h) plus the wider of attention's projections
    (q, k, v and the attention output: (2 n_h + 2 n_g) d / G) and the MLP's (gate/up and their product: 3F/G;
    MoE: top-k copies of the token and 3 x ceil(I/G) each), then the sampler over ``min(max_seqs, tokens)`` rows of
    the full vocabulary: the logits in the rollout dtype and two fp32 copies (float logits, their softmax)."""
    h, d = spec.hidden_size, spec.head_dim
    attn = (2 * spec.num_attention_heads + 2 * spec.num_query_groups) * d // rollout_tp
    m = spec.moe
    mlp = 3 * spec.ffn_hidden_size // rollout_tp if m is None else m.top_k * (h + 3 * math.ceil(m.ffn_hidden_size
                                                                                               / rollout_tp))
    layer = batched_tokens * (2 * h + max(attn, mlp)) * dtype_bytes
    rows = min(max_seqs, batched_tokens)
    return layer + rows * spec.vocab_size * (dtype_bytes + 8)


def vllm_graph_bytes(spec: ModelSpec, dtype_bytes: int, max_seqs: int) -> int:
    """CUDA-graph memory: the largest captured batch (``min(2 x max_seqs, 512)`` tokens) keeps every layer's hidden
    state and residual (2h) in the graph pool, plus the per-graph floor for each captured size ([1, 2, 4], 8 to 248
    by 8, 256 up by 16) in both modes (full and piecewise). An estimate (vLLM measures it at start-up)."""
    tokens = min(2 * max_seqs, VLLM_MAX_GRAPH_TOKENS)
    sizes = [s for s in (1, 2, 4) if s <= tokens] + list(range(8, min(tokens + 1, 256), 8)) + list(
        range(256, tokens + 1, 16))
    return tokens * spec.num_layers * 2 * spec.hidden_size * dtype_bytes + 2 * len(sizes) * VLLM_GRAPH_OVERHEAD
