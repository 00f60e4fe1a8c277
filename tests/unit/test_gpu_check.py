"""`make gpu-check` on a machine without a GPU (CI): it says so, lists every check it would run, and exits 0."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry path is the one without a CUDA device")
def test_make_gpu_check_without_a_gpu_lists_the_checks_and_exits_0():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO / "tools"))
    cmd = (["make", "-s", "gpu-check", f"GPU_PY={sys.executable}"] if shutil.which("make")
           else [sys.executable, "tools/gpu_check.py"])
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("no CUDA device here: nothing is run")
    listed = [ln.split(". ", 1)[1].split(" (needs")[0].split(": pytest")[0] for ln in lines[1:]]
    assert listed == [c.name for c in gpu_check.CHECKS] and len(listed) == 9
    # the list: collective audit over MoE + dense, checkpoint resume, TE, vLLM cycles, colocated memory, and
    # issue #47's one-GPU rehearsal of the 7B recipe
    text = done.stdout
    for phrase in ("MoE cycle", "checkpoint save/resume bit-exact", "Transformer Engine round trip",
                   "one-GPU rehearsal of the 7B recipe at true width",
                   "sleep/wake/sync/generate twice", "realistic memory ratio"):
        assert phrase in text, phrase
    assert "(needs vllm)" in text and "(needs transformer_engine)" in text
    # every test a check names exists (a renamed test would make the GPU run skip it silently)
    for c in gpu_check.CHECKS:
        for t in c.tests:
            if t.startswith("tests/"):
                path, _, name = t.partition("::")
                assert (REPO / path).is_file(), t
                assert not name or f"def {name}(" in (REPO / path).read_text(), t
