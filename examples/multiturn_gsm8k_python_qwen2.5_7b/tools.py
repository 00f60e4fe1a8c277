"""The tool of examples/multiturn_gsm8k_python_qwen2.5_7b: run a short Python program, return what it printed.

Runs in a separate interpreter with a time limit, no stdin, and its output cut to 2,000 characters. It is NOT a
sandbox: the program can read and write files and open connections as the training user. Run it inside a
container or a restricted user account (or replace it with a sandboxed executor) on shared machines.
"""

from __future__ import annotations

import subprocess
import sys

TIMEOUT_S = 5
MAX_CHARS = 2000


def python(code: str) -> str:
    """Run a Python program and return its standard output (and the error, if it raised). Use print() to see
    values."""
    try:
        done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"timed out after {TIMEOUT_S} s"
    if done.returncode != 0:  # what it printed, then the exception's last line
        last = done.stderr.strip().splitlines()[-1:]
        return (done.stdout + (last[0] if last else f"exit status {done.returncode}"))[:MAX_CHARS]
    return done.stdout[:MAX_CHARS] or "(no output: print the values you need)"
