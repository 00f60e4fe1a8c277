"""run_world and CUDA worlds (issue #41): a world needing more CUDA devices than the machine has is skipped with
its reason instead of crashing in its ranks (torch.cuda.set_device of a device that does not exist)."""

from __future__ import annotations

import os
import subprocess
import sys
import unittest
from pathlib import Path

import pytest
import torch

from megarl.testing.dist import NotEnoughDevices, check_devices, run_world

REPO = Path(__file__).resolve().parents[2]


def _never_runs(rank, world_size):  # pragma: no cover - the world is not started
    raise AssertionError("started")


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts CUDA devices on a machine without any")
def test_cuda_world_larger_than_the_devices_is_skipped_not_started():
    assert torch.cuda.device_count() == 0
    with pytest.raises(NotEnoughDevices, match=r"a world of 2 CUDA ranks needs 2 CUDA devices .* found 0"):
        run_world(_never_runs, 2, cuda=True, timeout_s=5)
    assert issubclass(NotEnoughDevices, unittest.SkipTest)  # pytest reports it as a skip with this reason
    check_devices(4)  # a CPU (gloo) world needs no device


def test_a_world_needing_devices_skips_under_pytest(tmp_path):
    """What pytest makes of it: a skip with the reason, not an error (pytest's own handling of unittest.SkipTest)."""
    (tmp_path / "test_world.py").write_text(
        "from megarl.testing.dist import run_world\n\n\n"
        "def f(rank, world_size):\n    return rank\n\n\n"
        "def test_world():\n    run_world(f, 64, cuda=True)\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "test_world.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and "1 skipped" in done.stdout, done.stdout + done.stderr
    assert "a world of 64 CUDA ranks needs 64 CUDA devices" in done.stdout
