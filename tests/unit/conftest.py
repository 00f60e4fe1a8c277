"""Fixtures of the unit tests."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def plan_cli(monkeypatch, capsys):
    """tools/plan.py run in this process: ``plan_cli(*args)`` -> (exit status, stdout, stderr)."""

    def run(*args: str) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["plan.py", *args])
        with pytest.raises(SystemExit) as e:
            runpy.run_path(str(REPO / "tools" / "plan.py"), run_name="__main__")
        out = capsys.readouterr()
        return e.value.code, out.out, out.err

    return run
