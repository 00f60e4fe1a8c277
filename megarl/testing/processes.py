"""Loopback ports and leftover processes, for tests that launch whole runs (launch scripts, Slurm)."""

from __future__ import annotations

import socket
from collections.abc import Callable
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
    return _processes(lambda proc, cmdline: text in cmdline)


def processes_with_env(key: str, value: str) -> list[str]:
    """``pid: command line`` of every process whose environment has ``key=value``: Ray workers rewrite their
    command line (``ray::WorkerProcess``) but keep the environment of the run that started them."""
    entry = f"{key}={value}".encode()
    return _processes(lambda proc, cmdline: entry in (proc / "environ").read_bytes().split(b"\0"))


def _processes(match: Callable[[Path, str], bool]) -> list[str]:
    """``pid: command line`` (first 200 characters) of every process ``match(its /proc dir, command line)`` accepts;
    processes that end or deny access while being read are skipped."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if match(proc, cmdline):
                found.append(f"{proc.name}: {cmdline[:200]}")
        except OSError:
            continue
    return found
