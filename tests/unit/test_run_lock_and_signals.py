"""One run per output directory, and the stop signals (issue #21, items 3 and 4): no workers.

The lock holder is a real second process (``flock`` is per open file; a lock taken twice in one
process would say nothing about two runs); the signals are real ones sent to this process.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from megarl.errors import ClusterError
from megarl.trainer import lock as run_lock
from megarl.trainer.lock import LOCK_FILE, RunLock
from megarl.trainer.signals import Abandoned, StopRequest

HOLD = """
import sys, time
from megarl.trainer.lock import RunLock
RunLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


def _holder(out):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_is_refused_naming_the_holder_then_takes_over_a_stale_lock(tmp_path, caplog):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(ClusterError) as e:
            RunLock(tmp_path).acquire()
        message = str(e.value)
        assert f"pid {proc.pid} on host {socket.gethostname()}" in message and "trainer.output_dir" in message
        assert str(tmp_path / LOCK_FILE) in message
    finally:
        proc.kill()  # SIGKILL: no release, the file still names the dead holder
        proc.wait()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == proc.pid
    lock = RunLock(tmp_path)
    with caplog.at_level(logging.WARNING, logger="megarl.trainer.lock"):
        lock.acquire()  # the kernel dropped the dead holder's flock: stale
    assert f"stale lock {tmp_path / LOCK_FILE} of an ended run (pid {proc.pid}" in caplog.text
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert (tmp_path / LOCK_FILE).read_text() == ""  # a clean release: the next run takes it silently
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megarl.trainer.lock"):
        again = RunLock(tmp_path)
        again.acquire()
        again.release()
    assert "stale" not in caplog.text


def test_another_hosts_lock_is_live_while_its_heartbeat_is_fresh(tmp_path):
    """Where flock is not shared between hosts (some network file systems), the holder's heartbeat decides."""
    path = tmp_path / LOCK_FILE
    path.write_text(json.dumps({"host": "node-7", "pid": 4242, "started": "2026-12-01 10:00:00", "command": "x"}))
    with pytest.raises(ClusterError, match=r"pid 4242 on host node-7.*refreshed it \d+ s ago"):
        RunLock(tmp_path).acquire()
    old = time.time() - run_lock.STALE_AFTER_S - 5
    os.utime(path, (old, old))
    lock = RunLock(tmp_path)
    lock.acquire()  # no heartbeat for longer than STALE_AFTER_S: that run ended
    lock.release()


def test_first_signal_requests_a_stop_second_abandons():
    request = StopRequest()
    before = signal.getsignal(signal.SIGTERM)
    request.install()
    try:
        with pytest.raises(Abandoned, match="SIGTERM received while the run was starting"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)
        assert not request.requested
        request.in_loop = True
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs in the main thread at the next bytecode
        assert request.requested and request.name == "SIGTERM"
        with pytest.raises(Abandoned, match="SIGINT received again") as e:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
        assert e.value.signum == signal.SIGINT
    finally:
        request.restore()
    assert signal.getsignal(signal.SIGTERM) is before
