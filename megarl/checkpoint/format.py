"""megarl's Megatron checkpoint directory format: names, metadata and its JSON (pure).

Layout of a checkpoint directory::

    megarl_checkpoint.json   what wrote it: source HF config, layout, padded vocab, dtype, versions
    hf/                      config.json + tokenizer files of the source model (for export, rollout)
    weights/                 megatron-core dist_checkpointing (torch_dist) model checkpoint

A LoRA run's training checkpoint (``CheckpointMeta.lora`` set) holds the adapters only: it is not a model, and
everything that loads one as a model goes through :func:`check_full_model`.

This module is what a driver needs to recognise and describe such a directory: it imports neither
torch nor megatron-core. Reading and writing the weights is :mod:`megarl.checkpoint.mcore_io`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from megarl.engine.config import LoRAConfig
from megarl.errors import CheckpointError
from megarl.parallel.layout import ParallelLayout

META_FILE = "megarl_checkpoint.json"
HF_SUBDIR = "hf"
WEIGHTS_SUBDIR = "weights"
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class LoRAMeta(LoRAConfig):
    """The adapters a LoRA run's checkpoint holds (its ``LoRAConfig``) and the model they adapt."""

    base: str = ""  # absolute path of the base checkpoint the run started from: its weights are not in this one


@dataclasses.dataclass(frozen=True)
class CheckpointMeta:
    hf_config: dict[str, Any]
    layout: ParallelLayout  # the layout the checkpoint was written for (any layout can load it)
    padded_vocab_size: int
    dtype: str
    megatron_core_version: str
    format_version: int = FORMAT_VERSION
    lora: LoRAMeta | None = None  # set: adapters + their optimizer state only (a LoRA run's training checkpoint)

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["layout"] = {"tp": self.layout.tp, "pp": self.layout.pp, "dp": self.layout.dp, "vpp": self.layout.vpp}
        if self.layout.ep > 1:
            d["layout"]["ep"] = self.layout.ep
        if self.lora is None:  # a model's metadata reads as it did before LoRA (older megarl reads it too)
            del d["lora"]
        return json.dumps(d, indent=2, sort_keys=True) + "\n"


def is_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a megarl Megatron checkpoint directory (it holds :data:`META_FILE`)."""
    return (Path(path) / META_FILE).is_file()


def hf_files(path: str | Path) -> Path:
    """Where a model directory's HF files (config.json, tokenizer) are: itself, or a megarl checkpoint's hf/."""
    return Path(path) / HF_SUBDIR if is_checkpoint(path) else Path(path)


def write_meta(ckpt_dir: Path, meta: CheckpointMeta) -> None:
    (ckpt_dir / META_FILE).write_text(meta.to_json())


def read_meta(ckpt_dir: str | Path) -> CheckpointMeta:
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / META_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{ckpt_dir} is not a megarl Megatron checkpoint ({META_FILE} is missing); pass a directory written "
            "by tools/convert_hf_to_megatron.py or by megarl training."
        )
    try:
        d = json.loads(path.read_text())
        if d["format_version"] != FORMAT_VERSION:
            raise CheckpointError(
                f"{path} has format_version {d['format_version']}; this megarl reads version {FORMAT_VERSION}."
            )
        d["layout"] = ParallelLayout(**d["layout"])
        if "lora" in d:
            d["lora"] = LoRAMeta(**d["lora"])
        return CheckpointMeta(**d)
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is corrupt ({e!r}); restore it from the original conversion.") from e


def check_full_model(ckpt_dir: str | Path) -> None:
    """Raise where ``ckpt_dir`` holds LoRA adapters only (a LoRA run's training checkpoint) instead of a model:
    it has no base weights, so loading it as a model would fail deep in megatron-core over the missing tensors."""
    lora = read_meta(ckpt_dir).lora
    if lora is None:
        return
    raise CheckpointError(
        f"{ckpt_dir} is a LoRA training checkpoint: it holds rank-{lora.rank} adapters on {lora.targets} (and their "
        f"optimizer state), not a model; its base model is {lora.base}. To use it as a model, export it merged with "
        f"tools/convert_megatron_to_hf.py --mcore-dir {ckpt_dir} --out-dir DIR and point model.path at DIR (or "
        "export the adapters for peft with tools/export_peft.py); to train on, resume its run (the same "
        "trainer.output_dir), which loads the adapters onto their base."
    )


def weights_dir(ckpt_dir: str | Path) -> Path:
    """The dist-checkpoint directory of ``ckpt_dir``; raises if it holds no complete checkpoint."""
    path = Path(ckpt_dir) / WEIGHTS_SUBDIR
    if not (path / "metadata.json").is_file():
        raise CheckpointError(
            f"{path} holds no megatron-core dist checkpoint (metadata.json is missing); the checkpoint is "
            "incomplete: convert or save it again."
        )
    return path
