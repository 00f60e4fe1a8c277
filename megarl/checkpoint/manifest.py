"""Checksums of every file of a checkpoint: written when it is committed, verified before it is loaded.

``manifest.json`` at the checkpoint's root lists each file below it (relative path -> size in bytes and
SHA-256). :func:`verify` re-reads every file and raises :class:`~megarl.errors.CheckpointError` naming
the first file that is missing, has another size (a truncated shard) or another checksum (a flipped
byte), or a manifest that cannot be read. Files are hashed on a thread pool (hashlib releases the GIL):
on a 2-core machine 3.2 GB/s right after the write and 1.5 GB/s from a cold cache, i.e. 5 s at commit
and 11 s at resume for a 1B model's 17.3 GB checkpoint (``benchmarks/checkpoint_verify.py``). Files
that are not in the manifest are ignored. Pure: stdlib and ``megarl.errors``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
from pathlib import Path

from megarl.errors import CheckpointError

MANIFEST = "manifest.json"
_CHUNK = 8 << 20


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.relative_to(root).as_posix() != MANIFEST)


def _hash_all(paths: list[Path]) -> list[str]:
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(sha256, paths))


def write_manifest(root: str | Path) -> Path:
    """Hash every file under ``root`` into ``root/manifest.json`` (written last, then fsynced)."""
    root = Path(root)
    paths = _files(root)
    entries = {p.relative_to(root).as_posix(): {"size": p.stat().st_size, "sha256": digest}
               for p, digest in zip(paths, _hash_all(paths), strict=True)}
    out = root / MANIFEST
    with out.open("w") as f:
        json.dump({"version": 1, "files": entries}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    return out


def verify(root: str | Path) -> None:
    """Raise :class:`CheckpointError` unless every file in ``root``'s manifest is there, intact."""
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{root} has no {MANIFEST}: it was not committed completely (or by a megarl that "
                              "did not checksum checkpoints), so it cannot be verified.")
    try:
        entries = json.loads(path.read_text())["files"]
        expected = {name: (int(e["size"]), str(e["sha256"])) for name, e in entries.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}: {e}): the checkpoint cannot be "
                              "verified.") from e
    present = []
    for name, (size, _) in sorted(expected.items()):
        file = root / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing (listed in {path}).")
        if file.stat().st_size != size:
            raise CheckpointError(f"{file} has {file.stat().st_size} bytes, {size} when the checkpoint was "
                                  "written: it was truncated or overwritten.")
        present.append(name)
    for name, digest in zip(present, _hash_all([root / n for n in present]), strict=True):
        if digest != expected[name][1]:
            raise CheckpointError(f"{root / name} does not match its checksum in {path} (sha256 {digest[:12]}..., "
                                  f"written as {expected[name][1][:12]}...): its contents changed after it was "
                                  "written (disk or copy corruption).")
