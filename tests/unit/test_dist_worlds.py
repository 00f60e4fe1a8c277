"""megarl.testing.dist.run_world: ranks forked from a fork server that imported torch and megatron-core once.

References: the caller's own state (an environment variable and a working directory set after the server
started, ``sys.path``) and each rank's ``sys.modules`` at entry.
"""

from __future__ import annotations

import os
import sys

import pytest

from megarl.testing.dist import run_world

pytestmark = pytest.mark.dist


def _state(rank, world_size):
    import torch.distributed as dist

    preloaded = "megarl.roles.policy" in sys.modules  # one of the worlds' modules the server imported (PRELOAD)
    dist.init_process_group("gloo")
    box = [None] * world_size
    dist.all_gather_object(box, rank)
    return {"env": os.environ.get("MEGARL_WORLD_PROBE"), "cwd": os.getcwd(), "path": sys.path,
            "preloaded": preloaded, "gathered": box, "pid": os.getpid()}


def test_ranks_see_the_callers_environment_and_directory_and_start_with_the_imports(tmp_path, monkeypatch):
    first = run_world(_state, 2)  # starts the fork server (if no world did before)
    monkeypatch.setenv("MEGARL_WORLD_PROBE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    second = run_world(_state, 2)
    assert [r["gathered"] for r in first + second] == [[0, 1]] * 4
    assert all(r["env"] is None for r in first)
    assert all(r["env"] == "set after the server started" and r["cwd"] == str(tmp_path) for r in second)
    assert all(r["path"] == sys.path for r in second)
    assert all(r["preloaded"] for r in first + second)
    assert len({r["pid"] for r in first + second}) == 4
