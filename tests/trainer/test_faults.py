"""Fault injection on whole runs (issue #21): what a cluster does to a run, and what the run must do.

Every case runs ``python -m megarl.train`` on the tiny addition task as a user would and injects the fault
from outside: a second run on the same directory, a re-run of a finished run, a flipped byte in the
newest checkpoint, SIGTERM during a step, SIGKILL of a policy worker. The reference for "continues
exactly" is an uninterrupted run of the same config: every step after the fault must have its numbers
(rewards, losses, KL, entropy, gradient norms; not timings).

The fault table (docs/faults.md lists each row with its test):

- two runs on one output directory -> the second exits 2 within seconds naming the holder; the first is unaffected
- a finished run re-run -> "already complete at step N", no worker started
- one byte of a model/optimizer shard of the newest checkpoint changed -> detected; resume from the previous
  checkpoint; its next steps equal the uninterrupted run's
- SIGTERM during a step -> exit 75 after a checkpoint of the last finished step, no Ray process of the run
  left; the next run resumes bit-exactly
- SIGKILL of a policy worker with trainer.max_restarts >= 1 -> the run replaces its workers, resumes, logs one
  incident naming every role the dead process hosted, its rank, host and pid, and its steps equal the uninterrupted
  run's; with no restarts left (the fresh worker killed too) -> exit 3 naming the same, checkpoints intact. The
  SIGTERM run, the resumed run and both kills are one chain of runs on one output directory.

The worker is found as ``ps`` shows it: its process title names the run's roles, rank and coordinates.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from megarl.checkpoint import manifest
from megarl.checkpoint import run as run_checkpoints
from megarl.metrics.tracking import read_metrics
from megarl.testing.processes import processes_with_env

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "grpo_addition_tiny" / "config.yaml"
SMALL = {"data.batch_size": 4, "rollout.sampling.n": 4, "trainer.val_every": 0, "trainer.tensorboard": "false",
         "cluster.pools.main.devices_per_node": 1, "cluster.pools.main.tp": 1}
LOCAL = {"cluster.launcher": "local"}
NOT_COMPARED = ("timing/", "throughput/", "memory/", "run/")
TOTAL = 10  # steps of the runs on Ray


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from megarl.testing.addition import make_task

    return make_task(tmp_path_factory.mktemp("addition"), train_rows=64, val_rows=8)


def _cmd(task: Path, out: Path, model: Path | None = None, **extra) -> list[str]:
    """``model``: a megarl checkpoint to start from (another run's converted ``initial_checkpoint``: the same
    weights, no conversion), or the task's HF model."""
    base = {"model.path": model or task / "model", "data.train": task / "train.jsonl",
            "data.val": task / "val.jsonl", "trainer.output_dir": out}
    return [sys.executable, "-m", "megarl.train", str(EXAMPLE),
            *[f"{k}={v}" for k, v in (base | SMALL | extra).items()]]


def _env(ray_tmp: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_TMPDIR")}
    return env | ({"RAY_TMPDIR": str(ray_tmp)} if ray_tmp else {})


def _run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def _launch(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"),
                            start_new_session=True)


def _wait_for(what: str, ready, proc: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"waiting for {what}: the run exited with {proc.poll()}\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def _logged_steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _numbers(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "time" and not k.startswith(NOT_COMPARED)}


def _assert_same_steps(reference: list[dict], run: list[dict], steps: range) -> None:
    by_step = {m["step"]: m for m in run}
    for m in reference:
        if m["step"] in steps:
            assert _numbers(by_step[m["step"]]) == _numbers(m), m["step"]


def _short_tmp() -> Path:
    """A Ray temp dir: short, since Ray's unix socket paths under it must fit in 107 bytes."""
    return Path(tempfile.mkdtemp(prefix="mrl", dir="/tmp"))


GATED_REWARD = """
import os, time

from megarl.rewards.rules import IntegerAnswerReward

_score = IntegerAnswerReward()


def reward(prompt, response, row):  # holds the run until the test opens the gate
    while not os.path.exists(os.environ["MEGARL_TEST_GATE"]):
        time.sleep(0.05)
    return _score(prompt, response, row)
"""


def test_lock_complete_run_and_corrupt_checkpoint(task, tmp_path):
    gate, reward = tmp_path / "gate", tmp_path / "gated_reward.py"
    reward.write_text(GATED_REWARD)
    out, env = tmp_path / "run", _env() | {"MEGARL_TEST_GATE": str(gate)}
    cmd = _cmd(task, out, **LOCAL, **{"trainer.total_steps": 4, "trainer.save_every": 2,
                                      "reward.function": f"{reward}:reward"})
    first = _launch(cmd, env, tmp_path / "first.log")  # holds its lock, waiting in its first reward
    lock = out / ".megarl.lock"
    _wait_for("the lock", lambda: lock.exists() and lock.read_text().strip(), first, tmp_path / "first.log")
    start = time.monotonic()
    second = _run(cmd, env)
    print(f"second run refused after {time.monotonic() - start:.1f} s")
    gate.touch()
    assert second.returncode == 2, second.stderr[-2000:]
    assert f"in use by another megarl run: pid {first.pid} on host" in second.stderr
    assert first.wait(timeout=600) == 0, (tmp_path / "first.log").read_text()[-3000:]
    full = read_metrics(out)
    assert [m["step"] for m in full] == [1, 2, 3, 4]
    for step in (2, 4):  # the first run's checkpoints are intact
        manifest.verify(out / "checkpoints" / f"step_{step:06d}")

    again = _run(cmd, env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "already complete at step 4" in again.stderr and "worker group" not in again.stderr

    shard = out / "checkpoints" / "step_000004" / "policy" / "weights" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one byte: same size
    shard.write_bytes(bytes(data))
    resumed = _run(cmd, env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "__0_0.distcp does not match its checksum" in resumed.stderr
    assert "resumed from" in resumed.stderr and "step_000002 at step 2" in resumed.stderr
    assert (out / "checkpoints" / "step_000004.corrupt").is_dir()
    manifest.verify(out / "checkpoints" / "step_000004")  # written again by the resumed run
    history = read_metrics(out)
    assert [m["step"] for m in history] == [1, 2, 3, 4]
    _assert_same_steps(full, history, range(3, 5))


# what ps shows of the one rank (policy and reference colocated), between calls or during one
# (megarl.controller.process; the run's name in brackets where the cluster passes it)
TITLE = (r"ray::WorkerProcess(\.call)? megarl(\[\w+\])? policy\+reference rank 0 \(tp 0 pp 0 dp 0\)"
         r"(: (policy|reference)\.\w+)?")


def _kill_the_worker(ray_tmp: Path) -> int:
    """SIGKILL the run's worker, found by its process title (``/proc/<pid>/cmdline``); its pid."""
    workers = [p for p in processes_with_env("RAY_TMPDIR", str(ray_tmp)) if "ray::WorkerProcess" in p]
    assert len(workers) == 1, workers  # one rank: policy and reference colocated
    pid, title = workers[0].split(": ", 1)
    assert re.fullmatch(TITLE, title.strip()), title
    os.kill(int(pid), signal.SIGKILL)
    return int(pid)


def test_sigterm_and_lost_worker_on_ray(task, tmp_path):
    steps = {"trainer.total_steps": TOTAL, "trainer.save_every": 2}
    reference = _run(_cmd(task, tmp_path / "full", **steps), _env(_short_tmp()))
    assert reference.returncode == 0, reference.stderr[-3000:]
    full = read_metrics(tmp_path / "full")
    model = tmp_path / "full" / "initial_checkpoint"  # converted once, by the reference run

    # SIGTERM during a step: the step finishes, its checkpoint is written, the run's Ray stops, exit 75
    out, ray_tmp = tmp_path / "term", _short_tmp()
    cmd = _cmd(task, out, model, **steps | {"trainer.save_every": 0})
    proc = _launch(cmd, _env(ray_tmp), tmp_path / "term.log")
    _wait_for("3 steps", lambda: _logged_steps(out) >= 3, proc, tmp_path / "term.log")
    proc.send_signal(signal.SIGTERM)
    start = time.monotonic()
    assert proc.wait(timeout=120) == 75, (tmp_path / "term.log").read_text()[-3000:]
    print(f"SIGTERM -> exit in {time.monotonic() - start:.1f} s")
    log = (tmp_path / "term.log").read_text()
    done = _logged_steps(out)
    assert f"stopped: SIGTERM received: stopped after step {done} of {TOTAL}; checkpoint of step {done} written" in log
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step_{done:06d}"]
    deadline = time.monotonic() + 15
    while (left := processes_with_env("RAY_TMPDIR", str(ray_tmp))) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, left
    # the next run resumes bit-exactly from that checkpoint, saving every 2 steps, with one restart allowed: its
    # worker is SIGKILLed (fresh workers resume from the newest checkpoint, one incident), then the fresh worker is
    # SIGKILLed too, with no restart left: exit 3 (a requeue may help), the newest checkpoint intact. (A run that
    # finishes after a restart: tests/trainer/test_node_loss.py.)
    proc = _launch(cmd + ["trainer.save_every=2", "trainer.max_restarts=1"], _env(ray_tmp), tmp_path / "lost.log")
    _wait_for(f"{done + 2} steps", lambda: _logged_steps(out) >= done + 2, proc, tmp_path / "lost.log")
    pid = _kill_the_worker(ray_tmp)
    incidents_file = out / "incidents.jsonl"
    _wait_for("the incident", incidents_file.exists, proc, tmp_path / "lost.log")  # written once fresh workers resumed
    incidents = [json.loads(line) for line in incidents_file.read_text().splitlines()]
    # the process hosted policy and reference: the incident names both, whichever call noticed the loss
    assert len(incidents) == 1 and incidents[0]["kind"] == "worker_lost"
    assert incidents[0]["roles"] == ["policy", "reference"] and incidents[0]["rank"] == 0
    assert incidents[0]["host"] == socket.gethostname() and incidents[0]["pid"] == pid and incidents[0]["node_ip"]
    assert incidents[0]["role"] in ("policy", "reference")
    failed, resumed_at = incidents[0]["failed_step"], incidents[0]["resumed_from_step"]
    assert resumed_at == max(done, 2 * ((failed - 1) // 2)) and incidents[0]["steps_lost"] == failed - 1 - resumed_at
    second = _kill_the_worker(ray_tmp)
    assert second != pid
    assert proc.wait(timeout=300) == 3, (tmp_path / "lost.log").read_text()[-3000:]
    log = (tmp_path / "lost.log").read_text()
    assert f"step_{done:06d} at step {done}" in log
    assert re.search(rf"worker lost in step {failed} \(rank 0, hosting policy\+reference, pid "
                     rf"{pid} on {re.escape(socket.gethostname())} \(", log)
    assert re.search(r"error: (policy|reference) failed on rank 0", log)
    assert f"the process hosted policy+reference: pid {second} on {socket.gethostname()} (" in log
    assert "ActorDiedError" in log and "max_restarts=1" in log
    assert len(incidents_file.read_text().splitlines()) == 1  # the second loss stopped the run: no restart
    history = read_metrics(out)
    logged = len(history)
    assert logged < TOTAL and [m["step"] for m in history] == list(range(1, logged + 1)), logged
    assert all(m["run/restarts"] == 1.0 for m in history if m["step"] > resumed_at)
    _assert_same_steps(full, history, range(1, logged + 1))
    manifest.verify(run_checkpoints.resume_point(out, fallback=False))
