"""The 7B recipe rehearsed on one GPU at its true widths (issue #47 item 4; docs/rehearsal.md §6), as `make gpu-check`
runs it (tools/gpu_check.py), skipped without CUDA.

``examples/grpo_gsm8k_qwen2.5_7b`` with Qwen2.5-7B's published config cut to 2 layers (hidden 3584, FFN 18944, 28/4
heads of 128, untied 152,064-token vocabulary: 1.56 B parameters, 6.2 GB in float32), a world of one NCCL rank at TP1
on GPU 0, the embedded rollout engine in float32 and one SGD update. References: the HF files (round trip,
bit-exact), transformers' float32 forward and ``generate`` on the same GPU with TF32 off (log-probs within 1e-4,
greedy tokens equal), the resharding plan (every byte kept locally in a world of one) and the planner's terms of
each phase's peak CUDA allocation (docs/rehearsal.md §3, §6), worked by hand in tests/unit/test_rehearse_device.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "grpo_gsm8k_qwen2.5_7b" / "config.yaml"
LAYERS = 2  # ~24 GB of the GPU at the load's peak; the time goes to writing and converting 6.2 GB on the host
PARAMETERS = 1_556_113_920  # 2 x 152064 x 3584 + 3584 + 2 layers of 233,057,792 (tests/unit/test_rehearse_device.py)


def test_7b_recipe_on_one_gpu_at_true_width(tmp_path):
    from megarl.bench import rehearse

    report = rehearse.run(RECIPE, tmp_path, layers=LAYERS, world=1, tp=1, preset="qwen2.5-7b", update=True,
                          rollout=True, device="cuda")
    print(rehearse.markdown(report))
    reference = json.loads((tmp_path / "reference.json").read_text())
    assert (report["device"], report["world"], report["tp"], report["layers"]) == ("cuda", 1, 1, LAYERS)
    assert report["reference"]["parameters"] == PARAMETERS
    assert report["convert"]["round_trip_unequal"] == []  # every HF tensor back bit for bit
    assert report["log_prob_max_diff"] < 1e-4  # against transformers' float32 forward on the GPU
    assert report["greedy"] == reference["greedy_float32"]  # transformers.generate, greedy, float32, TF32 off
    moved = [{"received": x["received"], "kept": x["kept"]} for x in report["sync"]]
    assert moved == report["sync_planned"] == [{"received": 0, "kept": 4 * PARAMETERS}]
    by_phase = {c["phase"]: c for c in report["memory_checks"]}
    assert set(by_phase) == {"load", "log-probs", "sync", "generate", "update"}
    for check in by_phase.values():  # 5 % of the prediction or 64 MiB (docs/rehearsal.md §2)
        assert check["within"], check
    assert by_phase["load"]["measured"] > 16 * 2**30  # parameters, gradients and the engine's replica: resolved
    (update,) = report["update"]
    assert update["step_skipped"] is False and update["grad_norm"] > 0
    assert report["failures"] == []
