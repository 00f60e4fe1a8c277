"""Layout planning: per-device memory of every role in every phase of the hybrid engine, whether it
fits, the resharding traffic and its bandwidth lower bound, and the config overrides of a layout;
:func:`propose` enumerates the layouts of a cluster and keeps those that fit.

Pure module: no torch.distributed, no megatron-core, no Ray. Memory terms come from
:mod:`megarl.planner.memory`; resharding bytes come from :func:`megarl.resharding.plan.make_plan`
(the plan the transport executes), computed lazily because a 64-rank plan takes seconds.

Phases of one PPO iteration on a colocated pool (megarl.roles.hybrid, docs/resharding.md §4):

* ``train``: policy and critic hold weights, gradients and optimizer state, the reference its
  weights; the rollout engine sleeps (weights on the host, KV cache freed). Policy and critic train
  one after the other, so only the larger of their activations counts.
* ``sync``: the policy's gradients and optimizer state are offloaded; its weights stream into the
  woken rollout engine (rollout weights + transient). Critic and reference stay resident.
* ``generate``: the policy's weights are offloaded too; the rollout engine holds its weights and
  KV cache (allocated after the sync).
* ``build``: once, when vLLM starts (it allocates weights and KV cache, then sleeps) with every
  engine already built, before the first optimizer step (Adam's moments do not exist yet).

Split placement (``Cluster.rollout_gpus``: the rollout engines on a pool of their own, issue #23): the
training pool holds no rollout weights or KV cache, so nothing is offloaded there; its phases are ``train``
and ``sync`` (full state resident, weights leaving through send buffers). The rollout pool holds no
training state; its phases are ``sync`` (rollout weights, KV cache and a receive buffer: vLLM stays awake)
and ``generate``. The sync bytes come from the same plan with ``rollout_ranks``: the training ranks send,
the rollout ranks (numbered after them, on the GPUs after theirs) receive.

These are GPU phases (vLLM's CUDA sleep mode). On CPU (vLLM's CPU build) nothing sleeps or offloads:
rollout weights and KV cache stay resident beside the full training state in every phase; the planner
does not model that case.

LoRA (``Workload.lora``, issue #45; :mod:`megarl.planner.lora`): the policy's base is frozen, so its gradients and
optimizer state are the adapters' only; the reference is the policy's base model (no reference role); a merged sync
moves the same bytes as a full one, with the merge's temporaries on the sender.

Mixture-of-Experts models (issue #24): the layout's ``ep`` places whole experts (memory in
:mod:`megarl.planner.memory`), :attr:`LayoutPlan.expert_traffic` gives the all-to-all bytes per micro-batch
(:mod:`megarl.planner.compute`), and :func:`candidate_layouts` also tries every ep that divides the experts
and a stage's tp*dp ranks.

Sizes are decimal GB, as in docs/planner.md; the text reports are :mod:`megarl.planner.report`'s.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math

from megarl.engine.config import EngineConfig, LoRAConfig, MicroBatchConfig, Precision
from megarl.errors import ConfigError, LayoutError
from megarl.models.spec import Head, ModelSpec
from megarl.parallel.layout import ParallelLayout
from megarl.planner import compute, lora, memory
from megarl.planner.memory import GB, Recompute
from megarl.resharding.plan import Grouping, check_expert_rollout, check_rollout_tp, check_vllm_groups, make_plan


class Role(enum.Enum):
    POLICY = "policy"
    REFERENCE = "reference"  # frozen: weights only
    CRITIC = "critic"  # the policy's decoder with a scalar head, trained


class Pool(enum.Enum):
    TRAINING = "training"  # the policy's pool (colocated: the rollout engines' too)
    ROLLOUT = "rollout"  # split placement: the rollout engines' own pool


class Phase(enum.Enum):
    TRAIN = "train"
    SYNC = "sync"
    GENERATE = "generate"
    BUILD = "build"


ROLLOUT = "rollout"  # row owner of the rollout engine's terms
RESERVED = "reserved"
# the rollout terms inside vLLM's gpu_memory_utilization budget; "kv rounding" is the KV cache vLLM adds
# when the budget is rounded up (it sizes the KV cache to the whole budget)
VLLM_BUDGET = ("weights", "kv cache", "profiled activations", "cuda graphs", "runtime")
VLLM_RESIDENT = ("cuda graphs", "runtime")  # stay while vLLM sleeps (its graph pool is outside the cuMem pool)


def vllm_utilization(need: int, capacity: int) -> float:
    """vLLM's ``gpu_memory_utilization`` for a budget of ``need`` bytes: rounded up to 0.01. vLLM requires
    ``ceil(utilization x total)`` bytes free when it starts (v1/worker/utils.py ``request_memory``), so the
    plan counts the rounded budget in the phases that hold the KV cache."""
    return min(1.0, math.ceil(100 * need / capacity) / 100)


@dataclasses.dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_mem_gb: float
    intra_node_gbps: float = 300.0  # per GPU, NVLink (docs/resharding.md §3.4)
    inter_node_gbps: float = 40.0  # per GPU, InfiniBand (docs/resharding.md §3.4)
    reserved_gb: float = 4.0  # CUDA context, NCCL buffers, allocator fragmentation
    rollout_gpus: int = 0  # split placement: the last R GPUs are the rollout engines' own pool; 0: colocated

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ConfigError(f"a cluster needs >= 1 node and >= 1 GPU per node, found {self.nodes} x "
                              f"{self.gpus_per_node}.")
        if min(self.gpu_mem_gb, self.intra_node_gbps, self.inter_node_gbps) <= 0 or self.reserved_gb < 0:
            raise ConfigError("GPU memory and link bandwidths must be positive and reserved memory >= 0.")
        if not 0 <= self.rollout_gpus < self.world_size:
            raise ConfigError(f"rollout GPUs must lie in [0, {self.world_size}) (0: colocated; the training pool keeps "
                              f"at least one GPU), found {self.rollout_gpus}.")
        if self.split:
            self.pool_shape(self.train_gpus)
            self.pool_shape(self.rollout_gpus)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def split(self) -> bool:
        return self.rollout_gpus > 0

    @property
    def train_gpus(self) -> int:
        """GPUs of the training pool: the first ones (all of them when colocated)."""
        return self.world_size - self.rollout_gpus

    def pool_shape(self, gpus: int) -> tuple[int, int]:
        """(nodes, devices per node) of a pool of ``gpus`` GPUs, as megarl's pools are: whole nodes, or a part
        of one node."""
        if gpus % self.gpus_per_node == 0:
            return gpus // self.gpus_per_node, self.gpus_per_node
        if gpus < self.gpus_per_node:
            return 1, gpus
        raise ConfigError(f"split placement: a pool of {gpus} GPUs is neither whole nodes of {self.gpus_per_node} "
                          f"GPUs nor a part of one node (the pools are {self.train_gpus} training + "
                          f"{self.rollout_gpus} rollout GPUs); choose a rollout GPU count that leaves both so.")

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node  # ranks fill nodes in order (torchrun, Ray placement bundles)


@dataclasses.dataclass(frozen=True)
class Workload:
    """What the roles do with their memory; mirrors the TrainConfig fields it is named after."""

    roles: tuple[Role, ...] = (Role.POLICY, Role.REFERENCE, Role.CRITIC)
    precision: Precision = Precision.BF16  # policy.precision / critic.precision
    distributed_optimizer: bool = True  # policy.optim.use_distributed_optimizer
    micro_batch_tokens: int = 2048  # policy.micro_batch.max_tokens
    micro_batch_rows: int = MicroBatchConfig.max_size  # policy.micro_batch.max_size (the padding report's plan)
    prompt_tokens: int = 512  # data.max_prompt_length
    response_tokens: int = 512  # rollout.max_new_tokens
    recompute: Recompute = Recompute.SELECTIVE
    rollout_dtype: str = "bfloat16"  # rollout.engine.dtype
    concurrent_seqs: int = 256  # sequences each rollout replica decodes at once (vLLM max_num_seqs)
    bucket_mb: float = 64.0  # rollout.engine.bucket_mb
    enforce_eager: bool = False  # rollout.engine.enforce_eager: vLLM captures no CUDA graphs
    # vLLM's persistent buffers, workspaces and non-torch memory beside weights, KV cache and graphs (an estimate)
    vllm_runtime_gb: float = 1.0
    lora: LoRAConfig | None = None  # policy.lora: only the policy's adapters train; its base model is the reference
    packing: bool = EngineConfig.packing  # policy.packing: micro-batches fill the token budget with real tokens

    def __post_init__(self) -> None:
        if Role.POLICY not in self.roles:
            raise ConfigError(f"roles {[r.value for r in self.roles]} lack the policy; every plan has one.")
        if min(self.micro_batch_tokens, self.micro_batch_rows, self.prompt_tokens, self.response_tokens,
               self.concurrent_seqs) < 1:
            raise ConfigError("micro-batch tokens and rows, prompt/response tokens and concurrent sequences must be "
                              ">= 1.")
        if self.vllm_runtime_gb < 0:
            raise ConfigError(f"vllm_runtime_gb must be >= 0, found {self.vllm_runtime_gb}.")
        if self.lora is not None and Role.REFERENCE in self.roles:
            raise ConfigError("a LoRA policy is its own reference (its base model, adapters off): a run with "
                              "policy.lora has no reference role; leave 'reference' out of the roles (--roles).")
        memory.itemsize(self.rollout_dtype)

    @property
    def seq_len(self) -> int:
        return self.prompt_tokens + self.response_tokens


@dataclasses.dataclass(frozen=True)
class ReshardEstimate:
    """Bytes each rank receives/sends in one weight sync (from make_plan) and the link-bound time. Ranks are
    the plan's: with split placement the training ranks (they only send), then the rollout ranks (they only
    receive); means are over the receiving and the sending ranks."""

    received_max: int
    received_mean: float
    sent_max: int
    slowest_intra: int  # intra-node bytes of the slowest rank (its receive or send side, whichever bounds it)
    slowest_inter: int  # inter-node bytes of the same
    seconds: float  # lower bound: the slowest rank's intra/NVLink + inter/IB
    per_rank_received: tuple[int, ...]
    per_rank_sent: tuple[int, ...]
    sent_mean: float
    total: int  # bytes moved between ranks in one sync (split: everything crossing from one pool to the other)
    total_inter: int  # ... of which between nodes


Breakdown = dict[tuple[str, str], int]  # (owner, term) -> bytes


@dataclasses.dataclass(frozen=True)
class PhasePeak:
    phase: Phase
    stage: int  # the fullest pipeline stage in this phase (0 on the rollout pool, which has no stages)
    terms: Breakdown
    pool: Pool = Pool.TRAINING

    @property
    def total(self) -> int:
        return sum(self.terms.values())


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
    spec: ModelSpec
    model_name: str
    cluster: Cluster
    workload: Workload
    layout: ParallelLayout
    rollout_tp: int
    peaks: tuple[PhasePeak, ...]

    @property
    def capacity(self) -> int:
        return int(self.cluster.gpu_mem_gb * GB)

    @property
    def fits(self) -> bool:
        return all(p.total <= self.capacity for p in self.peaks)

    @property
    def worst(self) -> PhasePeak:
        return max(self.peaks, key=lambda p: p.total)

    @property
    def reasons(self) -> list[str]:
        """Why it does not fit: each overflowing phase and its largest terms; empty when it fits."""
        out = []
        for p in self.peaks:
            if p.total <= self.capacity:
                continue
            top = sorted(p.terms.items(), key=lambda kv: -kv[1])[:3]
            terms = ", ".join(f"{o} {t} {b / GB:.1f} GB" for (o, t), b in top)
            where = "the fullest rollout GPU" if p.pool is Pool.ROLLOUT else f"pipeline stage {p.stage}"
            pool = f"{p.pool.value} pool: " if self.cluster.split else ""
            out.append(f"{pool}{p.phase.value} phase needs {p.total / GB:.1f} GB > {self.capacity / GB:.1f} GB on "
                       f"{where} (largest terms: {terms})")
        return out

    def pool_peaks(self, pool: Pool) -> tuple[PhasePeak, ...]:
        return tuple(p for p in self.peaks if p.pool is pool)

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)

    @functools.cached_property
    def reshard(self) -> ReshardEstimate:
        return reshard_estimate(self.spec, self.layout, self.rollout_tp, self.cluster, self.workload.rollout_dtype)

    @property
    def expert_traffic(self) -> compute.ExpertTraffic:
        """Expert-parallel all-to-all of one training micro-batch on the fullest stage (zero for a dense
        model or ep 1), in the training precision, and its link-bound time."""
        w, c = self.workload, self.cluster
        tokens = memory.micro_batch_fill(w.micro_batch_tokens, w.seq_len, w.packing)
        routed = tokens // self.layout.cp // (self.layout.tp if memory.sequence_parallel(self.spec, self.layout.tp)
                                              else 1)
        return compute.expert_traffic(self.spec, self.layout, tokens=routed,
                                      itemsize=memory.param_bytes(self.workload.precision), node_of=c.node_of,
                                      intra_bps=c.intra_node_gbps * GB, inter_bps=c.inter_node_gbps * GB)

    @property
    def gpu_memory_utilization(self) -> float:
        """vLLM's share of the GPU: its budget for the planned rollout weights, KV cache and what it reserves
        besides (profiled activations, CUDA graphs, runtime), rounded up to 0.01 (:func:`vllm_utilization`)."""
        gen = next(p for p in self.peaks if p.phase is Phase.GENERATE and (ROLLOUT, "weights") in p.terms).terms
        return vllm_utilization(sum(gen[(ROLLOUT, t)] for t in VLLM_BUDGET), self.capacity)

    def overrides(self) -> list[str]:
        """``key=value`` overrides of megarl's TrainConfig for this layout and workload."""
        w, lay, c = self.workload, self.layout, self.cluster
        pool = "cluster.pools.main"
        nodes, per_node = c.pool_shape(c.train_gpus)
        out = [f"{pool}.nodes={nodes}", f"{pool}.devices_per_node={per_node}", f"{pool}.tp={lay.tp}",
               f"{pool}.pp={lay.pp}"]
        if lay.vpp:
            out.append(f"{pool}.vpp={lay.vpp}")
        if lay.ep > 1:
            out.append(f"{pool}.ep={lay.ep}")
        if lay.cp > 1:
            out.append(f"{pool}.cp={lay.cp}")
        if c.split:  # the rollout engines' own pool: tp = rollout.engine.tp, pp = 1 (issue #23)
            nodes, per_node = c.pool_shape(c.rollout_gpus)
            out += [f"cluster.pools.rollout.nodes={nodes}", f"cluster.pools.rollout.devices_per_node={per_node}",
                    f"cluster.pools.rollout.tp={self.rollout_tp}", "cluster.placement.rollout=rollout"]
        out += [f"rollout.engine.tp={self.rollout_tp}", "rollout.engine.backend=vllm",
                f"rollout.engine.dtype={w.rollout_dtype}",
                f"rollout.engine.gpu_memory_utilization={self.gpu_memory_utilization:.2f}",
                f"rollout.max_new_tokens={w.response_tokens}", f"data.max_prompt_length={w.prompt_tokens}"]
        if w.enforce_eager:
            out.append("rollout.engine.enforce_eager=true")
        for role in (Role.POLICY, Role.CRITIC):
            if role in w.roles:
                out += [f"{role.value}.precision={w.precision.value}",
                        f"{role.value}.micro_batch.max_tokens={w.micro_batch_tokens}"]
                if w.micro_batch_rows != MicroBatchConfig.max_size:
                    out.append(f"{role.value}.micro_batch.max_size={w.micro_batch_rows}")
                if w.packing is not EngineConfig.packing:
                    out.append(f"{role.value}.packing={str(w.packing).lower()}")
                if not w.distributed_optimizer:
                    out.append(f"{role.value}.optim.use_distributed_optimizer=false")
        if w.lora is not None:
            out += [f"policy.lora.rank={w.lora.rank}", f"policy.lora.targets=[{','.join(w.lora.targets)}]"]
        return out


# --------------------------------------------------------------------------------------- planning


def check_layout(spec: ModelSpec, cluster: Cluster, layout: ParallelLayout, rollout_tp: int) -> None:
    """Raise LayoutError unless the layout fills the cluster, divides the model (ep > 1: only an MoE model's
    experts) and has a rollout tp megarl's vLLM engine accepts (its TP groups are consecutive ranks inside
    one data-parallel replica, or inside the rollout pool with split placement)."""
    layout.check_world_size(cluster.train_gpus)
    if spec.moe is None and layout.ep > 1:  # megatron-core ignores ep for a dense model: nothing to plan
        raise LayoutError(f"ep={layout.ep} needs a Mixture-of-Experts model; {spec.architecture} is dense: "
                          "set ep to 1.")
    spec.check_layout(layout)
    check_expert_rollout(spec, rollout_tp)
    if not cluster.split:
        check_vllm_groups(layout, rollout_tp)
    check_rollout_tp(spec, layout, rollout_tp, cluster.rollout_gpus or None)


def plan_layout(spec: ModelSpec, cluster: Cluster, workload: Workload, layout: ParallelLayout, rollout_tp: int,
                model_name: str = "model") -> LayoutPlan:
    """Memory per device of every phase (fullest pipeline stage each; with split placement the training
    pool's phases, then the rollout pool's); resharding bytes on demand."""
    check_layout(spec, cluster, layout, rollout_tp)
    if layout.cp > 1 and not workload.packing:
        raise LayoutError(f"context parallelism (cp={layout.cp}) splits packed sequences over its ranks; the workload "
                          "is not packed: plan with packing (the engine's default) or cp 1.")
    stages = _phase_terms(spec, cluster, workload, layout, rollout_tp)
    peaks = []
    for phase in stages[0]:
        stage = max(range(layout.pp), key=lambda s, ph=phase: (sum(stages[s][ph].values()), -s))
        peaks.append(PhasePeak(phase, stage, stages[stage][phase]))
    if cluster.split:
        peaks += [PhasePeak(ph, 0, terms, Pool.ROLLOUT)
                  for ph, terms in _rollout_pool_terms(spec, cluster, workload, layout, rollout_tp).items()]
    return LayoutPlan(spec, model_name, cluster, workload, layout, rollout_tp, tuple(peaks))


def _phase_terms(spec: ModelSpec, cluster: Cluster, w: Workload, layout: ParallelLayout,
                 rollout_tp: int) -> list[dict[Phase, Breakdown]]:
    """Per pipeline stage, the terms of every phase of the training pool (the only pool when colocated)."""
    specs = {Role.POLICY: spec, Role.REFERENCE: spec, Role.CRITIC: spec.with_head(Head.SCALAR)}
    act_bytes = memory.param_bytes(w.precision)
    state, at_build, act = {}, {}, {}
    for role in w.roles:
        s = specs[role]
        state[role] = _state_bytes(role, s, w, layout, optimizer_states=2)
        at_build[role] = _state_bytes(role, s, w, layout, optimizer_states=0)
        if role is not Role.REFERENCE:
            act[role] = [memory.activation_bytes(s, layout, st, micro_batch_tokens=w.micro_batch_tokens,
                                                 seq_len=w.seq_len, recompute=w.recompute, act_bytes=act_bytes,
                                                 packed=w.packing)
                         for st in range(layout.pp)]
    r_bytes, bucket = memory.itemsize(w.rollout_dtype), int(w.bucket_mb * 2**20)
    rollout_w, kv, awake, asleep = _rollout_terms(spec, cluster, w, rollout_tp)
    transient = {(ROLLOUT, "reshard transient"): memory.reshard_transient_bytes(
        spec, layout, rollout_tp, param_dtype_bytes=act_bytes, rollout_dtype_bytes=r_bytes, bucket_bytes=bucket)}
    send = {(Role.POLICY.value, "reshard transient"): memory.send_transient_bytes(
        spec, layout, param_dtype_bytes=act_bytes, bucket_bytes=bucket)}
    merge = ({} if w.lora is None else  # the merged weights stream through the same plan
             {(Role.POLICY.value, "merge transient"): lora.merge_transient_bytes(spec, layout, w.precision, w.lora)})
    reserved = {(RESERVED, ""): int(cluster.reserved_gb * GB)}

    def full(role: Role, states: dict, stage: int) -> Breakdown:
        if role not in w.roles:
            return {}
        st = states[role][stage]
        if role is Role.REFERENCE:
            return {(role.value, "weights"): st.params}
        return {(role.value, "weights"): st.params, (role.value, "grads"): st.grads,
                (role.value, "optimizer"): st.optimizer}

    out = []
    for st in range(layout.pp):
        busiest = max(act, key=lambda r, st=st: act[r][st])
        policy_w = {(Role.POLICY.value, "weights"): state[Role.POLICY][st].params}
        resident = full(Role.REFERENCE, state, st) | full(Role.CRITIC, state, st)
        train = full(Role.POLICY, state, st) | {(busiest.value, "activations"): act[busiest][st]} | resident | reserved
        if cluster.split:  # no rollout engine here: nothing is offloaded, the weights only leave
            out.append({Phase.TRAIN: train,
                        Phase.SYNC: full(Role.POLICY, state, st) | resident | send | merge | reserved})
            continue
        out.append({
            Phase.TRAIN: train | asleep,
            Phase.SYNC: policy_w | merge | resident | rollout_w | transient | asleep | reserved,
            Phase.GENERATE: resident | rollout_w | kv | awake | reserved,
            Phase.BUILD: full(Role.POLICY, at_build, st) | full(Role.REFERENCE, at_build, st)
            | full(Role.CRITIC, at_build, st) | rollout_w | kv | awake | reserved,
        })
    return out


def _state_bytes(role: Role, spec: ModelSpec, w: Workload, layout: ParallelLayout, *,
                 optimizer_states: int) -> list[memory.StateBytes]:
    """A role's training state per stage: a LoRA policy's (frozen base, adapters trained) or every weight's."""
    if role is Role.POLICY and w.lora is not None:
        return lora.lora_state_bytes(spec, layout, w.precision, w.distributed_optimizer, w.lora,
                                     optimizer_states=optimizer_states)
    return memory.training_state_bytes(spec, layout, w.precision, w.distributed_optimizer,
                                       optimizer_states=optimizer_states)


def _rollout_terms(spec: ModelSpec, cluster: Cluster, w: Workload,
                   rollout_tp: int) -> tuple[Breakdown, Breakdown, Breakdown, Breakdown]:
    """The rollout engine on its fullest GPU: its weights; its KV cache; what vLLM holds beside them while awake
    (the activation peak it profiles at start-up, its CUDA graphs and runtime, and the KV cache its rounded-up
    budget adds); what stays while it sleeps (the CUDA graphs and runtime). docs/planner.md §3.3."""
    r_bytes = memory.itemsize(w.rollout_dtype)
    capacity = int(cluster.gpu_mem_gb * GB)
    tokens, seqs = memory.vllm_batch(capacity)
    weights = {(ROLLOUT, "weights"): memory.rollout_weight_bytes(spec, rollout_tp, r_bytes)}
    kv = {(ROLLOUT, "kv cache"): memory.kv_cache_bytes(spec, rollout_tp, r_bytes, w.concurrent_seqs * w.seq_len)}
    asleep = {(ROLLOUT, "cuda graphs"): 0 if w.enforce_eager else memory.vllm_graph_bytes(spec, r_bytes, seqs),
              (ROLLOUT, "runtime"): int(w.vllm_runtime_gb * GB)}
    awake = {(ROLLOUT, "profiled activations"): memory.vllm_profile_bytes(spec, rollout_tp, r_bytes, tokens, seqs)}
    awake |= asleep
    need = sum((weights | kv | awake).values())
    awake[(ROLLOUT, "kv rounding")] = max(0, math.ceil(vllm_utilization(need, capacity) * capacity) - need)
    return weights, kv, awake, asleep


def _rollout_pool_terms(spec: ModelSpec, cluster: Cluster, w: Workload, layout: ParallelLayout,
                        rollout_tp: int) -> dict[Phase, Breakdown]:
    """Split placement, the rollout pool: no training state; vLLM stays awake, so its KV cache is allocated
    during the sync too, beside the receive buffer."""
    weights, kv, awake, _ = _rollout_terms(spec, cluster, w, rollout_tp)
    receive = {(ROLLOUT, "reshard transient"): memory.receive_transient_bytes(
        spec, layout, rollout_dtype_bytes=memory.itemsize(w.rollout_dtype), bucket_bytes=int(w.bucket_mb * 2**20))}
    reserved = {(RESERVED, ""): int(cluster.reserved_gb * GB)}
    return {Phase.SYNC: weights | kv | awake | receive | reserved, Phase.GENERATE: weights | kv | awake | reserved}


def reshard_estimate(spec: ModelSpec, layout: ParallelLayout, rollout_tp: int, cluster: Cluster,
                     rollout_dtype: str) -> ReshardEstimate:
    """Per-rank bytes of one weight sync from the resharding plan, split by link, and the lower bound
    on its time: for every rank, max(receive, send) of intra-node bytes / NVLink + inter-node bytes /
    IB (docs/resharding.md §3.4 arithmetic), the slowest rank's. With split placement
    (``cluster.rollout_gpus``) the plan's world is the training ranks, then the rollout ranks, on the GPUs
    in that order, so every byte crosses from one pool to the other."""
    plan = make_plan(spec, layout, rollout_tp, grouping=Grouping.CONSECUTIVE,  # vLLM's groups
                     rollout_ranks=cluster.rollout_gpus or None)
    size = memory.itemsize(rollout_dtype)
    world = len(plan.places)
    recv = [[0, 0] for _ in range(world)]  # [intra, inter]
    sent = [[0, 0] for _ in range(world)]
    for s in plan.slabs:
        if s.src == s.dst:
            continue
        n = plan.slab_bytes(s, size)
        link = int(cluster.node_of(s.src) != cluster.node_of(s.dst))
        recv[s.dst][link] += n
        sent[s.src][link] += n
    intra, inter = cluster.intra_node_gbps * GB, cluster.inter_node_gbps * GB

    def seconds(side: list[int]) -> float:
        return side[0] / intra + side[1] / inter

    sides = [max(recv[r], sent[r], key=seconds) for r in range(world)]  # the side that bounds each rank
    slowest = max(sides, key=seconds)
    received, sends = tuple(a + b for a, b in recv), tuple(a + b for a, b in sent)
    total = sum(received)
    return ReshardEstimate(
        received_max=max(received), received_mean=total / len(plan.receivers), sent_max=max(sends),
        slowest_intra=slowest[0], slowest_inter=slowest[1], seconds=seconds(slowest), per_rank_received=received,
        per_rank_sent=sends, sent_mean=total / layout.world_size, total=total, total_inter=sum(b for _, b in recv),
    )
