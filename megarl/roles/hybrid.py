"""The hybrid engine: a policy worker trains with Megatron and generates with a colocated rollout engine.

A rollout phase is three steps, each called on every rank of the policy's world together:

1. :meth:`HybridRollout.to_rollout` (train -> rollout, the weight sync): (GPU) offload gradients and
   optimizer state; wake the rollout engine; stream the Megatron shards into it bucket by bucket along
   a :mod:`megarl.resharding` plan (no full model copy is ever assembled besides the rollout engine's
   own weights); (GPU) offload the training params. A LoRA policy streams its merged weights, or with
   ``rollout.engine.lora_sync=adapter`` (vLLM) its base weights once and then the adapter alone
   (:mod:`megarl.roles.adapter_sync`).
2. :meth:`HybridRollout.generate`, any number of times (training samples, a greedy baseline, an
   evaluation set): each rollout replica generates its contiguous share of this data-parallel rank's
   prompts (replicas are the micro-DP groups of the plan; sampling seed offset by the replica index);
   the replicas' outputs are gathered over the data-parallel rank's ranks (its model-parallel group, then its
   context-parallel ranks, which hold the same weights and prompts) in replica order.
3. :meth:`HybridRollout.to_train` (rollout -> train): the rollout engine sleeps (weights and cache
   freed where the platform allows); training state reloads.

Owns the rollout engine and the plan; does not know about losses or the trainer.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
import torch.distributed as dist

from megarl.controller.role import WorkerContext
from megarl.engine.config import LoRAConfig
from megarl.engine.engine import MegatronEngine
from megarl.errors import ConfigError
from megarl.metrics import trace
from megarl.models.spec import ModelSpec
from megarl.resharding.plan import Grouping, ReshardPlan, check_vllm_groups, make_plan
from megarl.resharding.stats import TransferStats
from megarl.resharding.transport import stream_weights
from megarl.roles.adapter_sync import AdapterSync, adapter_bytes, streamed_weights
from megarl.roles.results import WeightSync
from megarl.rollout.base import RolloutOutput, SamplingParams
from megarl.rollout.config import LoRASync, RolloutBackend, RolloutConfig

log = logging.getLogger(__name__)


class HybridRollout:
    def __init__(self, ctx: WorkerContext, spec: ModelSpec, hf_config: dict, engine: MegatronEngine,
                 config: RolloutConfig, pad_token_id: int, *, seed: int = 0) -> None:
        self.ctx, self.spec, self.engine, self.config = ctx, spec, engine, config
        self.dtype = getattr(torch, config.dtype.resolve(cuda=torch.cuda.is_available()).value)
        # vLLM's TP groups are consecutive ranks, and its loaders take checkpoint-format (full-shape) tensors,
        # of which each rank receives only the slice it keeps
        self.full_tensors = config.backend is RolloutBackend.VLLM
        self.plan = make_plan(spec, ctx.layout, config.tp, grouping=Grouping.CONSECUTIVE if self.full_tensors else None)
        self.place = self.plan.places[ctx.rank]
        # adapter-only LoRA sync: the base weights once, then the adapter alone (megarl.roles.adapter_sync)
        self.adapter = AdapterSync(engine, spec) if config.lora_sync is LoRASync.ADAPTER else None
        self.rollout = build_engine(config, hf_config, self.dtype, pad_token_id, ctx, self.plan.tp_group(ctx.rank),
                                    seed, record_routing=engine.config.router_replay,
                                    lora=engine.lora if self.adapter is not None else None)
        self.rollout.sleep()
        self.last_transfer = TransferStats()  # this rank's traffic in the latest weight sync
        self.version = 0  # of the weights the engine holds (the driver numbers them)

    # ------------------------------------------------------------------------------- transitions

    @trace.spanned("to_rollout", cat="weight_sync")
    def to_rollout(self, version: int = 0) -> WeightSync:
        """Train -> rollout: offload training state (GPU), stream weights into the woken rollout engine; they
        are ``version`` from now."""
        start = time.perf_counter()
        offload = self._offload_train_state()
        if offload:
            self.engine.offload(params=False, grads=True, optimizer=True)
        self.rollout.wake_up()
        stats = TransferStats()
        base_held = self.adapter is not None and self.rollout.holds_base_weights  # (only vLLM engines hold a base)
        params = streamed_weights(self.engine, self.adapter, base_held)
        if params is not None:
            for bucket in stream_weights(self.plan, self.spec, params, rank=self.ctx.rank, dtype=self.dtype,
                                         bucket_bytes=int(self.config.bucket_mb * 2**20), stats=stats,
                                         full_tensors=self.full_tensors, buffer=self.rollout.weight_buffer):
                self.rollout.update_weights(bucket)
                bucket.clear()  # drop the shards as soon as the engine has copied them
            self.rollout.finish_weight_update()
        if self.adapter is not None:
            factors = self.adapter.gather()
            self.rollout.load_adapter(self.adapter.peft(factors), version)
            stats.adapter_bytes = adapter_bytes(factors)
        self.version = version
        if offload:
            self.engine.offload(params=True, grads=False, optimizer=False)
        self.last_transfer = stats
        return WeightSync(transfer=stats, seconds=time.perf_counter() - start,
                          sleep_frees_memory=self.rollout.sleep_frees_memory)

    @trace.spanned("to_train", cat="weight_sync")
    def to_train(self) -> float:
        """Rollout -> train: the rollout engine sleeps, training state returns; its seconds."""
        start = time.perf_counter()
        self.rollout.sleep()
        if self._offload_train_state():
            self.engine.reload()
        return time.perf_counter() - start

    def _offload_train_state(self) -> bool:
        configured = self.config.offload_train_state
        return configured if configured is not None else self.ctx.device.startswith("cuda")

    # -------------------------------------------------------------------------------- generation

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> tuple[list[RolloutOutput], dict]:
        """All replicas' outputs of this DP rank's prompts (same on every rank of the DP rank),
        and metrics. Between :meth:`to_rollout` and :meth:`to_train`; every rank of the world calls it."""
        per_group, local = _local_replica(self.plan, self.ctx.rank)
        lo, hi = _share(len(prompts), per_group, local)
        start = time.perf_counter()
        mine = None
        if hi > lo:  # every rank of a rollout TP group takes part (vLLM); rank 0's output stands for the group
            seed = None if params.seed is None else params.seed + 1_000_003 * self.place.replica
            with trace.span("generate", cat="rollout", prompts=hi - lo, n=params.n):
                out = self.rollout.generate(prompts[lo:hi], dataclasses.replace(params, seed=seed))
            if self.place.tp_rank == 0:
                out.prompt_index += lo
                mine = out
        metrics = {"timing/generate_s": time.perf_counter() - start}
        gathered = _all_gather(self.engine.groups.mp, (local, mine))
        if self.ctx.layout.cp > 1:  # the context-parallel ranks' replicas generate from the same prompts
            gathered = [g for part in _all_gather(self.engine.groups.cp, gathered) for g in part]
        ordered = [out for _, out in sorted((g for g in gathered if g[1] is not None), key=lambda g: g[0])]
        return ordered, metrics


def _all_gather(group: dist.ProcessGroup, obj: object) -> list:
    """``obj`` of every rank of ``group``, in group rank order (collective over it)."""
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def _local_replica(plan: ReshardPlan, rank: int) -> tuple[int, int]:
    """(rollout replicas inside ``rank``'s data-parallel replica, the index of ``rank``'s among them)."""
    dp = plan.train.coords(rank).dp
    mine = sorted({p.replica for r, p in enumerate(plan.places) if plan.train.coords(r).dp == dp})
    return len(mine), mine.index(plan.places[rank].replica)


def _share(n: int, parts: int, index: int) -> tuple[int, int]:
    """Contiguous share ``index`` of ``n`` items over ``parts`` (sizes differ by at most one)."""
    base, extra = divmod(n, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (index < extra)


def build_engine(config: RolloutConfig, hf_config: dict, dtype: torch.dtype, pad_token_id: int, ctx: WorkerContext,
                  tp_group: list[int], seed: int, *, record_routing: bool = False, lora: LoRAConfig | None = None):
    """The rollout engine of this rank; ``tp_group``: the ranks of its rollout replica (in ``ctx``'s world).
    ``record_routing``: the policy replays the rollout's MoE routing, so vLLM must return it (the embedded engine
    records it for every MoE model). ``lora``: the policy's adapters, for adapter-only sync (vLLM only)."""
    if lora is not None and config.backend is not RolloutBackend.VLLM:
        raise ConfigError(f"rollout.engine.lora_sync=adapter loads the policy's adapter into vLLM's LoRA support; the "
                          f"{config.backend.value} engine has none: set rollout.engine.lora_sync=merged or "
                          "rollout.engine.backend=vllm.")
    if config.backend is RolloutBackend.EMBEDDED:
        from transformers import AutoConfig

        from megarl.rollout.embedded import EmbeddedEngine

        if config.tp != 1:
            raise ConfigError(
                f"the embedded rollout engine runs one full model per rank (rollout tp=1); found tp={config.tp}. "
                "Set rollout.engine.tp=1, or use rollout.engine.backend=vllm for tensor-parallel generation."
            )
        cfg = dict(hf_config)
        model_type = cfg.pop("model_type")
        hf = AutoConfig.for_model(model_type, **cfg)
        return EmbeddedEngine(hf, dtype=dtype, pad_token_id=pad_token_id, device=ctx.device,
                              max_batch_size=config.max_batch_size,
                              prefix_cache_bytes=int((config.prefix_cache_mb or 0) * 2**20))
    if config.backend is RolloutBackend.VLLM:
        from megarl.rollout.vllm_engine import VLLMEngine

        check_vllm_groups(ctx.layout, config.tp)  # vLLM's TP groups: the plan's CONSECUTIVE groups, in one DP replica
        kv_bytes = None if config.kv_cache_mb is None else int(config.kv_cache_mb * 2**20)
        return VLLMEngine.from_hf_config(
            hf_config, tp=config.tp, dtype=dtype,
            gpu_memory_utilization=config.memory_utilization(dedicated=False),  # resolved in a run; tests: colocated
            kv_cache_bytes=kv_bytes, seed=seed, max_model_len=config.max_model_len,
            enforce_eager=config.enforce_eager, pad_token_id=pad_token_id, expected_tp_ranks=tp_group,
            record_routing=record_routing, lora=lora)
    raise ConfigError(f"rollout backend {config.backend.value!r} is not available in this build; use 'embedded'.")
