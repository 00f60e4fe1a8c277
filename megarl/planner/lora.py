"""LoRA in the planner (issue #45): the training state of a policy whose base is frozen, the merge transient of
its weight sync, and the bytes of an adapter-only sync. Per rank and per pipeline stage, as pure functions.

Pure module: no torch.distributed, no megatron-core, no Ray. Factor shapes and their tensor-parallel split come
from :mod:`megarl.models.adapters`, the rules megarl's adapters (megarl/models/lora.py) and their peft export use:
each targeted linear has ``A`` [r, in] and ``B`` [out, r] over megatron-core's fused weight (qkv: one ``A`` for
q, k and v; fc1: one for gate and up); a column-parallel base (qkv, fc1) splits ``B`` over TP and replicates
``A``, a row-parallel one (proj, fc2) the reverse; an MoE expert's factors are whole on the ranks holding it.

Training state per rank (megarl's engine: only the factors require grad, ``grad_reduce_in_fp32=True``):

* weights: the base (frozen, in the model dtype: no fp32 master copy) and the factors, in the model dtype;
* gradient buffer: the factors only, fp32, as megatron-core's DDP lays them out: with the distributed optimizer
  each tensor starts at a multiple of 64 elements and the buffer ends at a multiple of ``lcm(D, 128)``
  (``param_and_grad_buffer.py``; overlap_grad_reduce off, so one bucket per buffer); dense factors in one
  buffer over DP, expert factors in another over the expert-data-parallel group;
* optimizer: the factors only, fp32 master (bf16) + Adam moments; the distributed optimizer gives each rank
  ``1/D`` of the padded buffer, which holds at most that many elements (exact at ``D = 1``, and whenever the
  factors' sizes are multiples of 64, as ``r x hidden`` usually is). Torch's CPU AdamW keeps a 4-byte step
  counter per tensor beside them (GPU fused Adam one per group): not counted.

No reference copy: the policy's base model, adapters off, gives the reference log-probs.

Weight sync: a merged sync moves what a full one moves (each rank computes ``W + scale * B A`` of its own shard
and the resharding plan streams it like ``W``), plus the merge's float32 temporaries on the sender
(:func:`merge_transient_bytes`). An adapter-only sync into vLLM's LoRA support moves the adapter in peft's layout
(:func:`peft_bytes`), where every HF projection has its own ``A``: the fused ``A`` of qkv counts three times,
fc1's twice.
"""

from __future__ import annotations

import functools
import math

from megarl.engine.config import LoRAConfig, Precision
from megarl.models.adapters import FACTORS, adapted_maps, factor_shape, split_factor
from megarl.models.mapping import hf_shapes, mcore_shape
from megarl.models.spec import ModelSpec
from megarl.parallel.layout import ParallelLayout
from megarl.planner import memory
from megarl.planner.memory import StateBytes

# megatron-core's DDP with the distributed optimizer: each parameter starts 64 elements aligned, each bucket
# ends at a multiple of lcm(data-parallel size, 128)
PARAM_ALIGN, BUCKET_ALIGN = 64, 128


def adapter_parameters(spec: ModelSpec, lora: LoRAConfig) -> int:
    """Trained parameters of the whole model (every layer, every expert; megarl's fused factors, TP 1)."""
    return sum(math.prod(factor_shape(m, spec, f, lora.rank)) for m in adapted_maps(spec, lora.targets)
               for f in FACTORS)


def peft_parameters(spec: ModelSpec, lora: LoRAConfig) -> int:
    """The adapter's parameters in peft's layout: ``A`` [r, in] and ``B`` [out, r] per HF projection."""
    return sum(lora.rank * (out + in_) for m in adapted_maps(spec, lora.targets) for out, in_ in hf_shapes(m, spec))


def peft_bytes(spec: ModelSpec, lora: LoRAConfig, dtype_bytes: int) -> int:
    """Bytes of an adapter-only weight sync (what vLLM's LoRA support loads, peft's layout), in ``dtype_bytes``."""
    return peft_parameters(spec, lora) * dtype_bytes


def stage_adapter_shards(spec: ModelSpec, layout: ParallelLayout,
                         lora: LoRAConfig) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """Per pipeline stage: (dense factors, expert factors) of one of its ranks, element counts: each factor's TP
    shard where TP splits it, whole where it is replicated; the experts of expert-parallel rank 0 (every
    expert-parallel rank holds as many)."""
    return _stage_adapter_shards(spec, layout, lora.rank, tuple(lora.targets))


@functools.lru_cache(maxsize=64)  # propose() lays out many candidates; LoRAConfig (a list field) is no cache key
def _stage_adapter_shards(spec: ModelSpec, layout: ParallelLayout, rank: int,
                          targets: tuple[str, ...]) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    stage_of = memory.stage_of_layers(spec, layout)
    mine = layout.experts_of(spec.moe.num_experts, 0) if spec.moe else range(0)
    dense: list[list[int]] = [[] for _ in range(layout.pp)]
    experts: list[list[int]] = [[] for _ in range(layout.pp)]
    for m in adapted_maps(spec, targets):
        if m.expert is not None and m.expert not in mine:
            continue
        for f in FACTORS:
            n = math.prod(factor_shape(m, spec, f, rank))
            if m.expert is not None:
                experts[stage_of[m.layer]].append(n)  # expert-TP 1: whole
            else:
                dense[stage_of[m.layer]].append(n // layout.tp if split_factor(m, f) else n)
    return tuple((tuple(d), tuple(e)) for d, e in zip(dense, experts, strict=True))


def grad_buffer_elements(sizes: tuple[int, ...], dp: int, distributed_optimizer: bool) -> int:
    """Elements of megatron-core's gradient buffer for parameters of ``sizes`` (one bucket): with the distributed
    optimizer each starts at a multiple of 64 and the end is padded to a multiple of ``lcm(dp, 128)``."""
    if not distributed_optimizer or not sizes:
        return sum(sizes)
    starts = sum(math.ceil(n / PARAM_ALIGN) * PARAM_ALIGN for n in sizes)  # the last one's padding is in the end's
    return math.ceil(starts / math.lcm(dp, BUCKET_ALIGN)) * math.lcm(dp, BUCKET_ALIGN)


def _optimizer_elements(sizes: tuple[int, ...], dp: int, distributed_optimizer: bool) -> int:
    """The most factor elements one rank's optimizer holds: its ``1/dp`` of the padded buffer, never more than
    the factors themselves (dp 1: all of them, the padding holds no parameter)."""
    if not distributed_optimizer:
        return sum(sizes)
    return min(grad_buffer_elements(sizes, dp, True) // dp, sum(sizes))


def lora_state_bytes(spec: ModelSpec, layout: ParallelLayout, precision: Precision, distributed_optimizer: bool,
                     lora: LoRAConfig, *, optimizer_states: int = 2) -> list[StateBytes]:
    """Weights, gradient buffer and optimizer bytes of one rank of each pipeline stage of a LoRA policy: the
    frozen base and the factors as weights, the factors alone in the gradient buffer and the optimizer
    (``optimizer_states`` as :func:`megarl.planner.memory.training_state_bytes`)."""
    p = memory.param_bytes(precision)
    master = 4 if p == 2 else 0
    out = []
    base = memory.stage_parameters(spec, layout)
    for n, (dense, experts) in zip(base, stage_adapter_shards(spec, layout, lora), strict=True):
        shards = memory.optimizer_shards(layout)  # DP x CP
        grads = (grad_buffer_elements(dense, shards, distributed_optimizer)
                 + grad_buffer_elements(experts, layout.expert_dp, distributed_optimizer))
        shard = (_optimizer_elements(dense, shards, distributed_optimizer)
                 + _optimizer_elements(experts, layout.expert_dp, distributed_optimizer))
        out.append(StateBytes(params=(n + sum(dense) + sum(experts)) * p, grads=grads * 4,
                              optimizer=shard * (master + 4 * optimizer_states)))
    return out


def merge_transient_bytes(spec: ModelSpec, layout: ParallelLayout, precision: Precision, lora: LoRAConfig) -> int:
    """The sender's extra memory while it merges its largest adapted weight shard for a sync
    (``megarl.models.lora.merged_weight``): ``B A`` in float32, its scaled copy, ``W`` in float32 (bf16 only: an
    fp32 ``W`` is not copied) and their sum, 4 B each per element; the merged result in the weight dtype replaces
    the shard the resharding plan would read (its own transient)."""
    p = memory.param_bytes(precision)
    largest = 0
    for m in adapted_maps(spec, lora.targets):
        split = layout.tp if m.tp_dim is not None else 1  # an expert's weight (tp_dim None) is whole on its rank
        largest = max(largest, math.prod(mcore_shape(m, spec, 0)) // split)
    return largest * (16 if p == 2 else 12)
