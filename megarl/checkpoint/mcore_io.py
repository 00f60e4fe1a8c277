"""The weights of megarl's Megatron checkpoint directory: megatron-core dist-checkpoint I/O.

The directory layout, its metadata and file names are :mod:`megarl.checkpoint.format` (pure).
The torch_dist format stores global tensors with sharding metadata, so a checkpoint written at one
TP/PP loads into a model built at any other TP/PP (:func:`load_model`); vocabulary tensors whose
padding differs between TP sizes load through megatron-core's shape-mismatch path (zero padded).

A module's *extra state* (``get_extra_state``; megatron-core checkpoints it as a ``ShardedObject`` under
``<module>._extra_state``) is the one thing a checkpoint may lack: Transformer Engine's modules (its norms
among them) keep FP8 scaling metadata there, which megarl's converter, building without TE, never writes and
which means nothing for weights in bf16 or fp32. Such a module keeps its fresh extra state; any other entry
the checkpoint lacks is an error that names it (:func:`load_sharded`, :func:`load_into`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import apply_factories

from megarl.checkpoint.format import check_full_model, weights_dir
from megarl.errors import CheckpointError
from megarl.parallel import mcore_compat

# megatron-core's key suffix for a module's extra state (make_sharded_tensors_for_checkpoint's extra_state_suffix)
EXTRA_STATE_SUFFIX = "_extra_state"


def _sharded_state_dict(chunks: list[torch.nn.Module]) -> dict:
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def save_model(chunks: list[torch.nn.Module], out_weights_dir: Path, *, consume: bool = False) -> None:
    """Collective: every rank of the world calls it with its model chunks.

    ``consume=True`` (conversion tools) keeps peak memory at one copy of the model: megatron-core's
    writer clones every CPU tensor that is a view of a larger one (the gate and up halves of each
    fused ``linear_fc1``), so each such parameter is split into owned halves here and its fused
    storage released. The model must not be used afterwards.
    """
    out_weights_dir.mkdir(parents=True, exist_ok=True)
    sharded = _sharded_state_dict(chunks)
    if consume:
        _own_views_and_release(chunks, sharded)
    mcore_compat.save_checkpoint(sharded, str(out_weights_dir))


def _own_views_and_release(chunks: list[torch.nn.Module], sharded: dict) -> None:
    apply_factories(sharded)  # factories (swiglu fc1) -> ShardedTensors whose data are views
    views: dict[int, list[ShardedTensor]] = {}
    for sh in nested_values(sharded):
        if isinstance(sh, ShardedTensor) and sh.data is not None:
            data = sh.data
            if data.untyped_storage().nbytes() != data.numel() * data.element_size():
                views.setdefault(data.untyped_storage().data_ptr(), []).append(sh)
    params = {p.untyped_storage().data_ptr(): p for chunk in chunks for p in chunk.parameters()}
    for ptr, shards in views.items():  # one fused parameter at a time: peak +1 tensor, not +1 model
        for sh in shards:
            sh.data = sh.data.clone()
        if ptr in params:
            params[ptr].data = params[ptr].data.new_empty(0)


def load_model(chunks: list[torch.nn.Module], ckpt_dir: str | Path, *, exclude: tuple[str, ...] = ()) -> None:
    """Collective: load a checkpoint written at any layout into this rank's model chunks.

    Parameters whose names start with one of ``exclude`` keep their current values (a critic's new
    value head on top of a causal LM's checkpoint). Every role's model is read here: a LoRA run's
    checkpoint (adapters only) is refused with what to do instead (:func:`format.check_full_model`).
    """
    check_full_model(ckpt_dir)
    path = weights_dir(ckpt_dir)
    sharded = _sharded_state_dict(chunks)
    for sd in sharded.values():
        for key in [k for k in sd if k.startswith(exclude)] if exclude else []:
            del sd[key]
    state = load_sharded(sharded, path, remedy="convert it again from the HF model.")
    for i, chunk in enumerate(chunks):
        load_into(chunk, state[f"model{i}"], path, exclude=exclude)


def load_sharded(sharded: dict, path: Path, *, remedy: str) -> dict:
    """Collective: ``sharded`` (megatron-core sharded state dicts) read from the dist checkpoint in ``path``.

    Extra state the checkpoint lacks is left out (see the module docstring); a missing tensor raises a
    CheckpointError naming it. ``remedy`` ends the message of a read error (a missing or corrupt shard).
    """
    try:
        state, absent = mcore_compat.load_checkpoint_present(sharded, str(path))
    except mcore_compat.CHECKPOINT_READ_ERRORS as e:  # many types for missing or corrupt shards
        raise CheckpointError(f"cannot load the Megatron checkpoint in {path}: {type(e).__name__}: {e}. A shard "
                              f"file is missing or corrupt; {remedy}") from e
    missing = sorted(k for k in absent if not k.endswith(EXTRA_STATE_SUFFIX))
    if missing:
        raise CheckpointError(
            f"the checkpoint in {path} lacks {len(missing)} of the tensors this model has (first: {missing[:3]}); "
            "it was written for another model (architecture, size or head): point the role at this model's own "
            "checkpoint, or convert its HF directory with tools/convert_hf_to_megatron.py."
        )
    return state


def load_into(chunk: torch.nn.Module, state: dict, path: Path, *, exclude: tuple[str, ...] = (),
              only: Callable[[str], bool] | None = None) -> None:
    """``chunk.load_state_dict(state)``: every parameter and buffer must be there (those starting with one of
    ``exclude`` may not; with ``only``, just the names it accepts: a LoRA checkpoint's adapters, the others keep
    their values); a module whose extra state ``state`` lacks keeps its own."""
    result = chunk.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.startswith(exclude) and not k.endswith(EXTRA_STATE_SUFFIX)
               and (only is None or only(k))]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"the checkpoint in {path} does not fit this model: it lacks {missing[:3]} and has "
                              f"{result.unexpected_keys[:3]} on top; it belongs to another model.")


def tensors_metadata(ckpt_dir: str | Path) -> dict[str, ShardedTensor]:
    path = weights_dir(ckpt_dir)
    try:
        return mcore_compat.load_tensors_metadata(str(path))
    except mcore_compat.CHECKPOINT_READ_ERRORS as e:
        raise CheckpointError(f"the dist checkpoint metadata in {path} is unreadable ({e}); convert it again.") from e


def read_full_tensors(ckpt_dir: str | Path, keys: list[str], metadata: dict[str, ShardedTensor]) -> list[torch.Tensor]:
    """Read whole tensors from a dist checkpoint by checkpoint key, without building a model.

    Decoder-layer keys come back stacked over layers ([num_layers, ...]). megatron-core cannot read
    a single layer's slice in a world of one (its torch_dist reader wants every rank's full grid),
    so callers stream key by key: peak memory is the largest stacked tensor, not the model.
    """
    path = weights_dir(ckpt_dir)
    request_sd = {}
    for key in keys:
        if key not in metadata:
            raise CheckpointError(
                f"tensor {key} is missing from the checkpoint in {path}; it was written for another model."
            )
        meta = metadata[key]
        request_sd[key] = ShardedTensor.from_rank_offsets(key, torch.empty(tuple(meta.global_shape), dtype=meta.dtype))
    try:
        loaded = mcore_compat.load_checkpoint(request_sd, str(path), partial=True)
    except mcore_compat.CHECKPOINT_READ_ERRORS as e:
        raise CheckpointError(
            f"cannot read from the Megatron checkpoint in {path}: {type(e).__name__}: {e}. A shard file is missing "
            "or corrupt; convert the model again."
        ) from e
    return [loaded[key] for key in keys]
