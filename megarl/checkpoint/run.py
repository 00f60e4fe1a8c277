"""Run checkpoints: ``<output_dir>/checkpoints/step_000042/{policy,critic,trainer.json}``.

A step directory is built under a temporary name and renamed into place only after every part is
written, ``trainer.json`` last; :func:`latest` only considers directories that have it, so a crash
at any moment leaves the previous checkpoint as the latest one. Old checkpoints beyond
``keep`` are deleted after a new one is complete. Pure filesystem code.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

TRAINER_STATE = "trainer.json"
_STEP = re.compile(r"^step_(\d{6})$")


def root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def latest(output_dir: str | Path) -> Path | None:
    """The newest complete step directory, or None."""
    base = root(output_dir)
    if not base.is_dir():
        return None
    done = [p for p in base.iterdir() if _STEP.match(p.name) and (p / TRAINER_STATE).is_file()]
    return max(done, key=lambda p: int(_STEP.match(p.name).group(1)), default=None)


def begin(output_dir: str | Path, step: int) -> Path:
    """A fresh temporary directory for step ``step`` (stale ones from crashed runs are removed)."""
    base = root(output_dir)
    base.mkdir(parents=True, exist_ok=True)
    for stale in base.glob(".step_*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = base / f".step_{step:06d}.tmp"
    tmp.mkdir()
    return tmp


def commit(tmp: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write the trainer state, rename ``tmp`` to its final name, prune old checkpoints."""
    (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=1))
    final = tmp.parent / f"step_{step:06d}"
    if final.exists():  # a re-run of the same step after a resume: replace it
        shutil.rmtree(final)
    tmp.rename(final)
    done = sorted((p for p in tmp.parent.iterdir() if _STEP.match(p.name)), key=lambda p: p.name)
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_state(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / TRAINER_STATE).read_text())
