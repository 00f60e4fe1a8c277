"""Checkpoint checksums and the resume point (issue #21, items 2 and 4): pure filesystem, no workers.

References: checksums computed here with hashlib over bytes the test wrote, and hand-made damage (a
flipped byte, a truncated shard, a missing file, a cut ``trainer.json``) whose file the error must name.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest

from megarl.checkpoint import manifest, run
from megarl.errors import CheckpointError


def _step(out: Path, step: int, keep: int = 10, payload: bytes | None = None) -> Path:
    """A committed step checkpoint with a policy "shard" and an optimizer "shard" of known bytes."""
    tmp = run.begin(out, step)
    (tmp / "policy" / "weights").mkdir(parents=True)
    (tmp / "policy" / "weights" / "__0_0.distcp").write_bytes(payload or bytes(range(256)) * (step + 1))
    (tmp / "policy" / "weights" / "optim.distcp").write_bytes(b"adam" * 100 * step)
    return run.commit(tmp, step, {"step": step, "sampler": {"epoch": 0}}, keep)


def test_manifest_lists_every_file_with_its_size_and_sha256(tmp_path):
    ckpt = _step(tmp_path, 3)
    entries = json.loads((ckpt / manifest.MANIFEST).read_text())["files"]
    files = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())
    assert sorted(entries) == [f for f in files if f != manifest.MANIFEST]
    shard = ckpt / "policy" / "weights" / "__0_0.distcp"
    assert entries["policy/weights/__0_0.distcp"] == {"size": 256 * 4,
                                                      "sha256": hashlib.sha256(bytes(range(256)) * 4).hexdigest()}
    assert entries["trainer.json"]["size"] == (ckpt / "trainer.json").stat().st_size
    manifest.verify(ckpt)  # intact
    assert shard.stat().st_size == 1024


@pytest.mark.parametrize("damage, reason", [
    ("flip", "does not match its checksum"),
    ("truncate", "has 1000 bytes, 1024 when"),
    ("delete", "is missing"),
])
def test_verify_names_the_damaged_file(tmp_path, damage, reason):
    ckpt = _step(tmp_path, 3)
    shard = ckpt / "policy" / "weights" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    if damage == "flip":  # same size, one byte changed
        data[517] ^= 0x01
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(bytes(data[:1000]))
    else:
        shard.unlink()
    with pytest.raises(CheckpointError, match=reason) as e:
        manifest.verify(ckpt)
    assert str(shard) in str(e.value)


def test_a_checkpoint_without_or_with_a_cut_manifest_is_not_intact(tmp_path):
    ckpt = _step(tmp_path, 1)
    text = (ckpt / manifest.MANIFEST).read_text()
    (ckpt / manifest.MANIFEST).write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match="manifest.json is unreadable"):
        manifest.verify(ckpt)
    (ckpt / manifest.MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="has no manifest.json"):
        manifest.verify(ckpt)


def test_resume_point_falls_back_to_the_newest_intact_checkpoint(tmp_path, caplog):
    for step in (2, 4, 6):
        _step(tmp_path, step)
    assert run.resume_point(tmp_path, fallback=True).name == "step_000006"
    shard = tmp_path / "checkpoints" / "step_000006" / "policy" / "weights" / "optim.distcp"
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    state = tmp_path / "checkpoints" / "step_000004" / "trainer.json"
    state.write_text(state.read_text()[:7])  # a cut trainer.json: its size no longer matches
    with caplog.at_level(logging.WARNING, logger="megarl.checkpoint.run"):
        chosen = run.resume_point(tmp_path, fallback=True)
    assert chosen.name == "step_000002"
    assert run.read_state(chosen)["step"] == 2
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_000002", "step_000004.corrupt", "step_000006.corrupt"]  # kept aside, not deleted
    assert "optim.distcp does not match its checksum" in caplog.text and "trainer.json has 7 bytes" in caplog.text
    # a corrupt checkpoint moved aside is never pruned nor taken for a step checkpoint
    _step(tmp_path, 8, keep=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_000004.corrupt", "step_000006.corrupt", "step_000008"]


def test_resume_point_fail_mode_and_none_intact(tmp_path):
    for step in (1, 2):
        _step(tmp_path, step)
    newest = tmp_path / "checkpoints" / "step_000002" / "policy" / "weights" / "__0_0.distcp"
    newest.write_bytes(newest.read_bytes()[:-1])
    with pytest.raises(CheckpointError, match="on_corrupt_checkpoint=fallback") as e:
        run.resume_point(tmp_path, fallback=False)
    assert str(newest) in str(e.value)
    assert (tmp_path / "checkpoints" / "step_000002").is_dir()  # fail mode touches nothing
    older = tmp_path / "checkpoints" / "step_000001" / "policy" / "weights" / "optim.distcp"
    older.unlink()
    with pytest.raises(CheckpointError, match="none of the run's 2 checkpoints") as e:
        run.resume_point(tmp_path, fallback=True)
    assert "step_000001: " in str(e.value) and "step_000002: " in str(e.value)
    assert run.resume_point(tmp_path / "fresh", fallback=True) is None  # a new run: nothing to resume


def test_read_state_names_the_file(tmp_path):
    ckpt = _step(tmp_path, 5)
    (ckpt / "trainer.json").write_text('{"step": 5, "sampl')
    with pytest.raises(CheckpointError, match=r"trainer\.json cannot be read \(JSONDecodeError"):
        run.read_state(ckpt)


def test_only_temporaries_of_ended_runs_are_removed_and_only_at_start(tmp_path):
    _step(tmp_path, 1)
    stale = run.begin(tmp_path, 7)  # a save an ended run did not finish
    (stale / "policy").mkdir()
    mine = run.begin(tmp_path, 2)  # begin() of another step leaves other temporaries alone
    assert stale.is_dir() and mine.is_dir()
    assert run.remove_stale(tmp_path) == [mine, stale]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]
