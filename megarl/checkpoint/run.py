"""Run checkpoints: ``<output_dir>/checkpoints/step_000042/{policy,critic,trainer.json,manifest.json}``.

A step directory is built under a temporary name (``.step_000042.tmp``) and renamed into place only
after every part is written, ``trainer.json`` and then the checksums of every file
(:mod:`megarl.checkpoint.manifest`) last; a crash at any moment leaves the previous checkpoint as the
newest one. Old checkpoints beyond ``keep`` are deleted after a new one is complete.

:func:`resume_point` picks the checkpoint a run resumes from: the newest one whose files all match
their checksums. One that does not is reported (file and reason) and, with ``fallback``, moved aside
to ``step_000042.corrupt`` (kept for inspection, never loaded or pruned) so that the next older one is
tried. The run holds its output directory's lock (:mod:`megarl.trainer.lock`), so temporary
directories found at start belong to an ended run: :func:`remove_stale` deletes them, and nothing else
ever does. Pure filesystem code.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

from megarl.checkpoint import manifest
from megarl.errors import CheckpointError

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer.json"
_STEP = re.compile(r"^step_(\d{6})$")


def root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_of(ckpt: Path) -> int:
    return int(_STEP.match(ckpt.name).group(1))


def candidates(output_dir: str | Path) -> list[Path]:
    """The committed step directories, newest first (not yet verified)."""
    base = root(output_dir)
    if not base.is_dir():
        return []
    return sorted((p for p in base.iterdir() if _STEP.match(p.name) and p.is_dir()), key=step_of, reverse=True)


def resume_point(output_dir: str | Path, *, fallback: bool) -> Path | None:
    """The newest intact checkpoint (None: the run has none). A corrupt newest one raises, unless
    ``fallback``: then it is moved aside and the next older one is tried; none intact raises."""
    problems = []
    for ckpt in candidates(output_dir):
        try:
            manifest.verify(ckpt)
            read_state(ckpt)
            return ckpt
        except CheckpointError as e:
            if not fallback:
                raise CheckpointError(f"the newest checkpoint of the run failed verification: {e} Set "
                                      "trainer.on_corrupt_checkpoint=fallback to resume from the newest intact one, "
                                      "or trainer.resume=false to start over.") from e
            aside = ckpt.with_name(ckpt.name + ".corrupt")
            shutil.rmtree(aside, ignore_errors=True)
            ckpt.rename(aside)
            logger.warning("checkpoint %s failed verification, moved to %s; trying the previous one. %s", ckpt,
                           aside.name, e)
            problems.append(f"{ckpt.name}: {e}")
    if problems:
        raise CheckpointError(f"none of the run's {len(problems)} checkpoints in {root(output_dir)} is intact "
                              f"({'; '.join(problems)}); they were moved to step_*.corrupt. Set trainer.resume=false "
                              "(or use a new trainer.output_dir) to start over.")
    return None


def remove_stale(output_dir: str | Path) -> list[Path]:
    """Delete temporary step directories of ended runs (call only while holding the run's lock)."""
    base = root(output_dir)
    stale = sorted(base.glob(".step_*.tmp")) if base.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def begin(output_dir: str | Path, step: int) -> Path:
    """A fresh temporary directory for step ``step``."""
    base = root(output_dir)
    base.mkdir(parents=True, exist_ok=True)
    tmp = base / f".step_{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # this run's own, left by a save that failed
    tmp.mkdir()
    return tmp


def commit(tmp: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write the trainer state and the checksums, rename ``tmp`` to its final name, prune old checkpoints."""
    (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=1))
    manifest.write_manifest(tmp)
    final = tmp.parent / f"step_{step:06d}"
    if final.exists():  # a re-run of the same step after a resume: replace it
        shutil.rmtree(final)
    tmp.rename(final)
    for old in candidates(tmp.parent.parent)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_state(ckpt: Path) -> dict[str, Any]:
    path = ckpt / TRAINER_STATE
    try:
        state = json.loads(path.read_text())
        int(state["step"])
        return state
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}).") from e
