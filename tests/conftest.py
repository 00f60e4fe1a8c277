"""Shared fixtures: tiny random HF models written once per session (offline, no hub)."""

from __future__ import annotations

import os
import warnings

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore", message=".*(Apex|full scope).*")


def pytest_configure(config):
    """The fork server (megarl.host.forkserver) imports what the worlds need, whichever child of the session
    starts it first: a run's conversion child (tests/bench runs trainers before any world) or a world."""
    from megarl.host import forkserver
    from megarl.testing.dist import PRELOAD

    forkserver.preload(*PRELOAD)

# name -> (family, config overrides). Vocab 300 is not a multiple of 128, so padding is exercised.
TINY_MODELS = {
    "llama_gqa": ("llama", dict(num_heads=4, num_kv_heads=2)),
    "qwen2_untied": ("qwen2", dict(num_heads=4, num_kv_heads=2, tied=False)),
    "qwen2_tied": ("qwen2", dict(num_heads=4, num_kv_heads=2, tied=True)),
    "qwen3": ("qwen3", dict(num_heads=4, num_kv_heads=2)),
    "llama_rope_scaling": ("llama", dict(num_heads=4, num_kv_heads=4, rope_scaling=True)),
    "qwen3_moe": ("qwen3_moe", dict(num_heads=4, num_kv_heads=2, num_experts=4, top_k=2)),
    "qwen3_moe_topk_unnormalised": ("qwen3_moe", dict(num_heads=4, num_kv_heads=2, num_experts=8, top_k=3,
                                                      norm_topk_prob=False, num_layers=2)),
    "qwen3_moe_rm": ("qwen3_moe", dict(num_heads=4, num_kv_heads=2, num_experts=4, top_k=2, scalar_head=True,
                                       num_layers=2)),
    "llama_rm": ("llama", dict(num_heads=4, num_kv_heads=2, scalar_head=True)),
    "qwen2_rm": ("qwen2", dict(num_heads=4, num_kv_heads=2, scalar_head=True, tied=True)),
    # head_dim 32: vLLM's CPU attention has no kernel for the head_dim 16 of the models above
    "qwen2_vllm": ("qwen2", dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, tied=False)),
    "qwen2_vllm_kv4": ("qwen2", dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=4, tied=False)),
    "qwen3_moe_vllm": ("qwen3_moe", dict(hidden_size=128, num_heads=4, num_kv_heads=2, num_experts=4, top_k=2,
                                         moe_intermediate_size=64, num_layers=2)),
    "qwen2_vllm_tied": ("qwen2", dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2,
                                      tied=True, num_layers=2)),
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


# One Ray cluster for the whole test run: a head node and a second simulated node (two raylets on
# this machine, `ray.cluster_utils.Cluster`), so multi-node placement is real. Trainer tests reuse it
# (in-process) or pass its address to a `megarl train` subprocess through RAY_ADDRESS.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray 2.60 token auth: not for a local test cluster
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")  # 8 idle workers no actor uses (launch/local.sh)

HEAD_CPUS = 6  # logical CPUs: worker slots are fractional, the machine has 2 cores
WORKER_CPUS = 2


@pytest.fixture(scope="session")
def ray_cluster():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": HEAD_CPUS, "object_store_memory": 400 * 1024**2, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=WORKER_CPUS, object_store_memory=300 * 1024**2)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()
