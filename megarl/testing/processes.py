"""Loopback ports and leftover processes, for tests that launch whole runs (launch scripts, Slurm)."""

from __future__ import annotations

import socket
from pathlib import Path


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def free_port_block(lo: int, hi: int, n: int) -> int | None:
    """A port p in [lo, hi) with p .. p+n-1 all free (the launch scripts use RAY_PORT, +1, +2), or None."""
    for base in range(lo, hi, n):
        if not any(port_in_use(p) for p in range(base, base + n)):
            return base
    return None


def processes_mentioning(text: str) -> list[str]:
    """``pid: command line`` of every process whose command line contains ``text`` (e.g. a Ray temp dir)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found


def processes_with_env(key: str, value: str) -> list[str]:
    """``pid: command line`` of every process whose environment has ``key=value``: Ray workers rewrite their
    command line (``ray::WorkerProcess``) but keep the environment of the run that started them."""
    found, entry = [], f"{key}={value}".encode()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if entry not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found.append(f"{proc.name}: {cmdline[:200]}")
    return found
