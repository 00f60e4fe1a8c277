"""What megarl gives vLLM, decided per platform: the engine arguments, the sleep/wake calls of each phase, the
per-request sampling seeds and the model directory vLLM reads.

On CUDA, vLLM 0.32 runs Model Runner V2 (``vllm/config/vllm.py``, ``use_v2_model_runner``) and has a sleep mode;
its CPU build runs the V1-derived CPU runner and cannot sleep. So the CUDA branch never runs here: every decision
takes the platform as a parameter (:class:`Platform`) and is tested on CPU against vLLM's own code (``EngineArgs``,
``CacheConfig``, ``request_memory``, the executor's sleep bookkeeping). Pure: imports no vLLM, no torch and no
process group; :mod:`megarl.rollout.vllm_engine` measures the platform and applies these decisions.

The decisions, each with the vLLM 0.32 source that forces it:

* ``disable_custom_all_reduce``: every megarl worker sees one GPU (``CUDA_VISIBLE_DEVICES`` of one entry), and
  vLLM's custom all-reduce maps each peer's local rank through ``CUDA_VISIBLE_DEVICES.split(",")[i]``
  (``distributed/device_communicators/custom_all_reduce.py`` ``_can_p2p`` ->
  ``platforms/interface.py`` ``device_id_to_physical_device_id``): an ``IndexError`` at rollout tp >= 2. NCCL
  does the all-reduce instead (what verl passes too).
* memory: vLLM's start-up check (``v1/worker/utils.py`` ``request_memory``) needs ``gpu_memory_utilization x
  total`` free when the engine is built, ``kv_cache_memory_bytes`` or not, and a colocated policy's training
  state is resident then. The utilization given to vLLM is capped at what is free (:func:`cuda_memory_args`).
* sleep level 2 (:class:`SleepCycle`): level 1 copies the weights to host memory at every sleep and back at every
  wake, and every weight sync overwrites all of them; level 2 drops them. vLLM 0.32 saves the model's buffers
  (RoPE caches) across level 2 and restores them at the weights' wake (``v1/worker/gpu_worker.py`` ``sleep`` /
  ``wake_up``), so nothing the sync does not rewrite is lost.
* adapter-only LoRA sync (``lora_rank`` set): ``enable_lora`` with ``max_loras`` 1 (one adapter version in a
  batch: the latest; ``max_cpu_loras`` 1, so vLLM's LRU cache drops the previous version when it loads the next),
  ``max_lora_rank`` the least of vLLM's choices >= the policy's rank, ``lora_target_modules`` the HF projections
  the policy adapts (vLLM wraps only those layers; ``lora/utils.py`` ``is_in_target_modules`` matches a packed
  ``qkv_proj`` by its ``q_proj``...). Sleep level 1 instead of 2 (:data:`ADAPTER_SLEEP_LEVEL`): the base weights
  are synced once and must survive the sleep (level 1 keeps them in host memory, two host copies per step; level 2
  would need the whole model streamed again at every sync, which adapter sync exists to avoid).
* explicit seeds (:func:`request_seeds`): V2's sampler gives an unseeded request a seed from NumPy's global RNG
  (``v1/worker/gpu/sample/states.py`` ``add_request``), which megarl does not own and which ranks of a TP group
  need not share; every request therefore carries a seed derived from the engine's seed.
* a content-addressed model directory (:func:`model_dir`): the model path is a factor of vLLM's compile-cache
  key (``config/model.py`` ``compute_hash``, ``compilation/backends.py``), so a fresh temporary directory per
  engine recompiled at every start.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from megarl.errors import ConfigError, MegarlError
from megarl.rollout.config import ROUTER_REPLAY_TP_REASON, vllm_lora_rank

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # vLLM's CPU default (a fraction of RAM) fails on small machines
CPU_BATCH_TOKENS = 4096  # tokens per engine step on CPU (vLLM's default there), at least max_model_len
# device memory vLLM allocates between megarl's measurement and its own start-up snapshot (its process groups'
# NCCL communicators, the CUDA context of its streams): kept out of the utilization megarl grants
CUDA_START_HEADROOM_BYTES = 1 << 30
SLEEP_LEVEL = 2  # see the module docstring
ADAPTER_SLEEP_LEVEL = 1  # adapter-only LoRA sync: the base weights, synced once, are kept (module docstring)
_SEED_BITS = 62  # a request's seed plus its children's offsets stays below 2**63 (vLLM keeps seeds as int64)


@dataclasses.dataclass(frozen=True)
class Platform:
    """The machine as the engine arguments see it: ``cuda`` (vLLM's CUDA wheel: Model Runner V2), whether vLLM
    can sleep there, and the device memory free and in total when the engine is built (CUDA only)."""

    cuda: bool
    sleep_mode: bool
    free_bytes: int = 0
    total_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """megarl's choices for one engine: :class:`megarl.rollout.vllm_engine.VLLMEngine`'s arguments (its signature
    holds the defaults)."""

    tp: int
    dtype: str  # torch's name: bfloat16, float16, float32
    gpu_memory_utilization: float  # asked for; on CUDA at most what is free at build (cuda_memory_args)
    kv_cache_bytes: int | None  # None: vLLM sizes it from the utilization (GPU), 1 GiB on CPU
    seed: int
    max_model_len: int | None  # None: the model config's max_position_embeddings
    enforce_eager: bool
    prefix_caching: bool
    record_routing: bool  # vLLM returns each token's routed experts (router replay)
    lora_rank: int | None = None  # adapter-only LoRA sync: the policy's LoRA rank (None: no LoRA in vLLM)
    lora_modules: tuple[str, ...] = ()  # the HF projections the adapter targets (peft's target_modules)

    @property
    def sleep_level(self) -> int:
        """vLLM's sleep level between rollouts (module docstring)."""
        return ADAPTER_SLEEP_LEVEL if self.lora_rank is not None else SLEEP_LEVEL

    def args(self, model: str | Path, hf_config: Mapping[str, Any], platform: Platform) -> dict[str, Any]:
        """``vllm.LLM``'s keyword arguments (each an ``EngineArgs`` field) on ``platform``, without megarl's
        worker extension and weight-transfer backend (the engine adds those)."""
        self._check(hf_config)
        if platform.cuda:
            memory = cuda_memory_args(self.gpu_memory_utilization, self.kv_cache_bytes, platform.free_bytes,
                                      platform.total_bytes)
            scheduling: dict[str, Any] = {}
        else:
            memory = {"gpu_memory_utilization": self.gpu_memory_utilization,
                      "kv_cache_memory_bytes": self.kv_cache_bytes or DEFAULT_CPU_KV_CACHE_BYTES}
            # On CPU, vLLM rewinds a seeded request's generator after a partial (chunked) prefill through
            # Generator.set_offset, which CPU generators lack ("CPU Generator does not use offset"): every request
            # is seeded (request_seeds), so a batch whose prompts exceed one step's token budget would crash.
            # Whole prefills avoid that path.
            scheduling = {"enable_chunked_prefill": False, "max_num_batched_tokens": max(
                CPU_BATCH_TOKENS, self.max_model_len or int(hf_config["max_position_embeddings"]))}
        routing = {"enable_return_routed_experts": True} if self.record_routing else {}
        lora = ({} if self.lora_rank is None else
                {"enable_lora": True, "max_loras": 1, "max_cpu_loras": 1,
                 "max_lora_rank": vllm_lora_rank(self.lora_rank), "lora_target_modules": sorted(self.lora_modules)})
        return dict(model=str(model), tensor_parallel_size=self.tp, dtype=self.dtype, seed=self.seed,
                    enforce_eager=self.enforce_eager, max_model_len=self.max_model_len,
                    distributed_executor_backend="external_launcher", enable_sleep_mode=platform.sleep_mode,
                    disable_custom_all_reduce=True,  # one visible GPU per worker (module docstring)
                    load_format="dummy", skip_tokenizer_init=True, logprobs_mode="processed_logprobs",
                    generation_config="vllm",  # ignore generation_config.json: no default top-k/eos from the model
                    enable_prefix_caching=self.prefix_caching,  # a conversation's next turn reuses its earlier ones
                    **memory, **scheduling, **routing, **lora)

    def _check(self, hf_config: Mapping[str, Any]) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1]; found {self.gpu_memory_utilization}")
        if self.record_routing and self.tp > 1:
            raise ConfigError(ROUTER_REPLAY_TP_REASON.format(tp=self.tp))
        limit = hf_config.get("max_position_embeddings")
        if self.max_model_len is not None and limit is not None and self.max_model_len > int(limit):
            raise ConfigError(f"rollout.engine.max_model_len={self.max_model_len} (prompt + response tokens) exceeds "
                              f"the model's max_position_embeddings={limit}: lower data.max_prompt_length or "
                              "rollout.max_new_tokens, or set rollout.engine.max_model_len within the model's.")


def cuda_memory_args(utilization: float, kv_cache_bytes: int | None, free: int, total: int) -> dict[str, Any]:
    """``gpu_memory_utilization`` and ``kv_cache_memory_bytes`` that pass vLLM's start-up check: it needs
    ``ceil(utilization x total)`` bytes free when the engine is built (``request_memory``), where a colocated
    policy's training state is resident. A utilization above what is free (less
    :data:`CUDA_START_HEADROOM_BYTES`) is capped there: with ``kv_cache_bytes`` it only gates the start (the
    KV cache has its size); without, vLLM sizes the KV cache from it, so it gets what is free (logged)."""
    if total <= 0:
        raise MegarlError(f"the device reports {total} bytes of memory in total; expected a CUDA device's size")
    fits = math.floor((free - CUDA_START_HEADROOM_BYTES) / total * 1000) / 1000  # ceil(fits x total) <= that
    if fits <= 0:
        raise MegarlError(f"{free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB device memory are free where the vLLM "
                          "engine is built, too little to start it; offload the training state first "
                          "(rollout.engine.offload_train_state) or give the rollout engine a pool of its own.")
    if utilization > fits and kv_cache_bytes is None:
        logger.warning("rollout.engine.gpu_memory_utilization=%.2f asks for %.1f GiB, but %.1f GiB are free where "
                       "vLLM is built (the policy's training state is resident): vLLM gets %.3f (its KV cache the "
                       "rest after its weights and activations). Set rollout.engine.kv_cache_mb for a fixed size.",
                       utilization, utilization * total / 2**30, free / 2**30, fits)
    return {"gpu_memory_utilization": min(utilization, fits), "kv_cache_memory_bytes": kv_cache_bytes}


def request_seeds(prompts: int, n: int, seed: int | None, *, engine_seed: int, group: int, call: int) -> list[int]:
    """One vLLM seed per prompt of a call; vLLM seeds child ``j`` of a request ``seed + j``, so prompts never share
    noise. ``seed`` None (an unseeded call): drawn from (engine seed, TP group leader, call count) -- fresh per
    call, equal on every rank of a TP group (they must sample the same tokens), independent of any global RNG."""
    if seed is None:
        digest = hashlib.blake2b(f"{engine_seed}/{group}/{call}".encode(), digest_size=8).digest()
        seed = int.from_bytes(digest, "little") >> (64 - _SEED_BITS)
    return [seed + i * n for i in range(prompts)]


def model_dir(hf_config: Mapping[str, Any], root: str | Path) -> Path:
    """A directory holding ``config.json`` of ``hf_config``, named by its content under ``root``: engines of one
    model share it (so vLLM's compile cache, keyed by the path, is reused), other models get their own. Written
    once, atomically (workers of one node may race), never removed (one small file per model config)."""
    text = json.dumps(dict(hf_config), indent=2, sort_keys=True)
    path = Path(root) / hashlib.sha256(text.encode()).hexdigest()[:16]
    config = path / "config.json"
    if not config.is_file() or config.read_text() != text:
        path.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path, prefix=".config-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, config)
    return path


class Sleeper(Protocol):
    """What :class:`SleepCycle` calls: ``vllm.LLM``'s sleep mode."""

    def sleep(self, level: int = ...) -> Any: ...

    def wake_up(self, tags: list[str] | None = ...) -> Any: ...


class SleepCycle:
    """Which of an engine's weights and KV cache are resident, and the vLLM calls that change it where vLLM can
    sleep (``frees_memory``; elsewhere only the state changes). A step on CUDA is ``sleep`` (``level`` 2: weights and
    KV cache dropped, nothing copied to the host; 1: the weights kept in host memory), ``wake_weights`` before the
    sync (memory mapped back; the sync writes every weight, or with level 1 the adapter), ``wake_kv`` at the first
    generation after it (so the sync never holds KV memory, vllm#15254). A KV cache still asleep at the next ``sleep``
    stays asleep: vLLM 0.32 skips sleeping allocations (``device_allocator/cumem.py`` ``sleep``)."""

    def __init__(self, llm: Sleeper, frees_memory: bool, level: int = SLEEP_LEVEL) -> None:
        self._llm, self.frees_memory, self.level = llm, frees_memory, level
        self.weights_awake = self.kv_awake = True  # a fresh engine holds dummy weights and its KV cache

    @property
    def keeps_weights(self) -> bool:
        """Whether the weights survive a sleep (no sleep mode here, or level 1)."""
        return not self.frees_memory or self.level == 1

    def sleep(self) -> None:
        if not self.weights_awake:
            return
        if self.frees_memory:
            self._llm.sleep(level=self.level)
        self.weights_awake = self.kv_awake = False

    def wake_weights(self) -> None:
        if not self.weights_awake:
            if self.frees_memory:
                self._llm.wake_up(tags=["weights"])
            self.weights_awake = True

    def wake_kv(self) -> None:
        if not self.kv_awake:
            if self.frees_memory:
                self._llm.wake_up(tags=["kv_cache"])
            self.kv_awake = True
