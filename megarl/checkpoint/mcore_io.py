"""The weights of megarl's Megatron checkpoint directory: megatron-core dist-checkpoint I/O.

The directory layout, its metadata and file names are :mod:`megarl.checkpoint.format` (pure).
The torch_dist format stores global tensors with sharding metadata, so a checkpoint written at one
TP/PP loads into a model built at any other TP/PP (:func:`load_model`); vocabulary tensors whose
padding differs between TP sizes load through megatron-core's shape-mismatch path (zero padded).
"""

from __future__ import annotations

from pathlib import Path

import torch
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import apply_factories

from megarl.checkpoint.format import weights_dir
from megarl.errors import CheckpointError
from megarl.parallel import mcore_compat


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
    value head on top of a causal LM's checkpoint).
    """
    path = weights_dir(ckpt_dir)
    sharded = _sharded_state_dict(chunks)
    for sd in sharded.values():
        for key in [k for k in sd if k.startswith(exclude)] if exclude else []:
            del sd[key]
    try:
        state = mcore_compat.load_checkpoint(sharded, str(path))
    except mcore_compat.CHECKPOINT_READ_ERRORS as e:  # many types for missing or corrupt shards
        raise CheckpointError(
            f"cannot load the Megatron checkpoint in {path}: {type(e).__name__}: {e}. A shard file is missing "
            "or corrupt, or the checkpoint belongs to another model; convert it again from the HF model."
        ) from e
    for i, chunk in enumerate(chunks):
        result = chunk.load_state_dict(state[f"model{i}"], strict=not exclude)
        missing = [k for k in getattr(result, "missing_keys", []) if not k.startswith(exclude)]
        if missing:
            raise CheckpointError(f"the checkpoint in {path} lacks {missing[:3]}; it belongs to another model.")


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
