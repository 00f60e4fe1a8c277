"""Benchmark reports: the measured steps of a run -> the HybridFlow / NeMo-RL style table.

Pure (no Ray, no torch.distributed): input is the trainer's per-step metrics (``timing/<stage>_s``
and friends, see :mod:`megarl.trainer.trainer`), the policy ranks' measured resources and the run's
setup; output is a JSON-able dict and markdown. The step time is split into the columns those
papers use; which trainer timer feeds which column:

* generation  -- ``timing/generate_s`` (the rollout engine's decode, measured on the worker)
* weight sync -- ``timing/weight_sync_s + timing/to_train_s`` (the driver's weight-sync stage: resharding
  into the rollout engine, offload around it; and the reload after generation)
* log-probs   -- ``timing/old_log_probs_s`` (the driver's stage for the old log-probs, when recomputed)
* reference, values, reward -- their driver stages
* training    -- ``timing/update_policy_s + timing/update_critic_s``
* other       -- advantages, bookkeeping (callbacks, memory peaks), validation and the rest of the
  rollout stage (Ray dispatch, gathering the replicas' outputs, building the batch)

``coverage`` is the sum of the driver's stage timers over the measured step time: the timers must
cover the whole step (within 5 %), or the split above hides time. ``padding`` is the mean over the measured steps
of ``bench/padding_log_probs`` and ``bench/padding_update`` (:mod:`megarl.bench.padding`): the share of the tokens
the policy's log-prob forward and updates computed that were padding; the log-prob one only where that stage ran.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

DRIVER_STAGES = ("weight_sync", "rollout", "old_log_probs", "reward", "reference", "values", "advantages",
                 "update_critic", "update_policy", "bookkeeping", "validation")
COLUMNS = ("generation", "weight_sync", "log_probs", "reference", "values", "reward", "training", "other")

# dense bf16 tensor-core peak per GPU (vendor datasheets), matched against torch.cuda.get_device_name()
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
                   "A10": 125.0, "L4": 121.0}


@dataclasses.dataclass(frozen=True)
class Setup:
    """What was run, for the report's header and the FLOP estimate."""

    config: str
    overrides: tuple[str, ...]
    workload: str | None
    devices: int
    device_kind: str  # "cpu" or the GPU's name
    train_layout: str  # e.g. "TP2 x PP1 x DP1"
    rollout_layout: str  # e.g. "embedded, TP1 x 2 replicas"
    parameters: int  # policy parameters one token's forward uses (MoE: the active ones)
    num_layers: int
    attention_width: int  # heads * head_dim
    ppo_epochs: int
    has_critic: bool
    warmup: int
    iterations: int
    peak_flops: float | None  # per device; None: no MFU
    peak_flops_source: str


def cpu_description(cpuinfo: str | None = None) -> str:
    """The CPU's model name and widest SIMD (with its bf16 extensions) from /proc/cpuinfo, e.g.
    ``"AMD EPYC 7B13 (AVX2)"``.

    Benchmarks record it: the same script on a 2-core AVX2 EPYC and a 2-core AVX-512 Xeon measures fp32
    matmul rates ~1.5x apart, so results from different sessions only compare on the same kind of CPU.
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return "unknown CPU"
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in cpuinfo.splitlines())}
    flags = set(fields.get("flags", "").split())
    isa = [name for flag, name in (("avx512f", "AVX-512"), ("avx512_bf16", "AVX-512 BF16"), ("amx_bf16", "AMX"))
           if flag in flags] or (["AVX2"] if "avx2" in flags else [])
    return fields.get("model name", "unknown CPU") + (f" ({', '.join(isa)})" if isa else "")


def _t(m: Mapping[str, float], stage: str) -> float:
    return m.get(f"timing/{stage}_s", 0.0)  # an absent stage did not run this step


def breakdown(m: Mapping[str, float]) -> dict[str, float]:
    """One step's seconds per report column (see the module docstring)."""
    gen, sync = _t(m, "generate"), _t(m, "weight_sync") + _t(m, "to_train")
    log_probs = _t(m, "old_log_probs")
    rollout_rest = max(_t(m, "rollout") - gen - _t(m, "to_train"), 0.0)
    return {
        "generation": gen, "weight_sync": sync, "log_probs": log_probs, "reference": _t(m, "reference"),
        "values": _t(m, "values"), "reward": _t(m, "reward"),
        "training": _t(m, "update_policy") + _t(m, "update_critic"),
        "other": _t(m, "advantages") + _t(m, "bookkeeping") + _t(m, "validation") + rollout_rest,
    }


def coverage(m: Mapping[str, float]) -> float:
    """Sum of the driver's stage timers / the step's wall time."""
    return sum(_t(m, s) for s in DRIVER_STAGES) / m["timing/step_s"]


def step_flops(m: Mapping[str, float], s: Setup) -> float:
    """Model FLOPs of one step (an estimate, Megatron/PaLM style): per token, a forward costs
    ``2N + 2 L d s`` (weights, plus causal attention over a mean context of half the mean sequence
    length s, d = heads x head_dim, L layers); a backward twice that. Generated tokens count one
    forward each; every forward pass over the batch (old log-probs, reference, values) one per
    token; each optimizer epoch three (policy, and critic when present)."""
    tokens, seqs = m["batch/tokens"], max(m["batch/num_sequences"], 1.0)
    per_token = 2 * s.parameters + 2 * s.num_layers * s.attention_width * tokens / seqs
    passes = sum(1 for stage in ("old_log_probs", "reference", "values") if f"timing/{stage}_s" in m)
    passes += 3 * s.ppo_epochs * (2 if s.has_critic else 1)
    return per_token * (m.get("rollout/num_tokens", 0.0) + passes * tokens)


def summarize(steps: Sequence[Mapping[str, float]], setup: Setup,
              ranks: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The report: per-column means over the measured steps, throughput, memory, resharding, MFU."""
    if not steps:
        raise ValueError("no measured steps: run at least one iteration after the warm-up")
    mean = statistics.fmean
    step_s = mean(m["timing/step_s"] for m in steps)
    cols = {c: mean(breakdown(m)[c] for m in steps) for c in COLUMNS}
    tokens = mean(m["batch/tokens"] for m in steps)
    flops = mean(step_flops(m, setup) for m in steps)
    out = {
        "setup": dataclasses.asdict(setup),
        "step_s": step_s,
        "step_s_min": min(m["timing/step_s"] for m in steps),
        "step_s_max": max(m["timing/step_s"] for m in steps),
        "stages_s": cols,
        "coverage": mean(coverage(m) for m in steps),
        "coverage_min": min(coverage(m) for m in steps),
        "tokens_per_step": tokens,
        "response_tokens_per_step": mean(m.get("rollout/num_tokens", 0.0) for m in steps),
        "tokens_per_s_per_device": tokens / step_s / setup.devices,
        "padding": {"log_probs": _mean_of(steps, "bench/padding_log_probs", "timing/old_log_probs_s"),
                    "update": _mean_of(steps, "bench/padding_update")},
        "peak_host_gb_per_device": max(m.get("memory/host_peak_gb", 0.0) for m in steps),
        "peak_device_gb_per_device": max(m.get("memory/device_peak_gb", 0.0) for m in steps),
        "reshard_bytes_received_max": max((r["reshard_bytes_received"] for r in ranks), default=0),
        "reshard_bytes_sent_max": max((r["reshard_bytes_sent"] for r in ranks), default=0),
        "model_tflops_per_step": flops / 1e12,
        "mfu": flops / step_s / setup.devices / setup.peak_flops if setup.peak_flops else None,
        "ranks": [dict(r) for r in ranks],
        "steps": [dict(m) for m in steps],
    }
    return out


def _mean_of(steps: Sequence[Mapping[str, float]], key: str, ran: str | None = None) -> float | None:
    """The mean of ``key`` over the steps that have it (and ran the stage timed by ``ran``); None if none has."""
    xs = [m[key] for m in steps if key in m and (ran is None or ran in m)]
    return statistics.fmean(xs) if xs else None


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _mb(n: float) -> str:
    mib = n / 2**20
    return f"{mib:.1f}" if mib >= 10 or mib == 0 else f"{mib:.3g}"


def markdown(report: Mapping[str, Any]) -> str:
    s, c = report["setup"], report["stages_s"]
    mfu = f"{100 * report['mfu']:.1f}%" if report["mfu"] is not None else "n/a"
    peak = report["peak_device_gb_per_device"] or report["peak_host_gb_per_device"]
    pad = report.get("padding") or {"log_probs": None, "update": None}
    lines = [
        f"# megarl benchmark: {s['config']}",
        "",
        f"- overrides: {' '.join(s['overrides']) or '(none)'}; workload preset: {s['workload'] or '(config)'}",
        f"- {s['iterations']} measured iterations after {s['warmup']} warm-up; policy {s['parameters'] / 1e6:.1f} M "
        f"parameters; {report['tokens_per_step']:.0f} tokens per step ({report['response_tokens_per_step']:.0f} "
        "generated)",
        f"- MFU peak: {s['peak_flops_source']}",
        "",
        "| devices | training layout | rollout layout | tokens/s/device | padding log-probs / update | step s "
        "| generation | weight sync | log-probs | reference | values | reward | training | other | peak GB/device "
        "| reshard MiB/rank | MFU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {s['devices']} x {s['device_kind']} | {s['train_layout']} | {s['rollout_layout']} "
        f"| {report['tokens_per_s_per_device']:.1f} | {_pct(pad['log_probs'])} / {_pct(pad['update'])} "
        f"| {report['step_s']:.3f} | "
        + " | ".join(f"{c[k]:.3f}" for k in COLUMNS)
        + f" | {peak:.2f} | {_mb(report['reshard_bytes_received_max'])} | {mfu} |",
        "",
        f"Step time {report['step_s_min']:.3f}-{report['step_s_max']:.3f} s over the measured iterations; the "
        f"stage timers cover {100 * report['coverage']:.1f}% of it (lowest step {100 * report['coverage_min']:.1f}%). "
        "Stage columns are seconds per step; reshard MiB/rank is the most any rank received in one weight sync; "
        "padding: the share of the tokens the policy's log-prob forward and updates computed that were padding "
        "(from the steps' batches and the engine's micro-batch rules).",
    ]
    if report["ranks"]:
        lines += ["", "| rank | coords | params MiB | grads MiB | optimizer MiB | reshard sent MiB "
                  "| reshard received MiB | planned params / grads / optimizer MiB | planned received MiB |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in report["ranks"]:
            coords = " ".join(f"{k}{v}" for k, v in r["coords"].items() if k in ("tp", "pp", "dp"))
            plan = r.get("planned")
            planned = (f"{_mb(plan['params'])} / {_mb(plan['grads'])} / {_mb(plan['optimizer'])}", _mb(plan["received"])
                       ) if plan else ("n/a", "n/a")
            lines.append(f"| {r['rank']} | {coords} | {_mb(r['params'])} | {_mb(r['grads'])} | {_mb(r['optimizer'])} "
                         f"| {_mb(r['reshard_bytes_sent'])} | {_mb(r['reshard_bytes_received'])} | {planned[0]} "
                         f"| {planned[1]} |")
    return "\n".join(lines) + "\n"
