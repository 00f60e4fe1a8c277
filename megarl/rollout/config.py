"""How the policy's rollout engine is built and fed (``rollout.engine`` in a run's YAML; pure: no engine imports)."""

from __future__ import annotations

import dataclasses
import enum
from typing import ClassVar

from megarl.engine.config import Precision
from megarl.errors import ConfigError
from megarl.parallel.layout import Auto

# why policy.router_replay with the vLLM backend needs rollout tp 1 (megarl.config.checks.check_config, the engine)
ROUTER_REPLAY_TP_REASON = (
    "policy.router_replay with the vLLM backend needs rollout.engine.tp=1, found tp={tp}: vLLM 0.32 keeps the routed "
    "experts on the first rank of a TP group only (vllm/distributed/aux_output_connector/worker.py), while each "
    "rank of megarl's engines (external_launcher) schedules its own requests and asserts on the missing output "
    "(vllm/v1/core/sched/scheduler.py -> aux_output_connector take_output). Set rollout.engine.tp=1 or "
    "policy.router_replay=false.")


# why adapter-only sync refuses LoRA on an MoE model's experts (megarl.config.checks, megarl.trainer.checks)
ADAPTER_SYNC_EXPERTS_REASON = (
    "rollout.engine.lora_sync=adapter with policy.lora.targets {targets} on the Mixture-of-Experts model {model}: "
    "megarl's expert adapters are fused (one A for every expert's gate and up projections), a layout vLLM 0.32's "
    "fused-MoE LoRA does not load (it takes per-expert peft factors or its own 3D layout). Use "
    "rollout.engine.lora_sync=merged (the merged weights stream like a full sync), or adapt the attention only "
    "(policy.lora.targets=[qkv,proj]).")
# vLLM 0.32's max_lora_rank choices (vllm/config/lora.py MaxLoRARanks): the engine takes the least >= the policy's
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoRASync(enum.Enum):
    """How a LoRA policy's weights reach the rollout engine (``rollout.engine.lora_sync``)."""

    MERGED = "merged"  # every sync streams W + scale * B A through the resharding plan (any engine)
    # vLLM only: the base weights once, then each sync the adapter alone, loaded as a vLLM LoRA adapter
    ADAPTER = "adapter"


def check_adapter_targets(moe: bool, targets: list[str] | tuple[str, ...], model: object) -> None:
    """Refuse expert adapters (``fc1`` / ``fc2`` of an MoE model, ``moe``) for adapter-only sync
    (:data:`ADAPTER_SYNC_EXPERTS_REASON`); ``model`` names the model in the message."""
    if moe and {"fc1", "fc2"} & set(targets):
        raise ConfigError(ADAPTER_SYNC_EXPERTS_REASON.format(targets=list(targets), model=model))


def vllm_lora_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for a policy of LoRA rank ``rank``: the least of :data:`VLLM_LORA_RANKS` >= it."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ConfigError(f"policy.lora.rank={rank} exceeds vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}: "
                          "lower the rank or use rollout.engine.lora_sync=merged.")
    return fits[0]


class RolloutBackend(enum.Enum):
    EMBEDDED = "embedded"  # transformers model in the worker process (CPU default, one GPU)
    VLLM = "vllm"  # vLLM engine (its CUDA wheel on GPU clusters, its CPU build here)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    backend: RolloutBackend = RolloutBackend.EMBEDDED  # embedded: transformers in the worker; vllm: vLLM
    # rollout tensor-parallel size (the embedded engine supports 1); auto: the layout planner's, with the policy's pool
    # (docs/planner.md §13)
    tp: int | Auto = 1
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
    # a LoRA policy's sync (policy.lora): merged (W + scale * B A, every weight every sync) or adapter (vLLM only:
    # the base weights once, then the adapter alone each sync, generating with a vLLM LoRA adapter per version)
    lora_sync: LoRASync = LoRASync.MERGED

    COLOCATED_MEMORY_UTILIZATION: ClassVar[float] = 0.5
    DEDICATED_MEMORY_UTILIZATION: ClassVar[float] = 0.9

    def memory_utilization(self, *, dedicated: bool) -> float:
        """``gpu_memory_utilization`` as set, else decided by where the engines run (a rollout pool of their own:
        ``dedicated``)."""
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        return self.DEDICATED_MEMORY_UTILIZATION if dedicated else self.COLOCATED_MEMORY_UTILIZATION
