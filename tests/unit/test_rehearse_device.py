"""A rehearsal's device (megarl.bench.rehearse; docs/rehearsal.md §6) on a machine without a GPU: the probe of each
device, the predictions of the one-GPU 7B rehearsal worked by hand from Qwen2.5-7B's published config, and the
command line's ``--device`` reaching the rehearsal (refused before anything is written where no GPU is).

What CPU cannot show of the CUDA path (tensors on the GPU, the allocator's peaks) is tests/gpu/test_cuda_rehearsal.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarl.bench import rehearse, rehearse_memory
from megarl.errors import ConfigError
from megarl.planner.presets import PRESETS

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "grpo_gsm8k_qwen2.5_7b" / "config.yaml"

# Qwen2.5-7B (config.json): vocabulary 152064, hidden 3584, FFN 18944, 28 heads, 4 KV heads of 128, untied
V, H, F, KV = 152064, 3584, 18944, 4 * 128
LAYER = 2 * H + (H * H + H) + 2 * (KV * H + KV) + H * H + 3 * F * H  # 2 norms, q (+bias), k, v (+bias), o, MLP
PARAMS_2_LAYERS = 2 * V * H + H + 2 * LAYER  # embedding, output layer, final norm
assert PARAMS_2_LAYERS == 1_556_113_920


def _q7(device: str, update: bool = True) -> rehearse.Rehearsal:
    """The GPU test's rehearsal: the 7B cut to 2 layers, world 1, TP1, rollout and one update."""
    return rehearse.Rehearsal("q7", rehearse.cut_layers(PRESETS["qwen2.5-7b"], 2), 1, 1, 1, 1,
                              rehearse.RolloutBackend.EMBEDDED, 1, "float32", update, True, ((5, 6),), 8, device=device)


def test_each_device_has_its_probe_and_an_unknown_one_is_named():
    assert rehearse_memory.memory_probe("cpu") is rehearse_memory.PhaseMemory
    assert rehearse_memory.memory_probe("cuda") is rehearse_memory.CudaPhaseMemory
    assert (rehearse_memory.PhaseMemory.backend, rehearse_memory.CudaPhaseMemory.backend) == ("gloo", "nccl")
    # run_world's cuda=
    assert (rehearse_memory.PhaseMemory.cuda, rehearse_memory.CudaPhaseMemory.cuda) == (False, True)
    for bad in ("mps", "cuda:0", "gpu"):
        with pytest.raises(ConfigError, match=r"unknown rehearsal device .*known: \['cpu', 'cuda'\]"):
            rehearse_memory.memory_probe(bad)
    assert rehearse_memory.PhaseMemory().device == "cpu"  # the rank's WorkerContext.device on CPU
    rehearse_memory.PhaseMemory.require(64)  # a CPU world needs no device


def test_float32_products_stay_float32():
    """The reference and the ranks turn TF32 off (on a GPU it would move log-probs by ~1e-3 and flip greedy ties)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        rehearse._exact_float32()
        assert torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.allow_tf32 is False
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_one_gpu_7b_predictions_by_hand():
    """Where the planner's terms land per device (bytes, float32): P parameters, G gradients, R the embedded
    engine's replica, B the sync's transient (one 64 MiB bucket: the engine receives into its own parameters), M the
    merged fc1 of 2 layers."""
    P = G = R = 4 * PARAMS_2_LAYERS  # the rollout replica is the whole model in float32; 152064 % 64 == 0
    B, M, shard = 64 * 2**20, 2 * 2 * F * H * 4, 4 * V * H
    t = rehearse_memory.memory_terms(_q7("cuda"))
    assert (t.params, t.grads, t.rollout, t.receive, t.load_merged, t.load_read) == (P, G, R, B, M, shard)
    gpu = rehearse_memory.predicted_phase_bytes(_q7("cuda"), 56, 17, 4)
    cpu = rehearse_memory.predicted_phase_bytes(_q7("cpu"), 56, 17, 4)
    # CUDA: the load reads in place, then the gradient buffer, then the engine's replica allocated and freed
    assert gpu["load"] == P + G + R == 18_673_367_040
    # CUDA: the gradients are offloaded before the engine wakes, so the sync adds the replica and B, less G
    assert gpu["sync"] == B == 67_108_864
    # the host: the gradient buffer (6.2 GB, built after the load) beats the read transient (the vocabulary tensor,
    # 2.2 GB at TP1); the replica is never touched; nothing is offloaded
    assert shard < G and cpu["load"] == P + G and cpu["sync"] == R + B
    # the rest does not depend on the device; the update's peak is two copies of the vocabulary gradient
    for phase in ("log-probs", "generate", "update"):
        assert gpu[phase] == cpu[phase], phase
    assert gpu["update"] == 2 * shard
    assert gpu["log-probs"] == 2 * 56 * V * 4 + 2 * 2 * 2**20  # two copies of the logits, two 2 MiB chunk buffers
    # without the update nothing is offloaded and the load holds P + R on the GPU
    no_update = rehearse_memory.predicted_phase_bytes(_q7("cuda", update=False), 56, 17, 4)
    assert (no_update["load"], no_update["sync"]) == (P + R, R + B) and "update" not in no_update


def test_plan_of_a_world_of_one_keeps_every_byte():
    assert rehearse_memory.planned_sync_bytes(_q7("cuda")) == [{"received": 0, "kept": 4 * PARAMS_2_LAYERS}]


def test_from_recipe_carries_the_device(tmp_path):
    r = rehearse.from_recipe(RECIPE, layers=2, world=1, preset="qwen2.5-7b", update=True, rollout=True)
    assert r.device == "cpu" and (r.world, r.tp, r.pp, r.ep) == (1, 1, 1, 1)
    with pytest.raises(ConfigError, match="unknown rehearsal device 'tpu'"):
        rehearse.from_recipe(RECIPE, layers=2, world=1, preset="qwen2.5-7b", rollout=True, device="tpu")


def _cli(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megarl.cli.main", "rehearse", str(RECIPE), "--preset", "qwen2.5-7b",
                           "--workdir", str(tmp_path / "work"), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=tmp_path)


def test_command_line_device_reaches_the_rehearsal(tmp_path):
    done = _cli("--device", "mps", tmp_path=tmp_path)
    assert done.returncode == 2 and "unknown rehearsal device 'mps'; known: ['cpu', 'cuda']" in done.stderr, done


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")
def test_command_line_cuda_without_a_gpu_is_refused_before_anything_is_written(tmp_path):
    done = _cli("--device", "cuda", "--world", "1", tmp_path=tmp_path)
    assert done.returncode == 2, done
    assert "a rehearsal on cuda needs a GPU per rank, 1 for --world 1; this machine has 0" in done.stderr
    assert "--device cpu" in done.stderr and not (tmp_path / "work").exists()
