"""Split placement: rollout engines on a pool of their own, fed by the policy's training ranks.

Two halves of one weight sync, called together (the driver starts both, then waits for both):

* :class:`WeightSender`, inside the policy's ranks: walks the resharding plan of a split placement
  (:func:`megarl.resharding.plan.make_plan` with ``rollout_ranks``) and sends its Megatron shards' slabs,
  bucket by bucket, over the :class:`~megarl.resharding.link.WeightLink` that joins both pools;
* :class:`RolloutRole`, the role of the rollout pool: receives its rollout shard bucket by bucket into its
  engine (the same plan, the same buckets), then generates for its data-parallel share of the prompts.
  Each rollout replica is one data-parallel rank of its pool (``tp`` = the rollout tensor-parallel size).

The engines never sleep (they own their devices) and the training state never leaves the training devices. With
``rollout.engine.lora_sync=adapter`` the first push streams the LoRA policy's base weights, and every push then
sends the adapter alone: gathered on the training side, sent by training rank 0 to every rollout rank over the link
(:mod:`megarl.roles.adapter_sync`), loaded as a vLLM LoRA adapter of its own.
Every row a rollout replica generates carries ``policy_version``: the version of the weights it holds (the
driver numbers them: the number of policy updates behind them).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from megarl.controller.role import Role, WorkerContext
from megarl.controller.spec import Timeouts
from megarl.data.batch import Batch, prompt_lists
from megarl.engine.config import LoRAConfig
from megarl.engine.engine import MegatronEngine
from megarl.errors import ConfigError
from megarl.metrics import trace
from megarl.metrics.memory import peaks, reset_peaks
from megarl.models import adapters
from megarl.models.spec import ModelSpec, spec_from_hf_config
from megarl.parallel.layout import ParallelLayout
from megarl.resharding import link as weight_link
from megarl.resharding.plan import ReshardPlan, make_plan
from megarl.resharding.stats import TransferStats
from megarl.resharding.transport import stream_weights
from megarl.roles.adapter_sync import AdapterSync, adapter_bytes, receive_adapter, send_adapter, streamed_weights
from megarl.roles.hybrid import build_engine
from megarl.roles.results import WeightSync
from megarl.rollout.base import FINISH_STOP, SamplingParams
from megarl.rollout.config import LoRASync, RolloutBackend, RolloutConfig, check_adapter_targets
from megarl.rollout.rows import generation_rows


def split_plan(spec: ModelSpec, train: ParallelLayout, config: RolloutConfig, rollout_ranks: int) -> ReshardPlan:
    """The plan both pools walk (every rank computes the same one)."""
    return make_plan(spec, train, config.tp, rollout_ranks=rollout_ranks)


def _full_tensors(config: RolloutConfig) -> bool:
    """vLLM's loaders take checkpoint-format (full-shape) tensors, of which each rank receives its slice."""
    return config.backend is RolloutBackend.VLLM


class _LinkMember:
    """A rank's membership of the weight link: rank 0 of the training side opens it, everyone joins."""

    def __init__(self) -> None:
        self._store = None
        self.link: weight_link.WeightLink | None = None

    def open(self, host: str, timeouts: Timeouts) -> tuple[str, int]:
        self._store, port = weight_link.listen(host, timeouts.init_s)
        return host, port

    def join(self, host: str, port: int, rank: int, size: int, device: str, timeouts: Timeouts) -> None:
        self.link = weight_link.WeightLink(host, port, rank, size, device=device, init_timeout_s=timeouts.init_s,
                                           collective_timeout_s=timeouts.collective_s, store=self._store)

    def get(self) -> weight_link.WeightLink:
        if self.link is None:
            raise RuntimeError("the weight link is not joined yet: the driver joins both pools first")
        return self.link


class WeightSender:
    """The policy ranks' half of a split weight sync."""

    def __init__(self, ctx: WorkerContext, spec: ModelSpec, engine: MegatronEngine, config: RolloutConfig,
                 rollout_ranks: int) -> None:
        self.ctx, self.spec, self.engine, self.config = ctx, spec, engine, config
        self.plan = split_plan(spec, ctx.layout, config, rollout_ranks)
        self.dtype = getattr(torch, config.dtype.resolve(cuda=torch.cuda.is_available()).value)
        self.member = _LinkMember()
        self.last_transfer = TransferStats()
        # adapter-only LoRA sync: the base weights with the first push, then the adapter alone
        self.adapter = AdapterSync(engine, spec) if config.lora_sync is LoRASync.ADAPTER else None
        self._base_sent = False  # the rollout engines hold the base weights (they never sleep on their own pool)

    @property
    def link_size(self) -> int:
        return len(self.plan.places)

    @trace.spanned("push_weights", cat="weight_sync")
    def push(self) -> WeightSync:
        start = time.perf_counter()
        stats = TransferStats()
        params = streamed_weights(self.engine, self.adapter, self._base_sent)
        if params is not None:
            for bucket in stream_weights(self.plan, self.spec, params, rank=self.ctx.rank, dtype=self.dtype,
                                         bucket_bytes=int(self.config.bucket_mb * 2**20), stats=stats,
                                         link=self.member.get(), full_tensors=_full_tensors(self.config)):
                assert not bucket, "a training rank of a split plan holds no rollout shard"
        if self.adapter is not None:
            self._base_sent = True
            factors = self.adapter.gather()
            if self.ctx.rank == 0:  # one sender: every training replica holds the same adapter
                shapes = adapters.factor_shapes(self.spec, self.adapter.lora.targets, self.adapter.lora.rank)
                send_adapter(self.member.get(), factors, shapes, self.dtype, self.ctx.device,
                             range(self.ctx.world_size, self.link_size))
            stats.adapter_bytes = adapter_bytes(factors)
        self.last_transfer = stats
        return WeightSync(transfer=stats, seconds=time.perf_counter() - start, sleep_frees_memory=False)


class RolloutRole(Role):
    """Rollout engines on a pool of their own (one replica per data-parallel rank of the pool)."""

    def __init__(self, ctx: WorkerContext, *, hf_config: dict, train_layout: ParallelLayout, rollout: RolloutConfig,
                 seed: int = 0, record_routing: bool = False, lora: LoRAConfig | None = None) -> None:
        """``lora``: the policy's adapters (``policy.lora``), which adapter-only sync loads into the engine."""
        super().__init__(ctx)
        if ctx.layout.pp != 1 or ctx.layout.cp != 1 or ctx.layout.tp != rollout.tp:
            raise ConfigError(f"a rollout pool's layout must be tp=rollout.engine.tp={rollout.tp}, pp=1, cp=1 (one "
                              f"rollout replica per data-parallel rank); found {ctx.layout}.")
        self.spec = spec_from_hf_config(hf_config)
        self.config = rollout
        self.plan = split_plan(self.spec, train_layout, rollout, ctx.world_size)
        self.link_rank = train_layout.world_size + ctx.rank
        self.place = self.plan.places[self.link_rank]
        self.dtype = getattr(torch, rollout.dtype.resolve(cuda=torch.cuda.is_available()).value)
        pad = self.spec.pad_token_id if self.spec.pad_token_id is not None else 0
        t = train_layout.world_size  # link rank = t + this pool's rank
        self.lora = lora if rollout.lora_sync is LoRASync.ADAPTER else None
        if rollout.lora_sync is LoRASync.ADAPTER:
            if lora is None:
                raise ConfigError("rollout.engine.lora_sync=adapter loads the policy's adapter, but the rollout pool "
                                  "was given none (policy.lora is null): set policy.lora or lora_sync=merged.")
            check_adapter_targets(self.spec.moe is not None, lora.targets, "the policy")
            self.shapes = adapters.factor_shapes(self.spec, lora.targets, lora.rank)
        self.engine = build_engine(rollout, hf_config, self.dtype, pad, ctx,
                                   [r - t for r in self.plan.tp_group(self.link_rank)], seed,
                                   record_routing=record_routing, lora=self.lora)
        self.member = _LinkMember()
        self.version: int | None = None  # of the weights the engine holds; None before the first sync

    def close(self) -> None:
        self.engine.close()

    def join_weight_link(self, host: str, port: int, size: int, timeouts: Timeouts) -> None:
        """Collective with the policy's :meth:`~megarl.roles.policy.PolicyRole.join_weight_link`."""
        self.member.join(host, port, self.link_rank, size, self.ctx.device, timeouts)

    def ready(self) -> None:
        """Returns at once: its result tells the driver that this rank has run every call submitted before it (the
        generation in flight), so the push submitted right after starts now (``cluster.timeouts.push_s`` counts
        from here)."""

    @trace.spanned("receive_weights", cat="weight_sync")
    def receive_weights(self, version: int) -> WeightSync:
        """Collective with the policy's push: load its weights into the engine; they are ``version`` from now."""
        start = time.perf_counter()
        stats = TransferStats()
        self.engine.wake_up()  # begins a sync (the engine never sleeps here)
        if self.lora is None or not self.engine.holds_base_weights:  # adapter sync: the base weights once
            for bucket in stream_weights(self.plan, self.spec, {}, rank=self.link_rank, dtype=self.dtype,
                                         bucket_bytes=int(self.config.bucket_mb * 2**20), stats=stats,
                                         link=self.member.get(), device=self.ctx.device,
                                         full_tensors=_full_tensors(self.config), buffer=self.engine.weight_buffer):
                self.engine.update_weights(bucket)
                bucket.clear()
            self.engine.finish_weight_update()
        if self.lora is not None:
            factors = receive_adapter(self.member.get(), self.shapes, self.dtype, self.ctx.device)
            self.engine.load_adapter(adapters.peft_adapter(self.spec, self.lora.targets, factors), version)
            stats.adapter_bytes = adapter_bytes(factors)
        self.version = version
        return WeightSync(transfer=stats, seconds=time.perf_counter() - start, sleep_frees_memory=False)

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch | None:
        """``params.n`` responses per prompt of this replica's share (rows as the policy's own
        :meth:`~megarl.roles.policy.PolicyRole.generate` returns them), each with ``policy_version``."""
        if self.version is None:
            raise RuntimeError("generate before the first weight sync: the engine holds no weights")
        seed = None if params.seed is None else params.seed + 1_000_003 * self.place.replica
        start = time.perf_counter()
        with trace.span("generate", cat="rollout", prompts=len(prompts), n=params.n):
            ids = prompt_lists(prompts)
            out = self.engine.generate(ids, dataclasses.replace(params, seed=seed))
        # this process's memory peak since the previous generation rides along (no call that would wait for it)
        metrics = {"timing/generate_s": time.perf_counter() - start} | peaks().metrics("memory/rollout_pool/")
        reset_peaks()
        batch = generation_rows(prompts, ids, [out], self.engine.pad_token_id, metrics, self.version)
        return batch if self.ctx.is_collect_rank else None

    def probe(self, prompts: Batch, params: SamplingParams) -> Batch | None:
        """The weight-push probe (:mod:`megarl.rollout.parity`), right after a push: :meth:`generate`'s rows of this
        replica's one probe prompt, each tagged ``rollout_replica``, with the probe's own seed on every replica
        (no timing or memory metrics: the window of the next generation's memory peak stays open)."""
        if self.version is None:
            raise RuntimeError("probe before the first weight sync: the engine holds no weights")
        ids = prompt_lists(prompts)
        with trace.span("probe", cat="weight_sync", prompts=len(prompts)):
            out = self.engine.generate(ids, params)
        batch = generation_rows(prompts, ids, [out], self.engine.pad_token_id, {}, self.version)
        batch.tensors["rollout_replica"] = torch.full((len(batch),), self.place.replica, dtype=torch.long)
        return batch if self.ctx.is_collect_rank else None

    def extend(self, prompts: Batch, params: SamplingParams) -> Batch | None:
        """Up to ``params.max_new_tokens`` more tokens for each of ``params.n`` rows per prompt, where a prompt
        may end with the start of a response (a partial rollout continued, prefilled under the weights held
        now). Rows grouped by prompt: ``tokens`` [rows, T] (padded), ``log_probs`` [rows, T], ``lengths``,
        ``stopped`` (a stop token ended the row), ``policy_version``, ``routed_experts`` where the engine records
        routing (as :class:`~megarl.rollout.base.RolloutOutput` has it); the per-prompt fields are copied."""
        if self.version is None:
            raise RuntimeError("extend before the first weight sync: the engine holds no weights")
        seed = None if params.seed is None else params.seed + 1_000_003 * self.place.replica
        with trace.span("extend", cat="rollout", prompts=len(prompts), n=params.n):
            ids = prompt_lists(prompts)
            out = self.engine.generate(ids, dataclasses.replace(params, seed=seed))
        fields = {"tokens": out.responses.long(), "log_probs": out.log_probs.float(), "lengths": out.response_lengths,
                  "stopped": torch.tensor([f == FINISH_STOP for f in out.finish_reasons]),
                  "policy_version": torch.full((len(out),), self.version, dtype=torch.long)}
        if out.routed_experts is not None:  # [rows, W, layers, top_k]: the sequence so far and the new tokens
            fields["routed_experts"] = out.routed_experts
        fields |= {k: prompts[k][out.prompt_index] for k in prompts.tensors.keys()  # noqa: SIM118
                   if k not in ("prompt_ids", "prompt_lengths")}
        return Batch.from_dict(fields) if self.ctx.is_collect_rank else None
