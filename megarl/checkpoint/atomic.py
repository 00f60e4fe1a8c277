"""Atomic directory writes: build in a temporary sibling, rename into place only when complete.

A crash or an exception never leaves a half-written directory under the final name; the
temporary directory is removed on failure. Pure module (stdlib only).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from megarl.errors import ConfigError


def check_output_dir(path: str | Path) -> Path:
    """Refuse to write into an existing non-empty directory (never overwrite a checkpoint)."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConfigError(
            f"output directory {path} already exists and is not empty; choose a new --out-dir or remove it first."
        )
    return path


@contextlib.contextmanager
def atomic_directory(final: str | Path) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``final`` when the block exits without error."""
    final = check_output_dir(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        _fsync_dir(tmp)
        if final.exists():  # an empty directory the user created
            final.rmdir()
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
