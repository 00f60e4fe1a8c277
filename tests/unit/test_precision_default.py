"""The engines' precision and the rollout dtype default, ``auto``: bfloat16 on CUDA, float32 on CPU (issue #41:
GPU users got fp32 policies and rollouts unless they asked). Resolution both ways, for every role's engine of the
default config; the engine resolves it with the device its model is built on (models.provider: CUDA when
available)."""

from __future__ import annotations

import pytest

from megarl.config.train import FrozenEngineConfig, load_config
from megarl.engine.config import EngineConfig, Precision
from megarl.planner import memory


def _engines(cfg):
    """Every engine of a default run: the trained ones, and the frozen roles' (reward model, teacher)."""
    return {"policy": cfg.policy, "critic": cfg.critic, "frozen": FrozenEngineConfig()}


def test_every_default_engine_is_bf16_on_cuda_and_fp32_on_cpu():
    assert EngineConfig().precision is Precision.AUTO
    for role, engine in _engines(load_config(None, [])).items():
        assert engine.precision.resolve(cuda=True) is Precision.BF16, role
        assert engine.precision.resolve(cuda=False) is Precision.FP32, role  # CPU runs, tests and the demo: fp32


@pytest.mark.parametrize("value,want", [("float32", Precision.FP32), ("bfloat16", Precision.BF16)])
def test_an_explicit_precision_is_kept_on_either_device(value, want):
    cfg = load_config(None, [f"policy.precision={value}"])
    assert cfg.policy.precision.resolve(cuda=True) is want and cfg.policy.precision.resolve(cuda=False) is want


def test_the_planner_counts_auto_as_bf16():
    """The planner plans GPU runs: a policy left at auto holds 2-byte weights there, as the engine builds them."""
    assert memory.param_bytes(Precision.AUTO) == memory.param_bytes(Precision.BF16) == 2


def test_the_rollout_dtype_follows_the_same_rule():
    """The rollout weights: bfloat16 on CUDA by default (vLLM's and verl's choice for GPU rollouts), float32 on CPU,
    where the CPU tests compare rollout log-probs with the training model's within 1e-5; an explicit dtype is kept.
    The rollout roles resolve it with the device they build on (roles/hybrid.py, roles/split.py)."""
    cfg = load_config(None, [])
    assert cfg.rollout.engine.dtype is Precision.AUTO
    assert cfg.rollout.engine.dtype.resolve(cuda=True) is Precision.BF16
    assert cfg.rollout.engine.dtype.resolve(cuda=False) is Precision.FP32
    explicit = load_config(None, ["rollout.engine.dtype=float32"]).rollout.engine.dtype
    assert explicit.resolve(cuda=True) is Precision.FP32
