"""Batch: the one container the driver and the workers exchange.

Per-sample tensors live in a ``tensordict.TensorDict`` whose batch dimension is the sample axis;
per-sample Python objects (prompt strings, reward-function extras) are lists of the same length;
``meta`` holds batch-level values (sampling settings, step counters). Batches split, concatenate,
select fields and pad to a multiple of the data-parallel size (and drop that padding again), which
is all the controller's dispatch needs.

Pickling ships each tensor as a flat numpy byte array of exactly its own elements (never the larger
storage a slice views), which pickle protocol 5 - and so Ray's object store - moves as an out-of-band
buffer without copying. On the receiving side a read-only buffer (shared object-store memory) is
copied once into a private tensor, so a role may modify its inputs without touching a peer's copy.
Pure module: no Ray, no torch.distributed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict


@dataclasses.dataclass
class Batch:
    tensors: TensorDict
    non_tensors: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.tensors.batch_size) != 1:
            raise ValueError(f"Batch tensors need a 1-d batch size, found {tuple(self.tensors.batch_size)}")
        n = self.tensors.batch_size[0]
        for key, values in self.non_tensors.items():
            if len(values) != n:
                raise ValueError(f"non-tensor field {key!r} has {len(values)} entries, the batch has {n} samples")

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor],
        non_tensors: Mapping[str, Sequence[Any]] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Batch:
        """Build from plain dicts; every tensor's first dimension is the batch size."""
        non_tensors = {k: list(v) for k, v in (non_tensors or {}).items()}
        sizes = {k: t.shape[0] for k, t in tensors.items()} | {k: len(v) for k, v in non_tensors.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"fields disagree on the batch size: {sizes}")
        n = next(iter(sizes.values()), 0)
        return cls(TensorDict(dict(tensors), batch_size=[n]), non_tensors, dict(meta or {}))

    def __len__(self) -> int:
        return int(self.tensors.batch_size[0])

    def __getitem__(self, key: str) -> torch.Tensor | list[Any]:
        if key in self.non_tensors:
            return self.non_tensors[key]
        if key in self.tensors.keys():  # noqa: SIM118 (TensorDict)
            return self.tensors[key]
        raise KeyError(f"batch has no field {key!r}; fields: {self.keys()}")

    def __contains__(self, key: object) -> bool:
        return key in self.non_tensors or key in self.tensors.keys()  # noqa: SIM118 (TensorDict)

    def keys(self) -> list[str]:
        return sorted(list(self.tensors.keys()) + list(self.non_tensors))

    def select(self, *keys: str) -> Batch:
        """A batch with only these fields (meta is kept)."""
        missing = [k for k in keys if k not in self.keys()]
        if missing:
            raise KeyError(f"batch has no fields {missing}; fields: {self.keys()}")
        tensor_keys = [k for k in keys if k in self.tensors.keys()]  # noqa: SIM118
        return Batch(
            self.tensors.select(*tensor_keys),
            {k: self.non_tensors[k] for k in keys if k in self.non_tensors},
            dict(self.meta),
        )

    def update(self, other: Batch) -> Batch:
        """A batch with the fields of both (``other`` wins on clashes); sizes must match."""
        if len(other) != len(self):
            raise ValueError(f"cannot merge a batch of {len(other)} samples into one of {len(self)}")
        tensors = self.tensors.clone(recurse=False)
        tensors.update(other.tensors)
        return Batch(tensors, self.non_tensors | other.non_tensors, self.meta | other.meta)

    def slice(self, start: int, stop: int) -> Batch:
        return Batch(
            self.tensors[start:stop], {k: v[start:stop] for k, v in self.non_tensors.items()}, dict(self.meta)
        )

    def index(self, indices: torch.Tensor | Sequence[int]) -> Batch:
        idx = torch.as_tensor(indices, dtype=torch.long)
        order = idx.tolist()
        non_tensors = {k: [v[i] for i in order] for k, v in self.non_tensors.items()}
        return Batch(self.tensors[idx], non_tensors, dict(self.meta))

    def chunk(self, n: int) -> list[Batch]:
        """``n`` equal consecutive parts; the batch size must be divisible by ``n`` (pad first)."""
        if n < 1 or len(self) % n:
            raise ValueError(f"cannot split {len(self)} samples into {n} equal parts; pad_to_multiple({n}) first")
        size = len(self) // n
        return [self.slice(i * size, (i + 1) * size) for i in range(n)]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all batches in order. Token fields (2-d and up) of different widths, e.g. each data-
        parallel rank's rows cut to its own longest sequence, are right-padded with 0 to the widest:
        rows are right-padded and masked by their own ``attention_mask``/``response_mask`` anyway."""
        if not batches:
            raise ValueError("cannot concatenate an empty list of batches")
        keys = [b.keys() for b in batches]
        if any(k != keys[0] for k in keys):
            raise ValueError(f"batches with different fields cannot be concatenated: {keys}")
        parts = [b.tensors for b in batches]
        token_keys = [k for k in parts[0].keys() if parts[0][k].dim() >= 2]  # noqa: SIM118 (TensorDict)
        widths = {k: max(p[k].shape[1] for p in parts) for k in token_keys}
        if any(p[k].shape[1] != w for p in parts for k, w in widths.items()):
            parts = [_right_pad(p, widths) for p in parts]
        tensors = torch.cat(parts, dim=0)
        non_tensors = {k: [x for b in batches for x in b.non_tensors[k]] for k in batches[0].non_tensors}
        return Batch(tensors, non_tensors, dict(batches[0].meta))

    def shard(self, n: int) -> tuple[list[Batch], int]:
        """``n`` consecutive shards of ``ceil(len/n)`` rows; short trailing shards are filled with copies
        of the first rows. Returns (shards, pad): concatenating the shards puts all ``pad`` filler rows
        last, so ``Batch.concat(results).unpad(pad)`` restores the original rows. Copies only filler."""
        if len(self) == 0:
            raise ValueError("cannot shard an empty batch")
        size = -(-len(self) // n)
        shards = []
        for d in range(n):
            part = self.slice(min(d * size, len(self)), min((d + 1) * size, len(self)))
            missing = size - len(part)
            if missing:
                filler = self.index(torch.arange(missing) % len(self))
                part = Batch.concat([part, filler]) if len(part) else filler
            shards.append(part)
        return shards, size * n - len(self)

    def pad_to_multiple(self, k: int) -> tuple[Batch, int]:
        """Append copies of the first samples until the size is a multiple of ``k``; return (batch, pad)."""
        if len(self) == 0:
            raise ValueError("cannot pad an empty batch")
        pad = -len(self) % k
        if pad == 0:
            return self, 0
        repeats = torch.arange(pad) % len(self)  # real samples, so padded rows compute finite values
        return Batch.concat([self, self.index(repeats)]), pad

    def unpad(self, pad: int) -> Batch:
        return self if pad == 0 else self.slice(0, len(self) - pad)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def __reduce__(self):
        tensors = {k: _pack(t) for k, t in self.tensors.items()}
        return _unpickle_batch, (tensors, len(self), self.non_tensors, self.meta)


def prompt_batch(prompts: Sequence[Sequence[int]]) -> Batch:
    """Token-id prompts as the rollout's input: ``prompt_ids`` right-padded with 0, and ``prompt_lengths``."""
    ids = torch.zeros(len(prompts), max(map(len, prompts)), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.as_tensor(p, dtype=torch.long)
    return Batch.from_dict({"prompt_ids": ids, "prompt_lengths": torch.tensor([len(p) for p in prompts])})


def prompt_lists(prompts: Batch) -> list[list[int]]:
    """The token-id prompts of a :func:`prompt_batch`, without padding."""
    return [row[: int(n)].tolist() for row, n in zip(prompts["prompt_ids"], prompts["prompt_lengths"], strict=True)]


def _pack(t: torch.Tensor) -> tuple[np.ndarray, str, tuple[int, ...]]:
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape)


def _unpack(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    if not raw.flags.writeable:  # a view of shared memory (Ray's object store): take a private copy
        raw = raw.copy()
    return torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)


def _unpickle_batch(tensors: dict, size: int, non_tensors: dict, meta: dict) -> Batch:
    td = TensorDict({k: _unpack(*v) for k, v in tensors.items()}, batch_size=[size])
    return Batch(td, non_tensors, meta)


def _right_pad(tensors: TensorDict, widths: Mapping[str, int]) -> TensorDict:
    out = tensors.clone(recurse=False)
    for key, width in widths.items():
        t = tensors[key]
        if t.shape[1] < width:
            pad = [0, 0] * (t.dim() - 2) + [0, width - t.shape[1]]
            out[key] = torch.nn.functional.pad(t, pad)
    return out
