"""Adapter-only LoRA sync into vLLM: each version of a LoRA policy's adapter as a vLLM LoRA adapter of its own.

With ``rollout.engine.lora_sync=adapter`` the vLLM engine holds the policy's frozen base weights (synced once,
through the weight-transfer API like any sync) and, per sync, the adapter alone: peft-format tensors
(:func:`megarl.models.adapters.to_peft`) that :class:`AdapterVersions` writes to a directory of their own (vLLM
loads LoRA adapters from disk only: ``LoRAModel.from_local_checkpoint``) and hands to vLLM as a ``LoRARequest``
whose name and int id are new at every sync. Both must be new: vLLM keys its prefix cache by the adapter's name
(``v1/core/kv_cache_utils.py``: a reused name reuses KV blocks computed with the old adapter) and keeps an adapter
by its id (``lora/worker_manager.py`` ``LRUCacheWorkerLoRAManager.add_adapter``: an id it holds is not read
again), so a reused name or id serves the old version with no error -- verl#7495, which looked like staleness.
The adapter is loaded when the sync ends (``add_lora``), so a bad adapter fails the sync, not a later generation,
and the engine then holds exactly that version (``max_cpu_loras`` 1: vLLM's LRU cache drops the previous one);
every generated request must report it back (:meth:`AdapterVersions.check_outputs`). The directory of the
version before is removed once the next is loaded; the root goes at :meth:`AdapterVersions.close` (or, after a
process that never closed its engine, with the next engine's start: :func:`remove_orphans`).

Imports torch, safetensors and megarl; vLLM only inside :meth:`AdapterVersions.load` (its ``LoRARequest``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from megarl.rollout.base import WeightUpdateError

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "adapter_model.safetensors"  # peft's file names, which vLLM's loader looks for
CONFIG_FILE = "adapter_config.json"
ROOT_PREFIX = "megarl-lora-"  # + the engine process's pid: the per-engine root under the temporary directory


class AdapterVersions:
    """The adapter versions of one engine: where each is written, the request that names it, the one held now."""

    def __init__(self, root: str | Path | None = None) -> None:
        """``root``: where the per-version directories go (None: a fresh temporary directory named after this
        process, removed by :meth:`close`, when the engine is garbage-collected, or by the next engine on this
        machine once this process is gone: a killed worker closes nothing)."""
        self._owns_root = root is None
        if root is None:
            remove_orphans(Path(tempfile.gettempdir()))
            self.root = Path(tempfile.mkdtemp(prefix=f"{ROOT_PREFIX}{os.getpid()}-"))
            self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.root), True)
        else:
            self.root = Path(root)
            self.root.mkdir(parents=True, exist_ok=True)
        self.count = 0  # adapters loaded by this engine: the int id of the latest (vLLM's ids start at 1)
        self.current: Any = None  # the LoRARequest of the adapter held now (None before the first sync)

    def load(self, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], version: int,
             add: Callable[[Any], Any], held: Callable[[], Iterable[int]]) -> Any:
        """Write version ``version``'s peft ``tensors`` and ``config`` (``adapter_config.json``), load them with
        ``add`` (vLLM's ``add_lora``) and check with ``held`` (``list_loras``) that the engine holds this adapter
        and no other; returns its request, the one every generation must carry."""
        from vllm.lora.request import LoRARequest

        self.count += 1
        name = f"megarl-{self.count}-v{version}"  # new at every sync, even when a restart repeats a version
        path = self.root / name
        path.mkdir()
        # a copy each: peft repeats one A on every projection of a fused weight; safetensors refuses shared memory
        copies = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}
        save_file(copies, str(path / WEIGHTS_FILE))
        (path / CONFIG_FILE).write_text(json.dumps(dict(config), indent=2))
        request = LoRARequest(lora_name=name, lora_int_id=self.count, lora_path=str(path))
        try:
            add(request)
        except (KeyError, ValueError, AssertionError, RuntimeError) as e:
            raise WeightUpdateError(f"vLLM could not load the LoRA adapter of version {version} ({path}): "
                                    f"{type(e).__name__}: {e}") from e
        ids = set(held())
        if ids != {request.lora_int_id}:
            raise WeightUpdateError(f"after loading the adapter of version {version} (id {request.lora_int_id}) "
                                    f"vLLM holds the adapters {sorted(ids)}; expected exactly that one")
        previous, self.current = self.current, request
        if previous is not None:
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        logger.debug("LoRA adapter %s loaded (%d tensors)", name, len(tensors))
        return request

    def check_outputs(self, outputs: Iterable[Any]) -> None:
        """Every generated request must have run with the adapter held now (vLLM's ``RequestOutput.lora_request``):
        one that ran with another or none generated with other weights than the policy's latest."""
        expected = self.current.lora_name if self.current is not None else None
        for out in outputs:
            used = getattr(getattr(out, "lora_request", None), "lora_name", None)
            if used != expected:
                raise WeightUpdateError(
                    f"vLLM generated request {out.request_id} with the LoRA adapter {used!r}, but the adapter synced "
                    f"last is {expected!r}: the adapter request did not reach generate, or a stale one did, so the "
                    "rows come from other weights than the policy's (rollout.engine.lora_sync=adapter).")

    def close(self) -> None:
        self.current = None
        if self._owns_root:
            self._finalizer()


def remove_orphans(tmp: Path) -> list[Path]:
    """Remove the adapter directories (``megarl-lora-<pid>-*`` under ``tmp``) of processes that no longer run; returns
    them. A live process's (a reused pid's, too) are left alone."""
    removed = []
    for path in tmp.glob(f"{ROOT_PREFIX}*-*"):
        pid = path.name.removeprefix(ROOT_PREFIX).split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
