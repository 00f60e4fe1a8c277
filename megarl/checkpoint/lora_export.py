"""A LoRA run's checkpoint out of megarl: merged onto its base as an HF model, or as a peft adapter.

A LoRA run's training checkpoint (:mod:`megarl.checkpoint.training`) holds the adapters only, each factor stacked
over layers (and experts) under its weight's dist-checkpoint key with ``lora_A`` / ``lora_B`` for ``weight``
(:func:`megarl.models.adapters.factor_key`), and records the base checkpoint the run started from
(``CheckpointMeta.lora.base``). Two exports:

- merged (:class:`MergedWeights`, read by :func:`megarl.checkpoint.convert.convert_megatron_to_hf`): each adapted
  weight is ``W + scale * B A`` (float32 math, cast to ``W``'s dtype), every other tensor is the base's; an HF model
  that needs no peft. It reads the base's weights, which must still be where the run left them (or ``base_dir``).
- peft (:func:`export_peft`): ``adapter_config.json`` + ``adapter_model.safetensors`` in peft's names (the fused
  qkv / fc1 adapters as peft's per-projection ones, exactly: :func:`megarl.models.adapters.to_peft`), to load with
  ``PeftModel.from_pretrained`` onto the HF model the run started from; no base tensor is read or written. MoE
  experts' adapters are refused: transformers 5 fuses a layer's experts into one parameter, which peft cannot adapt
  per expert (the merged export covers them).

Both read one stacked checkpoint key at a time, in a world of one (the conversion tools' mode), and write
atomically.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from megarl.checkpoint import mcore_io
from megarl.checkpoint.atomic import atomic_directory, check_output_dir
from megarl.checkpoint.convert import ConversionSummary
from megarl.checkpoint.format import CheckpointMeta, check_full_model, is_checkpoint, read_meta
from megarl.errors import CheckpointError, UnsupportedModelError
from megarl.models import adapters, mapping
from megarl.models.spec import Head, ModelSpec, spec_from_hf_config
from megarl.parallel.layout import ParallelLayout

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


class MergedWeights:
    """A LoRA checkpoint's model by checkpoint key, stacked as stored: the base's tensors with the adapted ones
    merged. ``metadata`` (the base's) and ``path`` (the base) are what a full checkpoint's reader has."""

    def __init__(self, ckpt_dir: str | Path, meta: CheckpointMeta, spec: ModelSpec,
                 base_dir: str | Path | None = None) -> None:
        _check_causal_lm(spec, Path(ckpt_dir))
        self.path = _base_dir(Path(ckpt_dir), meta, base_dir)
        self.metadata = mcore_io.tensors_metadata(self.path)
        self._ckpt_dir = Path(ckpt_dir)
        maps = adapters.adapted_maps(spec, meta.lora.targets)
        self._factors = mcore_io.tensors_metadata(ckpt_dir)
        _check_factors(spec, maps, meta.lora.rank, self._factors, self._ckpt_dir)
        self._adapted = {m.ckpt_key: m for m in maps}  # one map per stacked key is enough: keys are per kind
        self._scale = meta.lora.scale

    def read(self, key: str) -> torch.Tensor:
        """The stacked tensor of ``key`` ([layers, (experts,) out, in] for a layer's weight)."""
        (w,) = mcore_io.read_full_tensors(self.path, [key], self.metadata)
        m = self._adapted.get(key)
        if m is None:
            return w
        a, b = mcore_io.read_full_tensors(self._ckpt_dir, [adapters.factor_key(m, f) for f in adapters.FACTORS],
                                          self._factors)
        return (w.float() + self._scale * (b.float() @ a.float())).to(w.dtype)  # batched over the stacked dims


def export_peft(mcore_dir: str | Path, out_dir: str | Path, *, base_model: str | None = None) -> ConversionSummary:
    """Write peft's ``adapter_config.json`` and ``adapter_model.safetensors`` of a LoRA checkpoint's adapters.
    ``base_model``: recorded as ``base_model_name_or_path`` (what ``AutoPeftModelForCausalLM`` loads)."""
    start = time.perf_counter()
    mcore_dir = Path(mcore_dir)
    meta = read_meta(mcore_dir)
    if meta.lora is None:
        raise CheckpointError(f"{mcore_dir} holds a full model, not LoRA adapters: there is no adapter to export; "
                              "convert it with tools/convert_megatron_to_hf.py.")
    spec = spec_from_hf_config(meta.hf_config)
    maps = adapters.adapted_maps(spec, meta.lora.targets)
    _check_peft_exportable(spec, maps, mcore_dir)
    factors = mcore_io.tensors_metadata(mcore_dir)
    _check_factors(spec, maps, meta.lora.rank, factors, mcore_dir)
    check_output_dir(out_dir)

    from megarl.parallel.init import init_distributed

    init_distributed(ParallelLayout())  # megatron-core's reader runs in a torch.distributed world (of one here)
    by_key: dict[str, list[mapping.TensorMap]] = {}
    for m in maps:
        by_key.setdefault(m.ckpt_key, []).append(m)
    tensors: dict[str, torch.Tensor] = {}
    for group in by_key.values():
        a, b = mcore_io.read_full_tensors(mcore_dir, [adapters.factor_key(group[0], f) for f in adapters.FACTORS],
                                          factors)
        for m in group:
            # cloned: q, k and v share one A, and safetensors writes no tensors that share memory
            tensors.update((k, t.clone()) for k, t in adapters.to_peft(m, spec, a[m.ckpt_index], b[m.ckpt_index]))
    lora = meta.lora
    config = adapters.peft_config(lora.rank, lora.alpha, lora.dropout, lora.targets, base_model)
    with atomic_directory(out_dir) as tmp:
        save_file(tensors, tmp / PEFT_WEIGHTS, metadata={"format": "pt"})
        (tmp / PEFT_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    nbytes = sum(t.nbytes for t in tensors.values())
    return ConversionSummary("Megatron LoRA -> peft", len(tensors), nbytes, time.perf_counter() - start, Path(out_dir))


def _base_dir(ckpt_dir: Path, meta: CheckpointMeta, override: str | Path | None) -> Path:
    """The base checkpoint of a LoRA checkpoint (``override``, or the recorded one), checked to be its model."""
    base = Path(override if override is not None else meta.lora.base)
    if not is_checkpoint(base):
        raise CheckpointError(
            f"the base model of the LoRA checkpoint {ckpt_dir}, {base}, is not a megarl checkpoint (moved or "
            "deleted?); the merged export adds the adapters to its weights: pass where it is now (--base-dir), or "
            "export the adapters alone with tools/export_peft.py.")
    check_full_model(base)
    base_meta = read_meta(base)
    if (base_meta.hf_config, base_meta.padded_vocab_size) != (meta.hf_config, meta.padded_vocab_size):
        raise CheckpointError(
            f"{base} is not the model the LoRA checkpoint {ckpt_dir} adapts: their config.json (or vocabulary "
            f"padding) differ; pass the checkpoint the run started from (--base-dir).")
    return base


def _check_factors(spec: ModelSpec, maps: list[mapping.TensorMap], rank: int, metadata: dict, ckpt_dir: Path) -> None:
    """Every factor of ``maps`` is in ``metadata`` (the LoRA checkpoint's) with its stacked global shape."""
    for m in maps:
        stacked = (spec.num_layers,) + ((spec.moe.num_experts,) if m.expert is not None else ())
        for factor in adapters.FACTORS:
            key = adapters.factor_key(m, factor)
            expected = (*stacked, *adapters.factor_shape(m, spec, factor, rank))
            found = tuple(metadata[key].global_shape) if key in metadata else None
            if found != expected:
                what = f"lacks {key}" if found is None else f"has {key} of global shape {list(found)}"
                raise CheckpointError(
                    f"the LoRA checkpoint in {ckpt_dir} {what}, expected {list(expected)} from its "
                    "megarl_checkpoint.json (rank, targets, model config); it is corrupt or its metadata belongs to "
                    "another checkpoint.")


def _check_causal_lm(spec: ModelSpec, ckpt_dir: Path) -> None:
    if spec.head is not Head.LM:  # its head was built from the seed, frozen: in neither checkpoint
        raise UnsupportedModelError(
            f"the LoRA checkpoint {ckpt_dir} is of a model with a scalar head (a critic): the head is in neither it "
            "nor its base causal LM, so megarl exports LoRA checkpoints of causal LMs only (a policy's).")


def _check_peft_exportable(spec: ModelSpec, maps: list[mapping.TensorMap], ckpt_dir: Path) -> None:
    _check_causal_lm(spec, ckpt_dir)
    experts = sorted({m.ckpt_key for m in maps if m.expert is not None})
    if experts:
        raise UnsupportedModelError(
            f"the LoRA checkpoint {ckpt_dir} has adapters on MoE experts ({experts}); transformers 5 fuses a layer's "
            "experts into one parameter, which peft cannot adapt per expert: export it merged instead "
            f"(tools/convert_megatron_to_hf.py --mcore-dir {ckpt_dir} --out-dir DIR), or train with lora.targets "
            "[qkv, proj].")
