"""Reading and writing HuggingFace model directories, one tensor at a time.

:class:`HFReader` indexes ``model.safetensors`` or a sharded ``model.safetensors.index.json``
and reads single tensors (never the whole model). :class:`HFWriter` streams tensors into
size-capped safetensors shards as they arrive, plus the index, holding none of them. Errors
name the file and the fix. No megatron-core here.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

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
            # Open per tensor: a handle kept open keeps every page read so far mapped, and a whole
            # model's worth of file pages would then count against this process's memory.
            with safe_open(str(path), framework="pt") as handle:
                return handle.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"cannot read {name} from {path}: the file is corrupt or truncated ({e}).") from e


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class HFWriter:
    """Stream tensors straight into safetensors shards, holding none of them.

    The tensors to come are declared up front (name, shape, dtype, in write order), so each
    shard's header is written when the shard is opened and every :meth:`add` appends raw bytes.
    Shards hold at most ``max_shard_bytes`` (a single larger tensor gets a shard of its own).
    """

    def __init__(self, out_dir: str | Path, plan: list[tuple[str, tuple[int, ...], torch.dtype]],
                 max_shard_bytes: int = 2 * 1024**3) -> None:
        self.dir = Path(out_dir)
        self._plan = plan
        self.shards: list[list[int]] = [[]]  # indices into plan
        size = 0
        for i, (_, shape, dtype) in enumerate(plan):
            nbytes = math.prod(shape) * dtype.itemsize
            if self.shards[-1] and size + nbytes > max_shard_bytes:
                self.shards.append([])
                size = 0
            self.shards[-1].append(i)
            size += nbytes
        self.total_bytes = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in plan)
        self._shard_of = [k for k, idx in enumerate(self.shards) for _ in idx]
        n = len(self.shards)
        self.files = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self._next = 0
        self._shard = -1
        self._fh = None

    def _open_shard(self, shard: int) -> None:
        if self._fh is not None:
            self._fh.close()
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for i in self.shards[shard]:
            name, shape, dtype = self._plan[i]
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._fh = open(self.dir / (self.files[shard] + ".partial"), "wb")  # noqa: SIM115 (closed in _open/close)
        self._fh.write(struct.pack("<Q", len(raw)) + raw)
        self._shard = shard

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor of the plan (same name, shape and dtype, in plan order)."""
        expected = self._plan[self._next]
        if (name, tuple(tensor.shape), tensor.dtype) != expected:
            raise ValueError(f"HFWriter got {name} {tuple(tensor.shape)} {tensor.dtype}, planned {expected}")
        shard = self._shard_of[self._next]
        if shard != self._shard:
            self._open_shard(shard)
        self._fh.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())
        self._next += 1

    def close(self) -> list[str]:
        """Finish the last shard, rename the shards into place, write the index; return file names."""
        if self._next != len(self._plan):
            raise ValueError(f"HFWriter closed after {self._next} of {len(self._plan)} planned tensors")
        if self._fh is not None:
            self._fh.close()
        for f in self.files:
            (self.dir / (f + ".partial")).rename(self.dir / f)
        if len(self.files) > 1:
            weight_map = {self._plan[i][0]: self.files[k] for k, idx in enumerate(self.shards) for i in idx}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.dir / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return self.files


def copy_aux_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy tokenizer / generation files that exist in ``src``; return their names."""
    copied = []
    for name in AUX_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied
