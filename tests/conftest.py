"""Shared fixtures: tiny random HF models written once per session (offline, no hub)."""

from __future__ import annotations

import os
import warnings

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore", message=".*(Apex|full scope).*")

# name -> (family, config overrides). Vocab 300 is not a multiple of 128, so padding is exercised.
TINY_MODELS = {
    "llama_gqa": ("llama", dict(num_heads=4, num_kv_heads=2)),
    "qwen2_untied": ("qwen2", dict(num_heads=4, num_kv_heads=2, tied=False)),
    "qwen2_tied": ("qwen2", dict(num_heads=4, num_kv_heads=2, tied=True)),
    "qwen3": ("qwen3", dict(num_heads=4, num_kv_heads=2)),
    "llama_rope_scaling": ("llama", dict(num_heads=4, num_kv_heads=4, rope_scaling=True)),
    "llama_rm": ("llama", dict(num_heads=4, num_kv_heads=2, scalar_head=True)),
    "qwen2_rm": ("qwen2", dict(num_heads=4, num_kv_heads=2, scalar_head=True, tied=True)),
}


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """Factory: path of a tiny HF model directory by name (built on first use)."""
    from megarl.testing.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("tiny_hf")
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            family, kwargs = TINY_MODELS[name]
            cache[name] = make_tiny_model(root / name, family, seed=len(cache), **kwargs)
        return cache[name]

    return get
