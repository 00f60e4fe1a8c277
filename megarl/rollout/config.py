"""How the policy's rollout engine is built and fed (``rollout.engine`` in a run's YAML; pure: no engine imports)."""

from __future__ import annotations

import dataclasses
import enum
from typing import ClassVar

from megarl.engine.config import Precision

# why policy.router_replay with the vLLM backend needs rollout tp 1 (megarl.config.checks.check_config, the engine)
ROUTER_REPLAY_TP_REASON = (
    "policy.router_replay with the vLLM backend needs rollout.engine.tp=1, found tp={tp}: vLLM 0.32 keeps the routed "
    "experts on the first rank of a TP group only (vllm/distributed/aux_output_connector/worker.py), while each "
    "rank of megarl's engines (external_launcher) schedules its own requests and asserts on the missing output "
    "(vllm/v1/core/sched/scheduler.py -> aux_output_connector take_output). Set rollout.engine.tp=1 or "
    "policy.router_replay=false.")


class RolloutBackend(enum.Enum):
    EMBEDDED = "embedded"  # transformers model in the worker process (CPU default, one GPU)
    VLLM = "vllm"  # vLLM engine (its CUDA wheel on GPU clusters, its CPU build here)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    backend: RolloutBackend = RolloutBackend.EMBEDDED  # embedded: transformers in the worker; vllm: vLLM
    tp: int = 1  # rollout tensor-parallel size (the embedded engine supports 1)
    dtype: Precision = Precision.AUTO  # dtype of the rollout weights; auto: bfloat16 on CUDA, float32 on CPU
    bucket_mb: float = 64.0  # resharding bucket cap per rank
    max_batch_size: int = 64  # rows decoded at once per replica (embedded engine)
    # embedded engine: MB of finished rows' KV kept between calls for prompts that continue them (a conversation's
    # next turn); null: 1024 with rollout.multi_turn, else 0 (off). vLLM keeps its own prefix cache in kv_cache_mb
    prefix_cache_mb: float | None = None
    max_logprob_abs_diff: float | None = None  # raise when rollout and training log-probs differ more (mean |diff|)
    offload_train_state: bool | None = None  # null: offload grads/optimizer/params around rollout on GPU only
    # vLLM backend only. Share of the GPU vLLM may take (weights, activations, KV cache); on GPU at most what is
    # free when it is built; null: 0.5 beside the policy, 0.9 on a rollout pool of its own (vLLM's default: 0.92)
    gpu_memory_utilization: float | None = None
    kv_cache_mb: float | None = None  # KV cache size; null: from gpu_memory_utilization on GPU, 1 GiB on CPU
    enforce_eager: bool = False  # no CUDA graphs (faster start, slower decode)
    # prompt + response tokens; null: data.max_prompt_length + rollout.max_new_tokens (multi-turn: the model
    # config's, since an environment renders the opening prompt, which max_prompt_length does not bound)
    max_model_len: int | None = None

    COLOCATED_MEMORY_UTILIZATION: ClassVar[float] = 0.5
    DEDICATED_MEMORY_UTILIZATION: ClassVar[float] = 0.9

    def memory_utilization(self, *, dedicated: bool) -> float:
        """``gpu_memory_utilization`` as set, else decided by where the engines run (a rollout pool of their own:
        ``dedicated``)."""
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        return self.DEDICATED_MEMORY_UTILIZATION if dedicated else self.COLOCATED_MEMORY_UTILIZATION
