"""The one module that talks to megatron-core's changing APIs.

megarl supports megatron-core 0.16.1 (what Python 3.11 resolves) through the current release
(GPU clusters on Python 3.12). Every call whose signature or behaviour differs between those
versions goes through a function here, so version checks never spread through the code base.
Importing this module imports megatron-core; it does not switch on the CPU compatibility layer
(:mod:`megarl.parallel.cpu_compat`): a process that runs megatron-core does, when it joins its world
(:func:`megarl.parallel.init.init_distributed`), so a driver that only imports role classes stays as it was.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core import package_info as _mcore_info
from megatron.core.models.gpt import gpt_layer_specs
from torch.distributed.checkpoint.api import CheckpointException as _TorchCheckpointException

from megarl.parallel import cpu_compat

MCORE_VERSION: tuple[int, int, int] = (
    int(_mcore_info.MAJOR),
    int(_mcore_info.MINOR),
    int(str(_mcore_info.PATCH).split("rc")[0]),
)
MIN_MCORE_VERSION = (0, 16, 1)
if MCORE_VERSION < MIN_MCORE_VERSION:
    raise ImportError(
        f"megarl needs megatron-core >= {'.'.join(map(str, MIN_MCORE_VERSION))}, found "
        f"{'.'.join(map(str, MCORE_VERSION))}; run `pip install -U megatron-core`."
    )


# What reading a missing or corrupt dist checkpoint raises. torch's CheckpointException derives
# from BaseException, so a plain `except Exception` does not catch it.
CHECKPOINT_READ_ERRORS: tuple[type[BaseException], ...] = (Exception, _TorchCheckpointException)


def _define_te_names_moe_utils_lacks() -> None:
    """Without Transformer Engine, megatron-core's ``moe_utils`` never defines the TE functions it later tests
    for ``None`` (``te_general_gemm``, ``fused_*``): the first router forward raises NameError. Define them as
    ``None``, which selects its PyTorch paths."""
    from megatron.core.transformer.moe import moe_utils

    for name in ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                 "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
                 "fused_topk_with_score_function", "fused_unpermute", "te_general_gemm"):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


_define_te_names_moe_utils_lacks()


@functools.cache
def transformer_engine_available() -> bool:
    """Whether megarl builds Transformer Engine's layers: megatron-core's own ``HAVE_TE`` (its TE extension, whose
    classes refuse to build without it; True only when the TE API this megatron-core release uses imports, so a TE
    outside megatron-core's supported range reads False although ``transformer_engine`` imports), on a machine
    with CUDA (TE runs on nothing else)."""
    from megatron.core.extensions import transformer_engine as mcore_te

    return bool(mcore_te.HAVE_TE) and cpu_compat.cuda_available()


def gpt_layer_spec(*, use_te: bool, qk_layernorm: bool, num_experts: int | None = None) -> Any:
    """The GPT decoder-layer ModuleSpec: Transformer Engine's or megatron-core's local (pure PyTorch).

    Keywords only: the positional order of these functions changed between releases. With
    ``num_experts`` the MLP is megatron-core's MoE layer with one MLP module per expert (no grouped
    GEMM). The local MoE spec's checkpoint key map would store the pre-MLP norm under the fused name
    TE gives a *dense* layer's norm, while TE's MoE layer keeps it a separate ``pre_mlp_layernorm``:
    that entry is dropped, so both specs read and write the same keys.
    """
    moe = dict(num_experts=num_experts, moe_grouped_gemm=False) if num_experts else {}
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm, **moe)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm", **moe)
    if num_experts:
        spec.submodules.sharded_state_dict_keys_map.pop("pre_mlp_layernorm.", None)
    return spec


def decoder_block_spec(config: Any, layer_spec: Any, vp_stage: int | None, *, layer_norm: type) -> Any:
    """The decoder block of one model chunk: ``layer_spec`` for each of the chunk's layers and ``layer_norm`` as
    its final norm (megatron-core's ``TransformerBlock`` otherwise takes the module-level default norm, which for
    the local spec is ``WrappedTorchNorm``)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    return TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=layer_norm)


def save_checkpoint(sharded_state_dict: dict, checkpoint_dir: str) -> None:
    """``dist_checkpointing.save`` in the torch_dist format (the default backend of every version).

    megatron-core's torch_dist writer returns its write results through a module-level queue that it
    creates, on first use, as a multiprocessing ``Manager().Queue()``: a spawned Python that
    re-imports the main module (~0.3 GB RSS and seconds of start-up), kept for the life of the
    process, and broken for every later save if it dies. A synchronous save puts and reads those
    results in this process (``AsyncRequest.execute_sync``), so a plain in-process queue does the
    same job without the extra process; a fresh one per save leaves no stale results behind.

    Without CUDA the writer's buckets are also written here, one after the other, instead of by the
    processes it otherwise ``fork()``s per save (2 per rank): each is a copy-on-write image of this
    process, which doubles its memory as RSS counts it (the tiny GRPO run: 0.51 -> 0.85 GB while its
    one-time conversion saved). On GPUs the forked writers stay: they write in parallel.
    """
    import queue

    import torch
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = queue.Queue()
    writer = filesystem_async.FileSystemWriterAsync
    forking = writer.__dict__.get("write_preloaded_data_multiproc")
    if torch.cuda.is_available() or forking is None:
        dist_checkpointing.save(sharded_state_dict, checkpoint_dir)
        return
    writer.write_preloaded_data_multiproc = staticmethod(_write_buckets_here)
    try:
        dist_checkpointing.save(sharded_state_dict, checkpoint_dir)
    finally:
        writer.write_preloaded_data_multiproc = forking


def _write_buckets_here(transform_list, use_msc: bool, rank: int, write_buckets, global_results_queue) -> None:
    """``FileSystemWriterAsync.write_preloaded_data_multiproc`` without its processes: each bucket is
    written by the writer's own ``write_preloaded_data`` in this process; the same results reach the
    same queue (``{bucket index: write results}``, or the first bucket's exception)."""
    import queue

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    results: dict[int, Any] | Exception = {}
    local, count = queue.Queue(), queue.Queue()
    for i, bucket in enumerate(write_buckets):
        count.put(i)
        FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, local, count, True,
                                                   **({"use_msc": True} if use_msc else {}))
        index, written = local.get()
        if isinstance(written, Exception):
            results = written
            break
        results[index] = written
    global_results_queue.put(results)


def load_checkpoint(sharded_state_dict: dict, checkpoint_dir: str, *, partial: bool = False) -> dict:
    """``dist_checkpointing.load``; ``partial=True`` allows reading a subset of a tensor's slices."""
    return dist_checkpointing.load(sharded_state_dict, checkpoint_dir, validate_access_integrity=not partial)


def load_checkpoint_present(sharded_state_dict: dict, checkpoint_dir: str) -> tuple[dict, set[str]]:
    """``dist_checkpointing.load`` of the requested entries the checkpoint holds, and the checkpoint keys of those
    it lacks: megatron-core's ``StrictHandling.RETURN_UNEXPECTED`` (it reads the checkpoint's metadata first and
    leaves the absent entries out of the load; its "unexpected" keys are requested ones the checkpoint lacks)."""
    from megatron.core.dist_checkpointing.validation import StrictHandling

    state, _, absent = dist_checkpointing.load(sharded_state_dict, checkpoint_dir,
                                               strict=StrictHandling.RETURN_UNEXPECTED)
    return state, set(absent)


def load_tensors_metadata(checkpoint_dir: str) -> dict:
    """Global shape and dtype of every tensor in a dist checkpoint, keyed by checkpoint key."""
    return dist_checkpointing.load_tensors_metadata(checkpoint_dir)


def _fix_distributed_optimizer_step_state() -> None:
    """megatron-core 0.16-0.19: loading a "fully_reshardable" DistributedOptimizer checkpoint into
    torch Adam raises ``KeyError: 'step'`` (the saved per-parameter tensors skip ``step`` but the
    copy loop expects every state key), and the inner optimizer's load leaves one ``step`` tensor
    shared by all parameters, which Adam then increments once per parameter (a silent ~2e-3 error
    in the next update). Copy the other state keys, and give every parameter its own ``step``."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_megarl_fixed", False):
        return

    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state.get(main_param, {})
        step = state.pop("step", None) if "step" not in tensors else None
        try:
            original(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step.detach().clone()

    set_states._megarl_fixed = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


_fix_distributed_optimizer_step_state()


def vectorize_thd_rope() -> None:
    """Apply RoPE to packed (THD) tokens with one gather of the frequencies instead of megatron-core's loop over the
    sequences (a split, a slice of the frequencies and a concatenation per sequence and call: on the tiny CPU models'
    ~10-token rows most of a layer's time). The same frequencies, the same ops (``_apply_rotary_pos_emb_bshd``),
    so bit-identical; only for frequencies indexed by position within a sequence (megatron-core's "traditional
    mapping", what GPT models pass), the other case and anything unforeseen go to megatron-core's own. Idempotent."""
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils._apply_rotary_pos_emb_thd
    if getattr(original, "_megarl_vectorized", False):
        return

    @functools.wraps(original)
    def apply(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0,
              cp_group=None):
        cp = 1 if cp_group is None else cp_group.size()
        if cp_group is None or freqs.dim() < 1 or freqs.size(0) == cu_seqlens[-1]:
            return original(t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group)
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long) // cp  # this rank's tokens of each sequence
        starts = torch.cumsum(lengths, 0) - lengths
        local = torch.arange(t.size(0), device=t.device) - torch.repeat_interleave(starts, lengths)
        if cp > 1:  # megatron-core's load-balanced chunks: r, then 2 cp - 1 - r, each half of the rank's tokens
            half = torch.repeat_interleave(lengths // 2, lengths)
            rank = cp_group.rank()
            local = torch.where(local < half, rank * half + local,
                                cp * 2 * half - (rank + 1) * half + (local - half))
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1), freqs[local], rotary_interleaved=rotary_interleaved,
            multi_latent_attention=multi_latent_attention, mscale=mscale).squeeze(1)

    apply._megarl_vectorized = True
    rope_utils._apply_rotary_pos_emb_thd = apply
