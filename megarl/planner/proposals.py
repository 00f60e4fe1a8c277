"""Layout proposals: the candidate layouts of a cluster, those that fit, cheapest first.

Candidates (:func:`candidate_layouts`): tp dividing a node's GPUs and the heads; cp where the sequences warrant it
(:func:`context_parallel_sizes`); pp dividing the layers; dp filling the training pool; for an MoE model every ep
dividing the experts and a stage's tp*cp*dp ranks; rollout tp 1 or tp. :func:`propose` keeps those that fit, in
:func:`cost` order; :func:`closest` gives the least overflowing one when none fits.

Pure module: no torch.distributed, no megatron-core, no Ray; each candidate is planned by
:func:`megarl.planner.layouts.plan_layout`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from megarl.errors import LayoutError
from megarl.models.spec import ModelSpec
from megarl.parallel.layout import ParallelLayout
from megarl.planner.layouts import Cluster, LayoutPlan, Workload, plan_layout
from megarl.resharding.plan import check_rollout_tp


def candidate_layouts(spec: ModelSpec, cluster: Cluster, vpp: int | None = None,
                      cps: tuple[int, ...] = (1,)) -> list[tuple[ParallelLayout, int]]:
    """(layout, rollout tp) pairs: tp dividing the GPUs of a node, the heads and the KV groups; each ``cps`` size
    with tp x cp dividing a node's GPUs (context-parallel groups inside a node); pp dividing the layers (with vpp)
    and tp*cp*pp dividing the training pool; dp filling it; for an MoE model every ep dividing the experts and
    tp*cp*dp (1 for a dense one; at tp > 1 it trains with sequence parallelism, which the memory and traffic models
    account for); rollout tp 1 or tp colocated (vLLM's TP groups lie inside one data-parallel replica), and with split
    placement every tp dividing a node's GPUs and the rollout pool. ``ModelSpec.check_layout`` has the last word on
    each."""
    out = []
    world = cluster.train_gpus
    rollout_tps = set(_divisors(math.gcd(cluster.gpus_per_node, cluster.rollout_gpus))) if cluster.split else None
    node = math.gcd(cluster.gpus_per_node, world)
    for tp, cp in ((tp, cp) for tp in _divisors(node) for cp in cps if node % (tp * cp) == 0):
        if spec.num_attention_heads % tp or spec.num_query_groups % tp:
            continue
        for pp in _divisors(world // (tp * cp)):
            v = vpp if pp > 1 else None
            if spec.num_layers % (pp * (v or 1)):
                continue
            stage_ranks = world // pp
            for ep in _divisors(math.gcd(spec.moe.num_experts, stage_ranks)) if spec.moe else [1]:
                layout = ParallelLayout.for_world(world, tp=tp, pp=pp, vpp=v, ep=ep, cp=cp)
                try:
                    spec.check_layout(layout)
                except LayoutError:
                    continue
                for rollout_tp in sorted(rollout_tps or {1, tp}, reverse=True):
                    try:
                        check_rollout_tp(spec, layout, rollout_tp, cluster.rollout_gpus or None)
                    except LayoutError:
                        continue
                    out.append((layout, rollout_tp))
    return out


def context_parallel_sizes(workload: Workload, cluster: Cluster) -> tuple[int, ...]:
    """The cp sizes worth proposing: 1, and where one sequence is longer than the micro-batch budget (a shorter budget
    no longer cuts its activations) and the engine packs, every cp dividing a node's GPUs up to the one that brings a
    rank's share of the sequence within the budget."""
    w = workload
    if not w.packing or w.seq_len <= w.micro_batch_tokens:
        return (1,)
    most = math.ceil(w.seq_len / w.micro_batch_tokens)
    return tuple(cp for cp in _divisors(cluster.gpus_per_node) if cp <= most)


def propose(spec: ModelSpec, cluster: Cluster, workload: Workload, *, vpp: int | None = None,
            model_name: str = "model") -> list[LayoutPlan]:
    """Every candidate layout that fits, cheapest first: smaller tp*cp*pp (more data parallelism, less
    model-parallel traffic), then smaller ep (less all-to-all traffic; a larger ep only buys memory), then
    larger rollout tp (smaller rollout weights per GPU, more KV room), then smaller pp (fewer pipeline
    bubbles), then smaller cp (context parallelism only where tensor parallelism alone does not fit)."""
    return sorted((p for p in _candidate_plans(spec, cluster, workload, vpp, model_name) if p.fits), key=cost)


def closest(spec: ModelSpec, cluster: Cluster, workload: Workload, *, vpp: int | None = None,
            model_name: str = "model",
            where: Callable[[ParallelLayout, int], bool] | None = None) -> LayoutPlan | None:
    """The candidate with the smallest worst-phase peak (what to show when nothing fits); ``where(layout,
    rollout_tp)``: among the candidates it keeps only (e.g. those with the sizes a config fixes)."""
    return min(_candidate_plans(spec, cluster, workload, vpp, model_name, where), key=lambda p: p.worst.total,
               default=None)


def _candidate_plans(spec: ModelSpec, cluster: Cluster, workload: Workload, vpp: int | None, model_name: str,
                     where: Callable[[ParallelLayout, int], bool] | None = None) -> list[LayoutPlan]:
    pairs = candidate_layouts(spec, cluster, vpp, context_parallel_sizes(workload, cluster))
    return [plan_layout(spec, cluster, workload, lay, g, model_name) for lay, g in pairs
            if where is None or where(lay, g)]


def cost(plan: LayoutPlan) -> tuple[int, int, int, int, int]:
    lay = plan.layout
    return (lay.tp * lay.cp * lay.pp, lay.ep, -plan.rollout_tp, lay.pp, lay.cp)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
