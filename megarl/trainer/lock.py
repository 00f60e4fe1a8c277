"""One run per output directory: an exclusive lock on ``<output_dir>/.megarl.lock``.

The lock is an ``flock`` held by the driver for the whole run (the kernel releases it when the process
dies, however it dies), and the file names its holder (host, pid, start time, command) for the message
a second run prints. A lock file whose ``flock`` is free is stale: its holder ended; the new run takes
it over and says so. ``flock`` is not shared between hosts on every network file system, so the holder
also refreshes the file's modification time every :data:`HEARTBEAT_S` seconds, and a run refuses a
lock that another host refreshed within :data:`STALE_AFTER_S`, even when its own ``flock`` succeeded.

Pure: stdlib only.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from megarl.errors import ClusterError

logger = logging.getLogger(__name__)

LOCK_FILE = ".megarl.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 4 * HEARTBEAT_S


class RunLock:
    """Held from :meth:`acquire` until :meth:`release` (or the process's end)."""

    def __init__(self, output_dir: str | Path) -> None:
        self.path = Path(output_dir) / LOCK_FILE
        self._fd: int | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ClusterError(self._held_message(_read_holder(self.path), "holds it")) from None
        previous = _read_holder(self.path)
        age = time.time() - self.path.stat().st_mtime
        if previous and previous.get("host") != socket.gethostname() and age < STALE_AFTER_S:
            os.close(fd)  # another host's run, alive by its heartbeat: its flock is just not visible here
            raise ClusterError(self._held_message(previous, f"refreshed it {age:.0f} s ago"))
        if previous:
            logger.warning("taking over the stale lock %s of an ended run (pid %s on %s, started %s)", self.path,
                           previous.get("pid"), previous.get("host"), previous.get("started"))
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        self._beat = threading.Thread(target=self._heartbeat, name="megarl-run-lock", daemon=True)
        self._beat.start()

    def release(self) -> None:
        if self._fd is None:
            return
        self._stop.set()
        os.ftruncate(self._fd, 0)  # an empty lock file: the next run starts without a "stale lock" warning
        os.close(self._fd)  # releases the flock
        self._fd = None

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def _held_message(self, holder: dict[str, Any], how: str) -> str:
        who = (f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')} "
               f"(`{holder.get('command')}`)") if holder else "another process"
        return (f"the output directory {self.path.parent} is in use by another megarl run: {who} {how} "
                f"({self.path}). Two runs in one directory would overwrite each other's checkpoints: wait for it "
                "to end, stop it, or set a different trainer.output_dir.")


def _read_holder(path: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        text = path.read_text().strip()
        return json.loads(text) if text else {}
    return {}
