"""HF <-> Megatron checkpoint conversion (the library API behind tools/convert_*.py).

Both directions stream: HF -> Megatron reads one HF tensor group at a time into an uninitialised
TP1/PP1 megatron-core model (one copy of the model in memory) and saves its sharded state dict;
Megatron -> HF reads one decoder layer at a time from the dist checkpoint and writes size-capped
safetensors shards. Outputs are written atomically (temporary directory, then rename). Every
tensor's name and shape is checked against the model config before anything is written.
A LoRA run's checkpoint converts to HF merged onto its base (:mod:`megarl.checkpoint.lora_export`, which also
writes its adapters in peft's format).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from megarl.checkpoint import hf_io, mcore_io
from megarl.checkpoint.atomic import atomic_directory, check_output_dir
from megarl.checkpoint.format import HF_SUBDIR, WEIGHTS_SUBDIR, CheckpointMeta, read_meta, write_meta
from megarl.errors import CheckpointError, ConfigError, UnsupportedModelError
from megarl.models import mapping
from megarl.models.spec import ModelSpec, load_hf_config, spec_from_hf_config
from megarl.parallel.layout import ParallelLayout

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# HF tensors that carry no weights (rotary caches some older checkpoints saved).
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class ConversionSummary:
    direction: str
    tensors: int
    bytes: int
    seconds: float
    out_dir: Path
    notes: tuple[str, ...] = ()  # how megarl trains the checkpoint where megatron-core alone would not (also logged)

    def line(self) -> str:
        return (
            f"{self.direction}: {self.tensors} tensors, {self.bytes / 1e6:.1f} MB in {self.seconds:.2f} s "
            f"-> {self.out_dir}"
        )


def convert_hf_to_megatron(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    ep: int = 1,
    dtype: str | None = None,
    progress: bool = False,
) -> ConversionSummary:
    """Write a megarl Megatron checkpoint (dist checkpoint + metadata) from an HF model directory.

    ``tp``/``pp``/``vpp``/``ep`` are the training layout the checkpoint is meant for: they are validated
    against the model, fix the vocabulary padding and are recorded; the torch_dist format itself
    loads into any layout.
    """
    start = time.perf_counter()
    cfg = load_hf_config(hf_dir)
    spec = spec_from_hf_config(cfg)
    layout = ParallelLayout(tp=tp, pp=pp, vpp=vpp, dp=ep // math.gcd(tp, ep), ep=ep)  # the least dp that holds ep
    spec.check_layout(layout)
    check_output_dir(out_dir)
    reader = hf_io.HFReader(hf_dir)
    maps = mapping.tensor_maps(spec)
    _check_hf_names(spec, maps, reader.names(), Path(hf_dir))
    model_dtype = DTYPES[_dtype_name(dtype)] if dtype else reader.get(maps[0].hf[0]).dtype

    from megarl.models.provider import BuildOptions, build_model, global_named_parameters, padded_vocab_size
    from megarl.parallel.init import init_distributed

    init_distributed(ParallelLayout())  # a world of one: the torch_dist format is layout independent
    opts = BuildOptions(dtype=model_dtype, init_weights=False, vocab_tp=tp, use_te=False)
    with atomic_directory(out_dir) as tmp:
        (model,) = build_model(spec, ParallelLayout(), opts)
        params = dict(global_named_parameters(model))
        padded = padded_vocab_size(spec, layout, opts)
        nbytes = 0
        with torch.no_grad():
            for m in tqdm(maps, desc="HF -> Megatron", unit="tensor", disable=not progress):
                full = mapping.to_mcore(m, spec, [reader.get(n) for n in m.hf], padded)
                params[m.mcore].copy_(full)
                nbytes += full.numel() * params[m.mcore].element_size()
                del full
        mcore_io.save_model([model], tmp / WEIGHTS_SUBDIR, consume=True)
        del model, params
        (tmp / HF_SUBDIR).mkdir()
        (tmp / HF_SUBDIR / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        hf_io.copy_aux_files(hf_dir, tmp / HF_SUBDIR)
        from megarl.parallel.mcore_compat import MCORE_VERSION

        meta = CheckpointMeta(
            hf_config=cfg,
            layout=layout,
            padded_vocab_size=padded,
            dtype=_dtype_name(str(model_dtype).removeprefix("torch.")),
            megatron_core_version=".".join(map(str, MCORE_VERSION)),
        )
        write_meta(tmp, meta)
    notes = _training_notes(spec)
    for note in notes:
        logger.info("%s", note)
    return ConversionSummary("HF -> Megatron", len(maps), nbytes, time.perf_counter() - start, Path(out_dir), notes)


def _training_notes(spec: ModelSpec) -> tuple[str, ...]:
    """How megarl trains what the checkpoint holds, where megatron-core alone would train it otherwise."""
    pad = spec.embedding_padding_idx
    if pad is None:
        return ()
    return (f"embedding row {pad} (pad_token_id) gets no gradient from the input lookup in training, as transformers "
            f"trains it (nn.Embedding padding_idx={pad}); a tied LM head still trains it (docs/resharding.md §1.7)",)


def convert_megatron_to_hf(
    mcore_dir: str | Path, out_dir: str | Path, *, max_shard_bytes: int = 2 * 1024**3, progress: bool = False,
    base_dir: str | Path | None = None,
) -> ConversionSummary:
    """Write an HF directory (config.json, safetensors shards, tokenizer files) from a megarl checkpoint.

    A LoRA run's checkpoint (adapters only) is written merged onto its base model: the checkpoint it records, or
    ``base_dir`` (:class:`megarl.checkpoint.lora_export.MergedWeights`)."""
    start = time.perf_counter()
    meta = read_meta(mcore_dir)
    spec = spec_from_hf_config(meta.hf_config)
    if meta.lora is None:
        weights = _Weights(Path(mcore_dir))
    else:
        from megarl.checkpoint.lora_export import MergedWeights  # it builds on this module

        weights = MergedWeights(mcore_dir, meta, spec, base_dir)
    metadata = weights.metadata
    maps = mapping.tensor_maps(spec)
    _check_checkpoint_shapes(spec, maps, metadata, meta.padded_vocab_size, weights.path)
    check_output_dir(out_dir)

    from megarl.parallel.init import init_distributed

    init_distributed(ParallelLayout())
    n_tensors = 0
    with atomic_directory(out_dir) as tmp:
        by_key: dict[str, list[mapping.TensorMap]] = {}
        for m in maps:  # one checkpoint key (a tensor kind stacked over all layers) at a time
            by_key.setdefault(m.ckpt_key, []).append(m)
        plan = [
            (name, shape, metadata[key].dtype)
            for key, group in by_key.items()
            for m in group
            for name, shape in zip(m.hf, mapping.hf_shapes(m, spec), strict=True)
        ]
        writer = hf_io.HFWriter(tmp, plan, max_shard_bytes)
        bar = tqdm(total=len(maps), desc="Megatron -> HF", unit="tensor", disable=not progress)
        for key, group in by_key.items():
            stacked = weights.read(key)
            for m in group:
                full = stacked[m.ckpt_index]
                for name, t in zip(m.hf, mapping.to_hf(m, spec, full), strict=True):
                    writer.add(name, t)
                    n_tensors += 1
            del stacked
            bar.update(len(group))
        bar.close()
        writer.close()
        config = dict(meta.hf_config)
        config["dtype"] = meta.dtype
        config.pop("torch_dtype", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        hf_io.copy_aux_files(Path(mcore_dir) / HF_SUBDIR, tmp)
    seconds = time.perf_counter() - start
    return ConversionSummary("Megatron -> HF", n_tensors, writer.total_bytes, seconds, Path(out_dir))


class _Weights:
    """A model checkpoint's tensors by checkpoint key, stacked as stored (a LoRA checkpoint's: ``MergedWeights``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.metadata = mcore_io.tensors_metadata(path)

    def read(self, key: str) -> torch.Tensor:
        (stacked,) = mcore_io.read_full_tensors(self.path, [key], self.metadata)
        return stacked


def _dtype_name(name: str) -> str:
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported; choose one of {sorted(DTYPES)}.")
    return name


def _check_hf_names(spec: ModelSpec, maps: list[mapping.TensorMap], found: set[str], hf_dir: Path) -> None:
    expected = {n for m in maps for n in m.hf}
    missing = sorted(expected - found)
    if missing:
        raise CheckpointError(
            f"the checkpoint in {hf_dir} lacks {len(missing)} tensors that config.json implies "
            f"(first: {missing[:3]}); the weights are incomplete or belong to another model."
        )
    extra = {n for n in found - expected if not n.endswith(_IGNORED_HF_SUFFIXES)}
    if spec.tie_word_embeddings:
        extra.discard("lm_head.weight")  # a tied copy some checkpoints store anyway
    if extra:
        raise UnsupportedModelError(
            f"the checkpoint in {hf_dir} has {len(extra)} tensors megarl does not map for {spec.architecture} "
            f"(first: {sorted(extra)[:3]}); the model uses a feature megarl does not support yet."
        )


def _check_checkpoint_shapes(
    spec: ModelSpec, maps: list[mapping.TensorMap], metadata: dict, padded_vocab: int, ckpt_dir: Path
) -> None:
    for m in maps:
        key = m.ckpt_key
        if key not in metadata:
            raise CheckpointError(
                f"tensor {key} is missing from the Megatron checkpoint in {ckpt_dir}; it was not written for "
                f"this model ({spec.architecture}, {spec.num_layers} layers)."
            )
        stacked = (spec.num_layers,) if m.layer is not None else ()
        if m.expert is not None:
            stacked += (spec.moe.num_experts,)
        expected = (*stacked, *mapping.mcore_shape(m, spec, padded_vocab))
        found = tuple(metadata[key].global_shape)
        if found != expected:
            raise CheckpointError(
                f"tensor {key} in {ckpt_dir} has global shape {list(found)}, expected {list(expected)} from the "
                "model config stored with it; the checkpoint is corrupt or was written for another model."
            )
