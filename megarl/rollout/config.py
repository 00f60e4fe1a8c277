"""How the policy's rollout engine is built and fed (``rollout.engine`` in a run's YAML; pure: no engine imports)."""

from __future__ import annotations

import dataclasses
import enum

from megarl.engine.config import Precision


class RolloutBackend(enum.Enum):
    EMBEDDED = "embedded"  # transformers model in the worker process (CPU default, one GPU)
    VLLM = "vllm"  # vLLM engine (its CUDA wheel on GPU clusters, its CPU build here)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    backend: RolloutBackend = RolloutBackend.EMBEDDED  # embedded: transformers in the worker; vllm: vLLM
    tp: int = 1  # rollout tensor-parallel size (the embedded engine supports 1)
    dtype: Precision = Precision.FP32  # dtype of the rollout weights (bfloat16 on GPU)
    bucket_mb: float = 64.0  # resharding bucket cap per rank
    max_batch_size: int = 64  # rows decoded at once per replica (embedded engine)
    # embedded engine: MB of finished rows' KV kept between calls for prompts that continue them (a conversation's
    # next turn); null: 1024 with rollout.multi_turn, else 0 (off). vLLM keeps its own prefix cache in kv_cache_mb
    prefix_cache_mb: float | None = None
    max_logprob_abs_diff: float | None = None  # raise when rollout and training log-probs differ more (mean |diff|)
    offload_train_state: bool | None = None  # null: offload grads/optimizer/params around rollout on GPU only
    # vLLM backend only
    gpu_memory_utilization: float = 0.5  # share of the GPU vLLM may take (weights + KV cache), free at build time
    kv_cache_mb: float | None = None  # KV cache size; null: from gpu_memory_utilization on GPU, 1 GiB on CPU
    enforce_eager: bool = False  # no CUDA graphs (faster start, slower decode)
    max_model_len: int | None = None  # prompt + response tokens; null: the model config's
