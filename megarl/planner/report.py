"""Text reports of the planner (what ``tools/plan.py`` prints): a layout's header, memory table per pool,
fit verdict, expert-parallel all-to-all traffic (MoE), weight-sync traffic (a LoRA policy's adapter-only sync
too) and config overrides; the proposals table; the predicted step times of the modes. Strings out, nothing
printed; sizes in decimal GB (docs/planner.md).

Pure module: formatting of :mod:`megarl.planner.layouts`, :mod:`megarl.planner.compute`,
:mod:`megarl.planner.packing` and :mod:`megarl.planner.modes` results only.
"""

from __future__ import annotations

from megarl.planner import lora
from megarl.planner.compute import forward_flops_per_token, training_flops_per_token
from megarl.planner.layouts import RESERVED, ROLLOUT, LayoutPlan, Phase, PhasePeak, Pool, Role
from megarl.planner.memory import (
    GB,
    itemsize,
    micro_batch_fill,
    micro_batch_shape,
    param_bytes,
    rollout_weight_bytes,
    sequence_parallel,
)
from megarl.planner.modes import Mode, StageTimes, StepPrediction
from megarl.planner.packing import Alignment, ResponseLengths, expected_padding

_ROW_ORDER = [(r.value, t) for r in Role for t in ("weights", "grads", "optimizer", "activations")] + [
    (Role.POLICY.value, "reshard transient"), (Role.POLICY.value, "merge transient"), (ROLLOUT, "weights"),
    (ROLLOUT, "kv cache"), (ROLLOUT, "kv rounding"),
    (ROLLOUT, "profiled activations"), (ROLLOUT, "cuda graphs"), (ROLLOUT, "runtime"),
    (ROLLOUT, "reshard transient"), (RESERVED, "")]

_PHASE_NOTES = {
    Phase.TRAIN: "policy/critic update; rollout engine asleep (its CUDA graphs stay)",
    Phase.SYNC: "policy grads + optimizer offloaded; weights stream into the rollout engine",
    Phase.GENERATE: "policy weights offloaded too; rollout weights + KV cache",
    Phase.BUILD: "vLLM start-up: every engine built, before the first step (no Adam moments yet)",
}

_SPLIT_NOTES = {
    (Pool.TRAINING, Phase.TRAIN): "policy/critic update; no rollout engine on this pool",
    (Pool.TRAINING, Phase.SYNC): "all state resident; weights leave for the rollout pool through send buffers",
    (Pool.ROLLOUT, Phase.SYNC): "vLLM stays awake: rollout weights + KV cache + receive buffer",
    (Pool.ROLLOUT, Phase.GENERATE): "rollout weights + KV cache",
}


def _gb(n: float) -> str:
    return f"{n / GB:8.2f}"


def _gpus(plan: LayoutPlan, pool: Pool) -> str:
    """``N GPUs (nodes x per node, GPUs a-b)`` of a split placement's pool."""
    c = plan.cluster
    first, n = (0, c.train_gpus) if pool is Pool.TRAINING else (c.train_gpus, c.rollout_gpus)
    nodes, per_node = c.pool_shape(n)
    return f"{n} GPUs ({nodes} x {per_node}, GPUs {first}-{first + n - 1})"


def header(plan: LayoutPlan) -> list[str]:
    spec, c, w, lay = plan.spec, plan.cluster, plan.workload, plan.layout
    n, s = spec.num_parameters(), w.seq_len
    rollout = f"rollout TP{plan.rollout_tp}"
    if c.split:
        rollout += f" x {c.rollout_gpus // plan.rollout_tp} replicas on a pool of their own"
    m = spec.moe
    active = f", {spec.num_active_parameters() / 1e9:.2f} B active per token" if m else ""
    mlp = f"MoE {m.num_experts} experts of FFN {m.ffn_hidden_size}, top {m.top_k}" if m else None
    lines = [
        f"{plan.model_name}: {n / 1e9:.2f} B parameters ({2 * n / GB:.1f} GB in bf16){active}, {spec.num_layers} "
        f"layers, hidden {spec.hidden_size}, {spec.num_attention_heads}/{spec.num_query_groups} heads, "
        f"{mlp or f'FFN {spec.ffn_hidden_size}'}, vocab {spec.vocab_size}",
        f"model FLOPs per token at {s} tokens: forward {forward_flops_per_token(spec, s) / 1e9:.2f} GFLOP "
        f"(2 x {'active ' if m else ''}parameters + attention), training {training_flops_per_token(spec, s) / 1e9:.2f}"
        " GFLOP (x3)",
        f"cluster: {c.nodes} x {c.gpus_per_node} GPUs of {c.gpu_mem_gb:g} GB ({c.world_size} GPUs); "
        f"{c.intra_node_gbps:g} GB/s intra-node, {c.inter_node_gbps:g} GB/s inter-node per GPU; "
        f"{c.reserved_gb:g} GB reserved per GPU",
    ]
    if c.split:
        lines.append(f"split placement: training pool {_gpus(plan, Pool.TRAINING)}, "
                     f"rollout pool {_gpus(plan, Pool.ROLLOUT)}")
    if w.lora is not None:
        lines.append(lora_line(plan))
    return lines + [
        f"layout: {lay} -> {rollout}; roles {', '.join(r.value for r in w.roles)}; "
        f"{w.precision.value}{', distributed optimizer' if w.distributed_optimizer else ''}",
        f"workload: {_micro_batch(plan)}, "
        f"{w.recompute.value} recompute; rollout {w.rollout_dtype}, {w.concurrent_seqs} sequences in flight per "
        f"replica, bucket {w.bucket_mb:g} MiB",
    ]


def _micro_batch(plan: LayoutPlan) -> str:
    w, cp = plan.workload, plan.layout.cp
    seqs = f"prompt {w.prompt_tokens} + response {w.response_tokens}"
    if not w.packing:
        b, s = micro_batch_shape(w.micro_batch_tokens, w.seq_len)
        return f"micro-batch {b} x {s} tokens padded ({seqs})"
    share = f", 1/{cp} on each CP rank" if cp > 1 else ""
    tokens = micro_batch_fill(w.micro_batch_tokens, w.seq_len, True)
    return f"micro-batch {tokens} tokens packed (sequences of {seqs}{share})"


def padding_lines(plan: LayoutPlan, responses: ResponseLengths, sequences: int) -> list[str]:
    """The padding fraction of a rank's pass over ``sequences`` rows of the workload's prompt and ``responses``,
    padded against packed micro-batches, at this layout's alignment (docs/planner.md §12.2)."""
    w, lay = plan.workload, plan.layout
    sp = sequence_parallel(plan.spec, lay.tp)
    t = expected_padding(responses, prompt_tokens=w.prompt_tokens, sequences=sequences,
                         max_tokens=w.micro_batch_tokens, max_size=w.micro_batch_rows,
                         alignment=Alignment.of(lay.tp, lay.cp, sp))
    shape = (f"uniform {responses.low}..{responses.high}" + (f", {100 * responses.at_max:.0f}% at the limit"
                                                             if responses.at_max else ""))
    padded = "impossible at cp > 1 (context parallelism packs)" if lay.cp > 1 else (
        f"padded {100 * t.fraction(False):.1f}% of {t.padded} tokens computed in {t.padded_micro_batches} "
        "micro-batches")
    return [f"padding per rank: {sequences} sequences of prompt {w.prompt_tokens} + responses {shape} (mean "
            f"{responses.mean:.0f}), {t.real} real tokens, micro-batches of {w.micro_batch_tokens} tokens and up to "
            f"{w.micro_batch_rows} rows: {padded}; packed {100 * t.fraction(True):.1f}% of {t.packed} in "
            f"{t.packed_micro_batches}"]


def lora_line(plan: LayoutPlan) -> str:
    """The LoRA policy's adapter: trained parameters (megarl's fused factors, and peft's count) and their bytes."""
    spec, w = plan.spec, plan.workload
    n, peft = lora.adapter_parameters(spec, w.lora), lora.peft_parameters(spec, w.lora)
    p = param_bytes(w.precision)
    return (f"LoRA policy: rank {w.lora.rank} on {', '.join(w.lora.targets)}: {n / 1e6:.2f} M adapter parameters "
            f"({100 * n / spec.num_parameters():.2f} % of the model, {n * p / 1e6:.1f} MB in {w.precision.value}; "
            f"peft's layout {peft / 1e6:.2f} M, one A per projection); base frozen in {w.precision.value}, no "
            f"reference copy (the policy's base is the reference)")


def memory_table(plan: LayoutPlan) -> list[str]:
    if not plan.cluster.split:
        return _table(plan, plan.peaks, "GB per GPU (fullest stage)",
                      {p.phase: _PHASE_NOTES[p.phase] for p in plan.peaks})
    lines = []
    for pool, title in ((Pool.TRAINING, "training pool, fullest stage"), (Pool.ROLLOUT, "rollout pool, GB per GPU")):
        peaks = plan.pool_peaks(pool)
        lines += _table(plan, peaks, title, {p.phase: _SPLIT_NOTES[(pool, p.phase)] for p in peaks},
                        stages=pool is Pool.TRAINING)
    return lines


def _table(plan: LayoutPlan, phases: tuple[PhasePeak, ...], title: str, notes: dict[Phase, str], *,
           stages: bool = True) -> list[str]:
    rows = [k for k in _ROW_ORDER if any(k in p.terms for p in phases)]
    lines = [f"{title:<28}" + "".join(f"{p.phase.value:>10}" for p in phases)]
    if stages:
        lines.append(" " * 28 + "".join(f"{'stage ' + str(p.stage):>10}" for p in phases))
    for owner, term in rows:
        label = f"{owner} {term}".strip()
        cells = "".join(f"{_gb(p.terms[(owner, term)]):>10}" if (owner, term) in p.terms else f"{'-':>10}"
                        for p in phases)
        lines.append(f"  {label:<26}{cells}")
    lines.append(f"  {'total':<26}" + "".join(f"{_gb(p.total):>10}" for p in phases))
    lines.append(f"  {'free of ' + format(plan.capacity / GB, 'g'):<26}"
                 + "".join(f"{_gb(plan.capacity - p.total):>10}" for p in phases))
    lines += [f"  {p.phase.value:<9} {notes[p.phase]}" for p in phases]
    return lines


def reshard_lines(plan: LayoutPlan) -> list[str]:
    r = plan.reshard
    c = plan.cluster
    if c.split:
        head = [f"weight sync between the pools per push ({plan.workload.rollout_dtype}, megarl.resharding.plan): "
                f"{r.total / GB:.2f} GB in all ({r.total_inter / GB:.2f} GB inter-node); each training GPU sends max "
                f"{r.sent_max / GB:.2f} GB, mean {r.sent_mean / GB:.2f} GB; each rollout GPU receives max "
                f"{r.received_max / GB:.2f} GB, mean {r.received_mean / GB:.2f} GB"]
    else:
        head = [f"resharding per sync ({plan.workload.rollout_dtype}, megarl.resharding.plan): received per GPU max "
                f"{r.received_max / GB:.2f} GB, mean {r.received_mean / GB:.2f} GB; sent max {r.sent_max / GB:.2f} GB"]
    return head + [
        f"sync time lower bound: {r.seconds:.2f} s (the slowest GPU moves {r.slowest_intra / GB:.2f} GB intra-node "
        f"at {c.intra_node_gbps:g} GB/s + {r.slowest_inter / GB:.2f} GB inter-node at {c.inter_node_gbps:g} GB/s)",
    ]


def adapter_sync_lines(plan: LayoutPlan) -> list[str]:
    """A LoRA policy's two ways into the rollout engine: merged weights (the plan above) or the adapter alone."""
    w, c = plan.workload, plan.cluster
    if w.lora is None:
        return []
    r_bytes = itemsize(w.rollout_dtype)
    adapter = lora.peft_bytes(plan.spec, w.lora, r_bytes)
    merged = rollout_weight_bytes(plan.spec, plan.rollout_tp, r_bytes)
    gpus = c.rollout_gpus or c.train_gpus  # colocated: a rollout rank on every GPU
    return [f"LoRA sync into each rollout GPU: merged weights as a full sync, its {merged / GB:.2f} GB shard of the "
            f"model (of which the plan above moves up to {plan.reshard.received_max / GB:.2f} GB from other GPUs); "
            f"adapter only (vLLM's LoRA support, peft layout, {w.rollout_dtype}): {adapter / 1e6:.1f} MB, the whole "
            f"adapter (each rollout worker loads it and keeps its TP slice), {gpus * adapter / GB:.2f} GB to all "
            f"{gpus}"]


def expert_traffic_lines(plan: LayoutPlan) -> list[str]:
    """The expert-parallel all-to-all of one micro-batch (MoE models only; docs/planner.md §10)."""
    if plan.spec.moe is None:
        return []
    t, c = plan.expert_traffic, plan.cluster
    if plan.layout.ep == 1:
        return ["expert parallelism 1: every GPU holds all experts, no all-to-all"]
    routed = (f"{t.tokens} tokens routed per GPU (1/{plan.layout.tp} of each, sequence parallelism)"
              if sequence_parallel(plan.spec, plan.layout.tp) else f"{t.tokens} tokens")
    return [f"expert-parallel all-to-all (EP{t.ep}, {plan.workload.precision.value}) per micro-batch of {routed}"
            f": each GPU sends and receives {t.alltoall / GB:.3f} GB per all-to-all (tokens x top-k x hidden x "
            f"bytes x (ep-1)/ep), x4 per MoE layer (dispatch + combine, forward + backward) = {t.per_layer / GB:.3f} "
            f"GB, x{t.layers} layers per stage = {t.per_micro_batch / GB:.2f} GB; time lower bound {t.seconds:.3f} s "
            f"({t.slowest_intra / GB:.2f} GB intra-node at {c.intra_node_gbps:g} GB/s + "
            f"{t.slowest_inter / GB:.2f} GB inter-node at {c.inter_node_gbps:g} GB/s)"]


def render(plan: LayoutPlan, *, with_reshard: bool = True) -> str:
    """The full report of one layout."""
    lines = header(plan) + [""] + memory_table(plan) + [""]
    if plan.fits:
        w = plan.worst
        where = f"{w.phase.value} phase, stage {w.stage}"
        if plan.cluster.split:
            where = f"{w.pool.value} pool, " + (where if w.pool is Pool.TRAINING else f"{w.phase.value} phase")
        lines.append(f"FITS: peak {w.total / GB:.1f} GB of {plan.capacity / GB:g} GB ({where})")
    else:
        lines += ["NOT FITTING:"] + [f"  {r}" for r in plan.reasons]
    lines += expert_traffic_lines(plan)
    if with_reshard:
        lines += reshard_lines(plan) + adapter_sync_lines(plan)
    lines += ["", "overrides: " + " ".join(plan.overrides())]
    return "\n".join(lines)


def proposals_table(plans: list[LayoutPlan], top: int) -> str:
    """The fitting layouts, one line each: the peak of every phase (split: ``r.`` the rollout pool's)."""
    split = bool(plans) and plans[0].cluster.split
    keys = [(p.pool, p.phase) for p in plans[0].peaks] if split else [(Pool.TRAINING, ph) for ph in Phase]
    width = 11 if split else 10
    label = {k: ("r." if k[0] is Pool.ROLLOUT else "") + k[1].value for k in keys}
    ep = ", smaller ep" if plans and plans[0].spec.moe else ""
    cp = any(p.layout.cp > 1 for p in plans)
    lines = [f"{len(plans)} fitting layouts, cheapest first (smaller tp*{'cp*' if cp else ''}pp{ep}, larger rollout "
             f"tp, smaller pp{', smaller cp' if cp else ''}"
             + ("; r.: the rollout pool):" if split else "):"),
             f"  {'layout':<22}{'rollout':>8}" + "".join(f"{label[k]:>{width}}" for k in keys) + f"{'free':>10}"]
    for p in plans[:top]:
        peaks = {(x.pool, x.phase): x.total for x in p.peaks}
        lines.append(f"  {str(p.layout):<22}{'TP' + str(p.rollout_tp):>8}"
                     + "".join(f"{_gb(peaks[k]):>{width}}" for k in keys)
                     + f"{_gb(p.capacity - p.worst.total):>10}")
    if len(plans) > top:
        lines.append(f"  ... {len(plans) - top} more")
    return "\n".join(lines)


def step_time_lines(times: StageTimes, predictions: list[StepPrediction], *, sync_source: str = "given") -> list[str]:
    """The predicted step of every mode, and its speed-up over ``sync`` (docs/planner.md §8)."""
    sync = next(p.step_s for p in predictions if p.mode is Mode.SYNC)
    push = next((p.push_every for p in predictions if p.mode is Mode.ASYNC), None)
    lines = [f"predicted step (ideal overlap) from stage times: generation {times.gen_s:g} s + reward "
             f"{times.reward_s:g} s, training {times.train_s:g} s, weight sync {times.sync_s:.3g} s ({sync_source})"
             + (f"; async pushes every {push} updates" if push else ""),
             f"  {'mode':<14}{'step s':>10}{'vs sync':>10}{'training pool busy':>20}{'rollout pool busy':>19}"]
    for p in predictions:
        lines.append(f"  {p.mode.value:<14}{p.step_s:>10.2f}{sync / p.step_s:>9.2f}x{100 * p.train_busy:>19.0f}%"
                     f"{100 * p.rollout_busy:>18.0f}%")
    return lines
