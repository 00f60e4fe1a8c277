"""Reading and writing HuggingFace model directories, one tensor at a time.

:class:`HFReader` indexes ``model.safetensors`` or a sharded ``model.safetensors.index.json``
and reads single tensors (never the whole model). :class:`HFWriter` writes tensors into
size-capped safetensors shards as they arrive, plus the index, so at most one shard is held in
memory. Errors name the file and the fix. No megatron-core here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megarl.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Files besides the weights that make a model directory usable (tokenizer, chat template, generation).
AUX_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


class HFReader:
    """Random access to the tensors of an HF safetensors checkpoint by name."""

    def __init__(self, hf_dir: str | Path) -> None:
        self.dir = Path(hf_dir)
        self.files: dict[str, Path] = {}  # tensor name -> file
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index ({e}); restore it.") from e
            self.files = {name: self.dir / f for name, f in weight_map.items()}
        elif (self.dir / SINGLE_FILE).is_file():
            for name in self._keys(self.dir / SINGLE_FILE):
                self.files[name] = self.dir / SINGLE_FILE
        else:
            found = sorted(p.name for p in self.dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
            raise CheckpointError(
                f"{self.dir} has no {SINGLE_FILE} or {INDEX_FILE} (found {found or 'no weight files'}); megarl "
                "reads safetensors checkpoints: re-save the model with `save_pretrained(..., safe_serialization=True)`."
            )
        for path in sorted(set(self.files.values())):
            if not path.is_file():
                raise CheckpointError(
                    f"checkpoint shard {path} listed in {INDEX_FILE} is missing; copy the complete model directory."
                )
        self._open: dict[Path, object] = {}

    @staticmethod
    def _keys(path: Path) -> list[str]:
        try:
            with safe_open(str(path), framework="pt") as f:
                return list(f.keys())
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"checkpoint shard {path} is corrupt or truncated ({e}); re-download it.") from e

    def names(self) -> set[str]:
        return set(self.files)

    def get(self, name: str) -> torch.Tensor:
        path = self.files.get(name)
        if path is None:
            raise CheckpointError(
                f"tensor {name} is missing from the checkpoint in {self.dir}; the weights do not match config.json."
            )
        try:
            handle = self._open.get(path)
            if handle is None:
                handle = self._open[path] = safe_open(str(path), framework="pt")
            return handle.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"cannot read {name} from {path}: the file is corrupt or truncated ({e}).") from e

    def close(self) -> None:
        self._open.clear()


class HFWriter:
    """Stream tensors into safetensors shards of at most ``max_shard_bytes`` (one tensor may exceed it)."""

    def __init__(self, out_dir: str | Path, max_shard_bytes: int = 2 * 1024**3) -> None:
        self.dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        tensor = tensor.contiguous()
        if tensor.untyped_storage().nbytes() > nbytes:  # a view: do not keep its (larger) base alive
            tensor = tensor.clone()
        self._pending[name] = tensor
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        save_file(self._pending, str(self.dir / f"part-{len(self._shards):05d}.tmp"), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Write the last shard and the index; return the weight file names."""
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        if n == 1:
            (self.dir / "part-00000.tmp").rename(self.dir / SINGLE_FILE)
            return [SINGLE_FILE]
        weight_map, files = {}, []
        for i, names in enumerate(self._shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.dir / f"part-{i:05d}.tmp").rename(self.dir / fname)
            weight_map.update(dict.fromkeys(names, fname))
            files.append(fname)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return files


def copy_aux_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy tokenizer / generation files that exist in ``src``; return their names."""
    copied = []
    for name in AUX_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied
