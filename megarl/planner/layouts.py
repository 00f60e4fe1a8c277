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

These are GPU phases (vLLM's CUDA sleep mode). On CPU (vLLM's CPU build) nothing sleeps or offloads:
rollout weights and KV cache stay resident beside the full training state in every phase; the planner
does not model that case.

Text reports (what ``tools/plan.py`` prints) are formatted here too: strings out, nothing printed.
Sizes are decimal GB, as in docs/planner.md.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math

from megarl.engine.config import Precision
from megarl.errors import ConfigError, LayoutError
from megarl.models.spec import Head, ModelSpec
from megarl.parallel.layout import ParallelLayout
from megarl.planner import memory
from megarl.planner.memory import GB, Recompute, micro_batch_shape
from megarl.resharding.plan import Grouping, check_rollout_tp, check_vllm_groups, make_plan


class Role(enum.Enum):
    POLICY = "policy"
    REFERENCE = "reference"  # frozen: weights only
    CRITIC = "critic"  # the policy's decoder with a scalar head, trained


class Phase(enum.Enum):
    TRAIN = "train"
    SYNC = "sync"
    GENERATE = "generate"
    BUILD = "build"


ROLLOUT = "rollout"  # row owner of the rollout engine's terms
RESERVED = "reserved"


@dataclasses.dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_mem_gb: float
    intra_node_gbps: float = 300.0  # per GPU, NVLink (docs/resharding.md §3.4)
    inter_node_gbps: float = 40.0  # per GPU, InfiniBand (docs/resharding.md §3.4)
    reserved_gb: float = 4.0  # CUDA context, NCCL buffers, allocator fragmentation

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ConfigError(f"a cluster needs >= 1 node and >= 1 GPU per node, found {self.nodes} x "
                              f"{self.gpus_per_node}.")
        if min(self.gpu_mem_gb, self.intra_node_gbps, self.inter_node_gbps) <= 0 or self.reserved_gb < 0:
            raise ConfigError("GPU memory and link bandwidths must be positive and reserved memory >= 0.")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node  # ranks fill nodes in order (torchrun, Ray placement bundles)


@dataclasses.dataclass(frozen=True)
class Workload:
    """What the roles do with their memory; mirrors the TrainConfig fields it is named after."""

    roles: tuple[Role, ...] = (Role.POLICY, Role.REFERENCE, Role.CRITIC)
    precision: Precision = Precision.BF16  # policy.precision / critic.precision
    distributed_optimizer: bool = True  # policy.optim.use_distributed_optimizer
    micro_batch_tokens: int = 2048  # policy.micro_batch.max_tokens
    prompt_tokens: int = 512  # data.max_prompt_length
    response_tokens: int = 512  # rollout.max_new_tokens
    recompute: Recompute = Recompute.SELECTIVE
    rollout_dtype: str = "bfloat16"  # rollout.engine.dtype
    concurrent_seqs: int = 256  # sequences each rollout replica decodes at once (vLLM max_num_seqs)
    bucket_mb: float = 64.0  # rollout.engine.bucket_mb

    def __post_init__(self) -> None:
        if Role.POLICY not in self.roles:
            raise ConfigError(f"roles {[r.value for r in self.roles]} lack the policy; every plan has one.")
        if min(self.micro_batch_tokens, self.prompt_tokens, self.response_tokens, self.concurrent_seqs) < 1:
            raise ConfigError("micro-batch tokens, prompt/response tokens and concurrent sequences must be >= 1.")
        memory.itemsize(self.rollout_dtype)

    @property
    def seq_len(self) -> int:
        return self.prompt_tokens + self.response_tokens


@dataclasses.dataclass(frozen=True)
class ReshardEstimate:
    """Bytes each rank receives/sends in one weight sync (from make_plan) and the link-bound time."""

    received_max: int
    received_mean: float
    sent_max: int
    slowest_intra: int  # intra-node bytes of the slowest rank (its receive or send side, whichever bounds it)
    slowest_inter: int  # inter-node bytes of the same
    seconds: float  # lower bound: the slowest rank's intra/NVLink + inter/IB
    per_rank_received: tuple[int, ...]


Breakdown = dict[tuple[str, str], int]  # (owner, term) -> bytes


@dataclasses.dataclass(frozen=True)
class PhasePeak:
    phase: Phase
    stage: int  # the fullest pipeline stage in this phase
    terms: Breakdown

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
            out.append(f"{p.phase.value} phase needs {p.total / GB:.1f} GB > {self.capacity / GB:.1f} GB on pipeline "
                       f"stage {p.stage} (largest terms: {terms})")
        return out

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)

    @functools.cached_property
    def reshard(self) -> ReshardEstimate:
        return reshard_estimate(self.spec, self.layout, self.rollout_tp, self.cluster, self.workload.rollout_dtype)

    @property
    def gpu_memory_utilization(self) -> float:
        """vLLM's share of the GPU for the planned rollout weights + KV cache (rounded up to 0.01)."""
        gen = next(p for p in self.peaks if p.phase is Phase.GENERATE).terms
        need = gen[(ROLLOUT, "weights")] + gen[(ROLLOUT, "kv cache")]
        return min(1.0, math.ceil(100 * need / self.capacity) / 100)

    def overrides(self) -> list[str]:
        """``key=value`` overrides of megarl's TrainConfig for this layout and workload."""
        w, lay = self.workload, self.layout
        pool = "cluster.pools.main"
        out = [f"{pool}.nodes={self.cluster.nodes}", f"{pool}.devices_per_node={self.cluster.gpus_per_node}",
               f"{pool}.tp={lay.tp}", f"{pool}.pp={lay.pp}"]
        if lay.vpp:
            out.append(f"{pool}.vpp={lay.vpp}")
        out += [f"rollout.engine.tp={self.rollout_tp}", "rollout.engine.backend=vllm",
                f"rollout.engine.dtype={w.rollout_dtype}",
                f"rollout.engine.gpu_memory_utilization={self.gpu_memory_utilization:.2f}",
                f"rollout.max_new_tokens={w.response_tokens}", f"data.max_prompt_length={w.prompt_tokens}"]
        for role in (Role.POLICY, Role.CRITIC):
            if role in w.roles:
                out += [f"{role.value}.precision={w.precision.value}",
                        f"{role.value}.micro_batch.max_tokens={w.micro_batch_tokens}"]
                if not w.distributed_optimizer:
                    out.append(f"{role.value}.optim.use_distributed_optimizer=false")
        return out


# --------------------------------------------------------------------------------------- planning


def check_layout(spec: ModelSpec, cluster: Cluster, layout: ParallelLayout, rollout_tp: int) -> None:
    """Raise LayoutError unless the layout fills the cluster, divides the model and has a rollout tp
    megarl's vLLM engine accepts (its TP groups are consecutive ranks inside one data-parallel replica)."""
    layout.check_world_size(cluster.world_size)
    layout.check_model(num_layers=spec.num_layers, num_attention_heads=spec.num_attention_heads,
                       num_query_groups=spec.num_query_groups)
    check_vllm_groups(layout, rollout_tp)
    check_rollout_tp(spec, layout, rollout_tp)


def plan_layout(spec: ModelSpec, cluster: Cluster, workload: Workload, layout: ParallelLayout, rollout_tp: int,
                model_name: str = "model") -> LayoutPlan:
    """Memory per device of every phase (fullest pipeline stage each); resharding bytes on demand."""
    check_layout(spec, cluster, layout, rollout_tp)
    stages = _phase_terms(spec, cluster, workload, layout, rollout_tp)
    peaks = []
    for phase in Phase:
        stage = max(range(layout.pp), key=lambda s, ph=phase: (sum(stages[s][ph].values()), -s))
        peaks.append(PhasePeak(phase, stage, stages[stage][phase]))
    return LayoutPlan(spec, model_name, cluster, workload, layout, rollout_tp, tuple(peaks))


def _phase_terms(spec: ModelSpec, cluster: Cluster, w: Workload, layout: ParallelLayout,
                 rollout_tp: int) -> list[dict[Phase, Breakdown]]:
    """Per pipeline stage, the terms of every phase."""
    specs = {Role.POLICY: spec, Role.REFERENCE: spec, Role.CRITIC: spec.with_head(Head.SCALAR)}
    act_bytes = memory.param_bytes(w.precision)
    state, at_build, act = {}, {}, {}
    for role in w.roles:
        s = specs[role]
        state[role] = memory.training_state_bytes(s, layout, w.precision, w.distributed_optimizer)
        at_build[role] = memory.training_state_bytes(s, layout, w.precision, w.distributed_optimizer,
                                                     optimizer_states=0)
        if role is not Role.REFERENCE:
            act[role] = [memory.activation_bytes(s, layout, st, micro_batch_tokens=w.micro_batch_tokens,
                                                 seq_len=w.seq_len, recompute=w.recompute, act_bytes=act_bytes)
                         for st in range(layout.pp)]
    r_bytes = memory.itemsize(w.rollout_dtype)
    rollout_w = {(ROLLOUT, "weights"): memory.rollout_weight_bytes(spec, rollout_tp, r_bytes)}
    kv = {(ROLLOUT, "kv cache"): memory.kv_cache_bytes(spec, rollout_tp, r_bytes, w.concurrent_seqs * w.seq_len)}
    transient = {(ROLLOUT, "reshard transient"): memory.reshard_transient_bytes(
        spec, layout, rollout_tp, param_dtype_bytes=act_bytes, rollout_dtype_bytes=r_bytes,
        bucket_bytes=int(w.bucket_mb * 2**20))}
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
        out.append({
            Phase.TRAIN: full(Role.POLICY, state, st) | {(busiest.value, "activations"): act[busiest][st]}
            | resident | reserved,
            Phase.SYNC: policy_w | resident | rollout_w | transient | reserved,
            Phase.GENERATE: resident | rollout_w | kv | reserved,
            Phase.BUILD: full(Role.POLICY, at_build, st) | full(Role.REFERENCE, at_build, st)
            | full(Role.CRITIC, at_build, st) | rollout_w | kv | reserved,
        })
    return out


def reshard_estimate(spec: ModelSpec, layout: ParallelLayout, rollout_tp: int, cluster: Cluster,
                     rollout_dtype: str) -> ReshardEstimate:
    """Per-rank bytes of one weight sync from the resharding plan, split by link, and the lower bound
    on its time: for every rank, max(receive, send) of intra-node bytes / NVLink + inter-node bytes /
    IB (docs/resharding.md §3.4 arithmetic), the slowest rank's."""
    plan = make_plan(spec, layout, rollout_tp, grouping=Grouping.CONSECUTIVE)  # vLLM's groups
    size = memory.itemsize(rollout_dtype)
    world = layout.world_size
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
    received = tuple(a + b for a, b in recv)
    return ReshardEstimate(
        received_max=max(received), received_mean=sum(received) / world, sent_max=max(a + b for a, b in sent),
        slowest_intra=slowest[0], slowest_inter=slowest[1], seconds=seconds(slowest), per_rank_received=received,
    )

# -------------------------------------------------------------------------------------- proposals


def candidate_layouts(spec: ModelSpec, cluster: Cluster, vpp: int | None = None) -> list[tuple[ParallelLayout, int]]:
    """(layout, rollout tp) pairs: tp dividing the GPUs of a node, the heads and the KV groups; pp dividing
    the layers (with vpp) and tp*pp dividing the cluster; dp filling it; rollout tp 1 or tp."""
    out = []
    for tp in _divisors(cluster.gpus_per_node):
        if spec.num_attention_heads % tp or spec.num_query_groups % tp:
            continue
        for pp in _divisors(cluster.world_size // tp):
            v = vpp if pp > 1 else None
            if spec.num_layers % (pp * (v or 1)):
                continue
            layout = ParallelLayout.for_world(cluster.world_size, tp=tp, pp=pp, vpp=v)
            for rollout_tp in sorted({1, tp}, reverse=True):
                try:
                    check_rollout_tp(spec, layout, rollout_tp)
                except LayoutError:
                    continue
                out.append((layout, rollout_tp))
    return out


def propose(spec: ModelSpec, cluster: Cluster, workload: Workload, *, vpp: int | None = None,
            model_name: str = "model") -> list[LayoutPlan]:
    """Every candidate layout that fits, cheapest first: smaller tp*pp (more data parallelism, less
    model-parallel traffic), then larger rollout tp (smaller rollout weights per GPU, more KV room),
    then smaller pp (fewer pipeline bubbles)."""
    return sorted((p for p in _candidate_plans(spec, cluster, workload, vpp, model_name) if p.fits), key=cost)


def closest(spec: ModelSpec, cluster: Cluster, workload: Workload, *, vpp: int | None = None,
            model_name: str = "model") -> LayoutPlan | None:
    """The candidate with the smallest worst-phase peak (what to show when nothing fits)."""
    return min(_candidate_plans(spec, cluster, workload, vpp, model_name), key=lambda p: p.worst.total, default=None)


def _candidate_plans(spec: ModelSpec, cluster: Cluster, workload: Workload, vpp: int | None,
                     model_name: str) -> list[LayoutPlan]:
    pairs = candidate_layouts(spec, cluster, vpp)
    return [plan_layout(spec, cluster, workload, lay, g, model_name) for lay, g in pairs]


def cost(plan: LayoutPlan) -> tuple[int, int, int]:
    return (plan.layout.tp * plan.layout.pp, -plan.rollout_tp, plan.layout.pp)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ------------------------------------------------------------------------------------- text reports

_ROW_ORDER = [(r.value, t) for r in Role for t in ("weights", "grads", "optimizer", "activations")] + [
    (ROLLOUT, "weights"), (ROLLOUT, "kv cache"), (ROLLOUT, "reshard transient"), (RESERVED, "")]

_PHASE_NOTES = {
    Phase.TRAIN: "policy/critic update; rollout engine asleep",
    Phase.SYNC: "policy grads + optimizer offloaded; weights stream into the rollout engine",
    Phase.GENERATE: "policy weights offloaded too; rollout weights + KV cache",
    Phase.BUILD: "vLLM start-up: every engine built, before the first step (no Adam moments yet)",
}


def _gb(n: float) -> str:
    return f"{n / GB:8.2f}"


def header(plan: LayoutPlan) -> list[str]:
    spec, c, w, lay = plan.spec, plan.cluster, plan.workload, plan.layout
    n = spec.num_parameters()
    b, s = micro_batch_shape(w.micro_batch_tokens, w.seq_len)
    return [
        f"{plan.model_name}: {n / 1e9:.2f} B parameters ({2 * n / GB:.1f} GB in bf16), {spec.num_layers} layers, "
        f"hidden {spec.hidden_size}, {spec.num_attention_heads}/{spec.num_query_groups} heads, "
        f"FFN {spec.ffn_hidden_size}, vocab {spec.vocab_size}",
        f"cluster: {c.nodes} x {c.gpus_per_node} GPUs of {c.gpu_mem_gb:g} GB ({c.world_size} GPUs); "
        f"{c.intra_node_gbps:g} GB/s intra-node, {c.inter_node_gbps:g} GB/s inter-node per GPU; "
        f"{c.reserved_gb:g} GB reserved per GPU",
        f"layout: {lay} -> rollout TP{plan.rollout_tp}; roles {', '.join(r.value for r in w.roles)}; "
        f"{w.precision.value}{', distributed optimizer' if w.distributed_optimizer else ''}",
        f"workload: micro-batch {b} x {s} tokens (prompt {w.prompt_tokens} + response {w.response_tokens}), "
        f"{w.recompute.value} recompute; rollout {w.rollout_dtype}, {w.concurrent_seqs} sequences in flight per "
        f"replica, bucket {w.bucket_mb:g} MiB",
    ]


def memory_table(plan: LayoutPlan) -> list[str]:
    phases = list(plan.peaks)
    rows = [k for k in _ROW_ORDER if any(k in p.terms for p in phases)]
    lines = ["GB per GPU (fullest stage)  " + "".join(f"{p.phase.value:>10}" for p in phases),
             " " * 28 + "".join(f"{'stage ' + str(p.stage):>10}" for p in phases)]
    for owner, term in rows:
        label = f"{owner} {term}".strip()
        cells = "".join(f"{_gb(p.terms[(owner, term)]):>10}" if (owner, term) in p.terms else f"{'-':>10}"
                        for p in phases)
        lines.append(f"  {label:<26}{cells}")
    lines.append(f"  {'total':<26}" + "".join(f"{_gb(p.total):>10}" for p in phases))
    lines.append(f"  {'free of ' + format(plan.capacity / GB, 'g'):<26}"
                 + "".join(f"{_gb(plan.capacity - p.total):>10}" for p in phases))
    lines += [f"  {p.phase.value:<9} {_PHASE_NOTES[p.phase]}" for p in phases]
    return lines


def reshard_lines(plan: LayoutPlan) -> list[str]:
    r = plan.reshard
    c = plan.cluster
    return [
        f"resharding per sync ({plan.workload.rollout_dtype}, megarl.resharding.plan): received per GPU max "
        f"{r.received_max / GB:.2f} GB, mean {r.received_mean / GB:.2f} GB; sent max {r.sent_max / GB:.2f} GB",
        f"sync time lower bound: {r.seconds:.2f} s (the slowest GPU moves {r.slowest_intra / GB:.2f} GB intra-node "
        f"at {c.intra_node_gbps:g} GB/s + {r.slowest_inter / GB:.2f} GB inter-node at {c.inter_node_gbps:g} GB/s)",
    ]


def render(plan: LayoutPlan, *, with_reshard: bool = True) -> str:
    """The full report of one layout."""
    lines = header(plan) + [""] + memory_table(plan) + [""]
    if plan.fits:
        lines.append(f"FITS: peak {plan.worst.total / GB:.1f} GB of {plan.capacity / GB:g} GB "
                     f"({plan.worst.phase.value} phase, stage {plan.worst.stage})")
    else:
        lines += ["NOT FITTING:"] + [f"  {r}" for r in plan.reasons]
    if with_reshard:
        lines += reshard_lines(plan)
    lines += ["", "overrides: " + " ".join(plan.overrides())]
    return "\n".join(lines)


def proposals_table(plans: list[LayoutPlan], top: int) -> str:
    lines = [f"{len(plans)} fitting layouts, cheapest first (smaller tp*pp, larger rollout tp, smaller pp):",
             f"  {'layout':<20}{'rollout':>8}" + "".join(f"{p.value:>10}" for p in Phase) + f"{'free':>10}"]
    for p in plans[:top]:
        peaks = {x.phase: x.total for x in p.peaks}
        lines.append(f"  {str(p.layout):<20}{'TP' + str(p.rollout_tp):>8}"
                     + "".join(f"{_gb(peaks[ph]):>10}" for ph in Phase)
                     + f"{_gb(p.capacity - p.worst.total):>10}")
    if len(plans) > top:
        lines.append(f"  ... {len(plans) - top} more")
    return "\n".join(lines)
