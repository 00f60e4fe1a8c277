"""What megarl gives vLLM on CUDA, checked on CPU against vLLM's own code (megarl.rollout.vllm_args).

vLLM's CPU build never runs the CUDA branch (Model Runner V2, sleep mode, custom all-reduce, the start-up memory
check), so these tests build the CUDA arguments and calls from a stated platform and hand them to the vLLM classes
that judge them here: ``EngineArgs`` (every key a field), ``CacheConfig`` + ``request_memory`` (the start-up
check), the executor's sleep bookkeeping (``Executor.sleep`` / ``wake_up``; only the worker RPC is recorded, since
no CPU worker can sleep), ``ModelConfig.compute_hash`` (the compile-cache key) and the platform's device-id
mapping (the custom all-reduce's ``IndexError``). No process group; ~25 s, most of it importing vLLM.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make install brings its CPU build)")

from megarl.config.checks import check_config  # noqa: E402
from megarl.config.resolve import resolve  # noqa: E402
from megarl.config.train import load_config  # noqa: E402
from megarl.errors import ConfigError, MegarlError  # noqa: E402
from megarl.rollout.base import SamplingParams  # noqa: E402
from megarl.rollout.config import RolloutConfig  # noqa: E402
from megarl.rollout.vllm_args import (  # noqa: E402
    CUDA_START_HEADROOM_BYTES,
    DEFAULT_CPU_KV_CACHE_BYTES,
    EngineOptions,
    Platform,
    SleepCycle,
    cuda_memory_args,
    model_dir,
    request_seeds,
)
from megarl.rollout.vllm_engine import sampling_params  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GiB = 1 << 30
HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 128,
      "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "torch_dtype": "float32"}
H200 = Platform(cuda=True, sleep_mode=True, free_bytes=139 * GiB, total_bytes=140 * GiB)


def _options(**kw) -> EngineOptions:
    base = dict(tp=1, dtype="bfloat16", gpu_memory_utilization=0.5, kv_cache_bytes=None, seed=0, max_model_len=48,
                enforce_eager=False, prefix_caching=True, record_routing=False)
    return EngineOptions(**(base | kw))


def _engine_args(args: dict):
    """vLLM's own judgement of the keys: EngineArgs is a dataclass, so an unknown key is a TypeError."""
    return vllm.EngineArgs(**args, worker_extension_cls="megarl.rollout.vllm_engine.WeightReceiver",
                           weight_transfer_config={"backend": "megarl_in_process"})


def test_cuda_args_at_tp2_turn_off_the_custom_all_reduce_that_cannot_map_one_visible_gpu(monkeypatch, tmp_path):
    from vllm.platforms.interface import Platform as VllmPlatform

    args = _options(tp=2, max_model_len=64).args(model_dir(HF, tmp_path), HF, H200)
    engine_args = _engine_args(args)
    assert engine_args.tensor_parallel_size == 2 and engine_args.disable_custom_all_reduce is True
    assert engine_args.distributed_executor_backend == "external_launcher" and engine_args.enable_sleep_mode
    assert "enable_chunked_prefill" not in args  # the CPU-only scheduling stays off CUDA

    # why: a megarl worker sees one GPU, and the all-reduce's peer check (custom_all_reduce.py _can_p2p) maps the
    # peer's local rank 1 through CUDA_VISIBLE_DEVICES -- vLLM's own mapping, on the CUDA platform's variable
    class Cuda(VllmPlatform):
        device_control_env_var = "CUDA_VISIBLE_DEVICES"

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert Cuda.logical_device_id_to_visible_device_id(0) == 0
    with pytest.raises(IndexError):
        Cuda.logical_device_id_to_visible_device_id(1)


def test_cpu_args_keep_the_cpu_build_running(tmp_path):
    args = _options(dtype="float32").args(model_dir(HF, tmp_path), HF, Platform(cuda=False, sleep_mode=False))
    engine_args = _engine_args(args)
    assert engine_args.kv_cache_memory_bytes == DEFAULT_CPU_KV_CACHE_BYTES and not engine_args.enable_sleep_mode
    assert engine_args.enable_chunked_prefill is False and engine_args.max_num_batched_tokens == 4096


@pytest.mark.parametrize("utilization, kv_bytes", [(0.5, None), (0.5, 8 * GiB), (0.9, None)])
def test_memory_args_pass_vllms_startup_check_beside_a_resident_policy(utilization, kv_bytes):
    """A colocated policy's state leaves 28 of 80 GiB free; vLLM's check (v1/worker/utils.py request_memory) needs
    ceil(utilization x total) free at its snapshot, taken after its own communicators (the headroom)."""
    from vllm.config import CacheConfig
    from vllm.utils.mem_utils import MemorySnapshot
    from vllm.v1.worker.utils import request_memory

    total, free = 80 * GiB, 28 * GiB
    at_vllm_snapshot = MemorySnapshot(free_memory=free - CUDA_START_HEADROOM_BYTES, total_memory=total,
                                      device="cpu", auto_measure=False)
    asked = CacheConfig(gpu_memory_utilization=utilization, kv_cache_memory_bytes=kv_bytes)
    with pytest.raises(ValueError, match="Free memory on device"):  # what the unmodified request meets
        request_memory(at_vllm_snapshot, asked)
    args = cuda_memory_args(utilization, kv_bytes, free, total)
    granted = CacheConfig(**args)
    assert request_memory(at_vllm_snapshot, granted) <= free - CUDA_START_HEADROOM_BYTES
    assert granted.kv_cache_memory_bytes == kv_bytes  # a fixed KV cache keeps its size
    assert 27 / 80 - 0.001 <= granted.gpu_memory_utilization <= 27 / 80  # all that is free, no more


def test_memory_args_keep_what_fits_and_refuse_a_full_device():
    assert cuda_memory_args(0.9, None, 139 * GiB, 140 * GiB)["gpu_memory_utilization"] == 0.9  # a rollout pool
    with pytest.raises(MegarlError, match=r"0\.5 GiB of 80\.0 GiB .* too little"):
        cuda_memory_args(0.5, None, GiB // 2, 80 * GiB)


def test_every_request_carries_a_seed_megarl_derives():
    """V2's sampler seeds an unseeded request from NumPy's global RNG (v1/worker/gpu/sample/states.py
    add_request); megarl's requests are never unseeded, and their seeds follow from the engine's seed alone."""
    np.random.seed(0)
    torch.manual_seed(0)
    first = request_seeds(3, 4, None, engine_seed=7, group=0, call=1)
    np.random.seed(1)
    random.seed(1)
    torch.manual_seed(1)
    assert request_seeds(3, 4, None, engine_seed=7, group=0, call=1) == first  # every rank of the group agrees
    assert [b - a for a, b in zip(first, first[1:], strict=False)] == [4, 4]  # children seed + j never overlap
    others = [request_seeds(3, 4, None, engine_seed=7, group=0, call=2),  # next call
              request_seeds(3, 4, None, engine_seed=7, group=2, call=1),  # another rollout replica
              request_seeds(3, 4, None, engine_seed=8, group=0, call=1)]  # another run seed
    assert all(abs(o[0] - first[0]) > 1000 for o in others)
    assert request_seeds(3, 4, 10, engine_seed=7, group=0, call=1) == [10, 14, 18]  # a seeded call as given
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=8)
    requests = [sampling_params(vllm, params, s) for s in first]
    assert [r.seed for r in requests] == first and all(s >= 0 and s + 3 < 2**63 for s in first)  # V2: int64


class _Workers:
    """vLLM's executor with its sleep bookkeeping (v1/executor/abstract.py Executor.sleep / wake_up) as it is; only
    what reaches the workers is recorded, where a CUDA worker would sleep (CuMemAllocator) and a CPU one cannot."""

    def __init__(self):
        from vllm.v1.executor.abstract import Executor

        class Recorded(Executor):
            def _init_executor(self):
                pass

            def check_health(self):
                pass

            def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False):
                self.calls.append((method, kwargs))
                return [None]

        self.executor = Recorded.__new__(Recorded)
        self.executor.sleeping_tags, self.executor.calls = set(), []

    def sleep(self, level=1):
        self.executor.sleep(level)

    def wake_up(self, tags=None):
        self.executor.wake_up(tags)


def test_a_cuda_step_drops_the_weights_it_rewrites_and_wakes_kv_after_the_sync():
    from vllm.v1.executor.abstract import SLEEP_TAGS

    workers = _Workers()
    cycle = SleepCycle(workers, frees_memory=True)
    cycle.sleep()  # after the build: nothing to keep (dummy weights)
    cycle.wake_weights()  # to_rollout: the sync writes every weight
    cycle.wake_kv()  # the first generation
    cycle.sleep()  # to_train
    cycle.wake_weights()  # a sync with no generation after it (e.g. a DAPO round's last)
    cycle.sleep()
    drop, weights, kv = ("sleep", {"level": 2}), ("wake_up", {"tags": ["weights"]}), ("wake_up", {"tags": ["kv_cache"]})
    assert workers.executor.calls == [drop, weights, kv, drop, weights, drop]  # level 1 would copy weights both ways
    assert workers.executor.sleeping_tags == SLEEP_TAGS  # every call reached the workers and all is asleep again
    cpu = _Workers()
    cpu_cycle = SleepCycle(cpu, frees_memory=False)
    cpu_cycle.sleep(), cpu_cycle.wake_weights(), cpu_cycle.wake_kv(), cpu_cycle.sleep()
    assert cpu.executor.calls == [] and not cpu_cycle.weights_awake


def test_adapter_sync_gives_vllm_one_lora_slot_and_keeps_the_base_through_sleep(tmp_path):
    """rollout.engine.lora_sync=adapter: vLLM's LoRA for the policy's rank and projections (its own LoRAConfig judges
    them), one adapter resident (the latest version), and sleep level 1 on CUDA, so the base weights synced once
    survive each sleep (level 2 would drop them and every sync would stream the whole model again)."""
    from vllm.config import LoRAConfig

    modules = ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
    options = _options(lora_rank=4, lora_modules=modules)
    args = options.args(model_dir(HF, tmp_path), HF, H200)
    engine_args = _engine_args(args)
    assert engine_args.enable_lora and engine_args.max_lora_rank == 8 and engine_args.max_loras == 1
    lora = LoRAConfig(max_lora_rank=args["max_lora_rank"], max_loras=args["max_loras"],
                      max_cpu_loras=args["max_cpu_loras"], target_modules=args["lora_target_modules"])
    assert lora.max_cpu_loras == 1 and lora.target_modules == list(modules)
    assert "enable_lora" not in _options().args(model_dir(HF, tmp_path), HF, H200)
    assert _options(lora_rank=9, lora_modules=modules).args(model_dir(HF, tmp_path), HF, H200)["max_lora_rank"] == 16
    workers = _Workers()
    cycle = SleepCycle(workers, frees_memory=True, level=options.sleep_level)
    cycle.sleep(), cycle.wake_weights(), cycle.wake_kv(), cycle.sleep()
    assert workers.executor.calls[0] == ("sleep", {"level": 1}) and cycle.keeps_weights
    assert not SleepCycle(_Workers(), frees_memory=True, level=_options().sleep_level).keeps_weights
    assert SleepCycle(_Workers(), frees_memory=False).keeps_weights  # CPU: nothing is ever dropped


def test_one_model_one_directory_so_vllms_compile_cache_is_reused(tmp_path):
    from vllm.config import ModelConfig

    first, again = model_dir(HF, tmp_path), model_dir(dict(reversed(list(HF.items()))), tmp_path)
    other = model_dir(HF | {"num_hidden_layers": 3}, tmp_path)
    assert first == again != other and json.loads((first / "config.json").read_text()) == HF
    # vLLM's key: the model's path is a factor of ModelConfig.compute_hash (config/model.py), hence of the compile
    # cache directory (compilation/backends.py); two directories of one config.json key differently
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "config.json").write_text((first / "config.json").read_text())

    def key(path):
        return ModelConfig(model=str(path), tokenizer=str(path), skip_tokenizer_init=True, dtype="float32",
                           seed=0).compute_hash()

    assert key(first) == key(model_dir(HF, tmp_path)) != key(copy)


def test_router_replay_at_rollout_tp2_is_refused_with_the_fix(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1="}\n')
    base = [f"model.path={tmp_path}", f"data.train={tmp_path / 'train.jsonl'}", "policy.router_replay=true"]
    example = ROOT / "examples" / "grpo_addition_tiny_vllm" / "config.yaml"  # vLLM at rollout tp 2
    with pytest.raises(ConfigError, match=r"tp=2: vLLM 0\.32 keeps .* rollout\.engine\.tp=1 or policy\.router_replay"):
        check_config(load_config(example, base))
    check_config(load_config(example, [*base, "rollout.engine.tp=1"]))
    with pytest.raises(ConfigError, match="first rank of a TP group"):  # an engine built without check_config
        _options(tp=2, record_routing=True).args("/m", HF, H200)


def test_resolved_gpu_defaults():
    example = ROOT / "examples" / "grpo_addition_tiny" / "config.yaml"  # max_prompt_length 8, max_new_tokens 1
    colocated = resolve(load_config(example, ["rollout.engine.backend=vllm"])).rollout.engine
    assert (colocated.gpu_memory_utilization, colocated.max_model_len) == (0.5, 9)
    apart = resolve(load_config(example, ["rollout.engine.backend=vllm", "cluster.pools.gen.devices_per_node=2",
                                          "cluster.placement.rollout=gen", "rollout.max_new_tokens=20"])).rollout
    assert (apart.engine.gpu_memory_utilization, apart.engine.max_model_len) == (0.9, 28)
    given = resolve(load_config(example, ["rollout.engine.backend=vllm", "rollout.engine.max_model_len=16",
                                          "rollout.engine.gpu_memory_utilization=0.3"])).rollout.engine
    assert (given.gpu_memory_utilization, given.max_model_len) == (0.3, 16)
    assert RolloutConfig().memory_utilization(dedicated=False) == 0.5
    with pytest.raises(ConfigError, match="max_model_len=65 .* max_position_embeddings=64"):
        _options(max_model_len=65).args("/m", HF, H200)
