"""A Ray cluster that already runs on the machine does not capture a run (issue #21, item 1).

Without ``cluster.ray_address`` or ``RAY_ADDRESS`` the driver starts a Ray cluster of its own; it used
to join the newest running one, whose workers ran in another directory and failed on the config's
relative paths. Here another cluster runs while the tiny example trains from its own working directory
with relative paths; the other cluster's session logs show whether any driver or worker joined it
(Ray writes ``python-core-driver-*`` / ``python-core-worker-*`` / ``worker-*`` files for each).

The same run's captured output (not a terminal, as in CI or ``| tee``) is the console of issue #40: one plain
line per step and no bar, no carriage return, none of Ray's start-up notices, and the private cluster's session
directory gone after the clean exit.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from megarl.metrics.tracking import read_metrics
from megarl.testing.processes import free_port_block, port_in_use, processes_mentioning

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "grpo_addition_tiny" / "config.yaml"
JOINED = ("python-core-driver", "python-core-worker", "worker-")


def _joined(logs: Path) -> set[str]:
    return {p.name for p in logs.iterdir() if p.name.startswith(JOINED)} if logs.is_dir() else set()


@pytest.fixture
def other_ray():
    """A Ray head started as a user would (``ray start --head``, Ray's default temp dir, so it is the
    "latest cluster" ``ray.init()`` without an address joins), with ``--block`` so that it is stopped by
    signal: ``ray stop`` would stop every Ray cluster on the machine, the test session's included."""
    if shutil.which("ray", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("the `ray` command is not installed next to this interpreter")
    port = free_port_block(6900, 7100, 3)
    if port is None:
        pytest.skip("no free block of 3 ports in 6900-7100 for the other Ray head")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_TMPDIR")} | {
        "RAY_AUTH_MODE": "disabled"}
    head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", f"--port={port}",
                             "--num-cpus=2", "--include-dashboard=false", f"--object-store-memory={100 * 2**20}"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while not port_in_use(port) and head.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    if not port_in_use(port):
        head.kill()
        pytest.fail(f"the other Ray head did not start:\n{head.communicate()[0][-3000:]}")
    session = Path(tempfile.gettempdir(), "ray", "session_latest").resolve()  # this head's, before any other starts
    yield {"address": f"127.0.0.1:{port}", "logs": session / "logs"}
    os.killpg(head.pid, signal.SIGKILL)  # its whole process group (SIGTERM would drain the node for 30 s)
    head.wait(timeout=60)
    deadline = time.monotonic() + 30
    while processes_mentioning(session.name) and time.monotonic() < deadline:
        time.sleep(0.5)
    shutil.rmtree(session, ignore_errors=True)
    current = Path(tempfile.gettempdir(), "ray", "ray_current_cluster")  # where `ray start` named this head
    if current.is_file() and current.read_text().strip().endswith(f":{port}"):
        current.unlink()


def test_a_running_ray_cluster_does_not_capture_the_run(other_ray, tmp_path):
    from megarl.testing.addition import make_task

    make_task(tmp_path / "task", train_rows=64, val_rows=8)
    before = _joined(other_ray["logs"])
    overrides = {"model.path": "task/model", "data.train": "task/train.jsonl", "data.val": "task/val.jsonl",
                 "trainer.output_dir": "run", "trainer.total_steps": 2, "trainer.save_every": 0,
                 "trainer.val_every": 0, "trainer.tensorboard": "false", "data.batch_size": 4,
                 "rollout.sampling.n": 4}  # relative paths, from the run's own working directory
    # without RAY_AUTH_MODE (tests/conftest.py sets it) Ray turns token authentication on and says so, as for a user
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    proc = subprocess.run([sys.executable, "-m", "megarl.train", str(EXAMPLE), *(f"{k}={v}" for k, v in
                                                                                  overrides.items())],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "starting a private Ray cluster for this run" in log
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2]
    assert _joined(other_ray["logs"]) == before, "a driver or worker of the run joined the other Ray cluster"
    # the console
    lines = log.splitlines()
    assert "\r" not in log and not [line for line in lines if "%|" in line], "a progress bar outside a terminal"
    steps = [line for line in lines if line.startswith("INFO megarl.metrics.tracking: step ")]
    assert [line.split()[3] for line in steps] == ["1/2", "2/2"], steps  # one line per progress update
    assert "Token authentication" not in log and "Started a local Ray instance" not in log
    session = Path(re.search(r"private Ray cluster up in \d+ s; its logs: (\S+)/logs \(removed at a clean exit\)",
                             log)[1])
    assert session.name.startswith("session_") and not session.exists()
    latest = session.parent / "session_latest"
    assert not (latest.is_symlink() and os.readlink(latest) == str(session))
