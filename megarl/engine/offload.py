"""Move tensors' storages to host memory and back, freeing the device (or original host) memory.

Works on storages, not tensors: parameters and gradients in megatron-core's DDP are views into
shared buffers, so each distinct storage is copied once (to pinned memory when CUDA is present)
and then resized to zero bytes; :meth:`StorageOffloader.reload` restores it in place, so every
view (parameter, ``main_grad``, optimizer state) sees bit-identical data afterwards.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class StorageOffloader:
    def __init__(self) -> None:
        self._saved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    @property
    def offloaded(self) -> bool:
        return bool(self._saved)

    def offload(self, tensors: Iterable[torch.Tensor], exclude: set[int] = frozenset()) -> int:
        """Copy out and free the storages of ``tensors`` (skipping storage pointers in ``exclude``);
        returns the bytes freed."""
        if self._saved:
            raise RuntimeError("tensors are already offloaded; reload() first")
        seen = set(exclude)
        freed = 0
        for t in tensors:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in seen or storage.nbytes() == 0:
                continue
            seen.add(ptr)
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
            host.untyped_storage().copy_(storage)
            freed += storage.nbytes()
            storage.resize_(0)
            self._saved.append((storage, host))
        return freed

    def reload(self) -> None:
        for storage, host in self._saved:
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage())
        self._saved = []


def storage_ptrs(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}
