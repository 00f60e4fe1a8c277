"""Run a training config for warm-up + N measured iterations and report where the time goes.

The run is the real trainer (:class:`megarl.trainer.trainer.Trainer`) on the config's own workers,
so the same command measures the tiny CPU example and a 70B cluster job. Differences from
``megarl train``: no checkpoint is written, validation is off, it never resumes. After the run:
each policy rank's measured training-state bytes and weight-sync traffic (next to what the planner,
:mod:`megarl.planner`, predicts for that rank), and with ``trace`` a Chrome/Perfetto trace of the
measured iterations with one track for the driver and one per worker process. Each measured step also gets the
padding fraction of the policy's log-prob forward and updates, computed from the step's batch with the engine's
micro-batch rules (:mod:`megarl.bench.padding`: the workers do not return the engine's ``last_padding_fraction``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from megarl.bench import padding, report
from megarl.checkpoint.format import read_meta
from megarl.config.train import TrainConfig, load_config
from megarl.controller.spec import Device
from megarl.errors import ConfigError
from megarl.metrics import trace
from megarl.models.spec import ModelSpec, spec_from_hf_config
from megarl.trainer.trainer import Trainer

logger = logging.getLogger(__name__)

# workload presets: config overrides. HybridFlow's PPO throughput workload (Sheng et al. 2024, sec. 8):
# 1024 prompts per batch, prompts up to 1024 tokens, 1024-token responses (no early stop).
WORKLOADS: dict[str, tuple[str, ...]] = {
    "hybridflow": ("data.batch_size=1024", "data.max_prompt_length=1024", "rollout.max_new_tokens=1024",
                   "rollout.stop_at_eos=false", "rollout.stop_token_ids=[]"),
}


@dataclasses.dataclass(frozen=True)
class BenchmarkOptions:
    warmup: int = 2
    iterations: int = 5
    workload: str | None = None  # a WORKLOADS key
    trace_file: str | None = None
    peak_tflops: float | None = None  # per device; default: the GPU's datasheet value, or one CPU core measured

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.iterations < 1:
            raise ConfigError(f"need warmup >= 0 and iterations >= 1, found {self.warmup} and {self.iterations}.")
        if self.workload is not None and self.workload not in WORKLOADS:
            raise ConfigError(f"unknown workload {self.workload!r}; known: {sorted(WORKLOADS)}.")


class _NoCheckpointTrainer(Trainer):
    def save(self) -> None:  # a benchmark measures steps; it leaves nothing to resume from
        return None


class _Collector:
    """Keeps the measured steps' metrics, each with its batch's padding fractions (``padding_of``: the sequence
    lengths -> :class:`~megarl.bench.padding.StepPadding`); turns tracing on once the warm-up is over."""

    def __init__(self, warmup: int, tracing: bool,
                 padding_of: Callable[[list[int]], padding.StepPadding] | None = None) -> None:
        self.warmup, self.tracing, self.padding_of = warmup, tracing, padding_of
        self.steps: list[dict[str, float]] = []
        self.groups: list = []
        self.pending: dict[str, float] = {}  # the current step's padding, from its "step" notice

    def start_tracing(self) -> None:
        if self.tracing:
            trace.enable(True)
            for g in self.groups:
                g.set_tracing(True)

    def on_stage_end(self, stage: str, step: int, batch) -> None:
        if stage == "step" and self.padding_of is not None and step > self.warmup:
            self.pending = self.padding_of(batch["attention_mask"].sum(-1).long().tolist()).metrics()

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        if step > self.warmup:
            self.steps.append(dict(metrics) | self.pending)
            self.pending = {}
        elif step == self.warmup:
            self.start_tracing()


def run_benchmark(config: str | Path, overrides: Sequence[str], out_dir: str | Path,
                  options: BenchmarkOptions = BenchmarkOptions()) -> dict[str, Any]:
    """Run, write ``<out_dir>/benchmark.json`` and ``benchmark.md`` (and the trace); return the report."""
    out = Path(out_dir)
    forced = (f"trainer.total_steps={options.warmup + options.iterations}", "trainer.val_every=0",
              "trainer.resume=false", f"trainer.output_dir={out / 'run'}")
    user = tuple(WORKLOADS[options.workload] if options.workload else ()) + tuple(overrides)
    cfg = load_config(config, [*user, *forced])
    peak, peak_source = _peak_flops(cfg, options.peak_tflops)
    collector = _Collector(options.warmup, options.trace_file is not None)
    trainer = _NoCheckpointTrainer(cfg, (collector,))
    cfg = trainer.cfg  # resolved: layout sizes left auto are decided (issue #47)
    try:
        collector.padding_of = _padding_of(cfg, trainer)
        groups = list(trainer.cluster.placement.groups.values())
        collector.groups = groups
        if options.warmup == 0:
            collector.start_tracing()
        trainer.fit()
        if options.trace_file is not None:  # before the calls below, which are not part of a step
            tracks = {"driver": trace.drain()}
            for g in groups:
                for ctx, events in zip(g.contexts, g.drain_trace(), strict=True):
                    c = ctx.coords
                    tracks[f"{g.name} rank {ctx.rank} (tp{c.tp} pp{c.pp} dp{c.dp}) pid {ctx.pid}"] = events
            trace.write_chrome_trace(options.trace_file, tracks)
            trace.enable(False)
            for g in groups:
                g.set_tracing(False)
        from megarl.roles.policy import PolicyRole

        ranks = [dataclasses.asdict(r) for r in trainer.cluster.policy.all(PolicyRole.resources)]
        spec = spec_from_hf_config(read_meta(trainer.cluster.source).hf_config)
    finally:
        trainer.close()
    _add_planned(ranks, spec, cfg)
    setup = _setup(cfg, spec, config, user, options, peak, peak_source)
    result = report.summarize(collector.steps, setup, ranks)
    out.mkdir(parents=True, exist_ok=True)
    (out / "benchmark.json").write_text(json.dumps(result, indent=1))
    (out / "benchmark.md").write_text(report.markdown(result))
    return result


def _padding_of(cfg: TrainConfig, trainer: Trainer) -> Callable[[list[int]], padding.StepPadding]:
    """A step's padding from its lengths, by the policy's config and layout (the model read once: MoE or dense)."""
    moe: list[bool] = []

    def of(lengths: list[int]) -> padding.StepPadding:
        if not moe:  # the initial checkpoint exists once the run has started
            moe.append(spec_from_hf_config(read_meta(trainer.cluster.source).hf_config).moe is not None)
        return padding.step_padding(lengths, cfg.policy, cfg.algorithm, cfg.cluster.layout(), moe[0])

    return of


def _setup(cfg: TrainConfig, spec: ModelSpec, config: str | Path, overrides: tuple[str, ...],
           options: BenchmarkOptions, peak: float | None, peak_source: str) -> report.Setup:
    layout, r = cfg.cluster.layout(), cfg.rollout.engine
    devices = layout.world_size
    on_gpu = cfg.cluster.pool().device is not Device.CPU and torch.cuda.is_available()
    kind = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    return report.Setup(
        config=str(config), overrides=overrides, workload=options.workload, devices=devices, device_kind=kind,
        train_layout=f"TP{layout.tp} x PP{layout.pp} x DP{layout.dp}",
        rollout_layout=f"{r.backend.value}, TP{r.tp} x {devices // r.tp} replicas",
        parameters=spec.num_active_parameters(), num_layers=spec.num_layers,
        attention_width=spec.num_attention_heads * spec.head_dim, ppo_epochs=cfg.algorithm.ppo_epochs,
        has_critic=cfg.algorithm.needs_critic, warmup=options.warmup, iterations=options.iterations,
        peak_flops=peak, peak_flops_source=peak_source,
    )


def _add_planned(ranks: list[dict[str, Any]], spec: ModelSpec, cfg: TrainConfig) -> None:
    """Next to each rank's measurement: the planner's training-state bytes and weight-sync receive bytes."""
    from megarl.planner import layouts, training_state_bytes

    layout, p = cfg.cluster.layout(), cfg.policy
    on_gpu = cfg.cluster.pool().device is not Device.CPU and torch.cuda.is_available()
    states = training_state_bytes(spec, layout, p.precision.resolve(cuda=on_gpu), p.optim.use_distributed_optimizer)
    pool, rollout = cfg.cluster.pool(), cfg.rollout.engine
    cluster = layouts.Cluster(nodes=pool.nodes, gpus_per_node=pool.devices_per_node, gpu_mem_gb=1.0)
    received = layouts.reshard_estimate(spec, layout, rollout.tp, cluster,
                                        rollout.dtype.resolve(cuda=on_gpu).value).per_rank_received
    for r in ranks:
        s = states[r["coords"]["pp"]]
        r["planned"] = {"params": s.params, "grads": s.grads, "optimizer": s.optimizer, "received": received[r["rank"]]}


def _peak_flops(cfg: TrainConfig, peak_tflops: float | None) -> tuple[float | None, str]:
    if peak_tflops is not None:
        return peak_tflops * 1e12, f"{peak_tflops} TFLOP/s per device (given)"
    if cfg.cluster.pool().device is not Device.CPU and torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        for key, tflops in report.GPU_PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12, f"{name}: {tflops} dense bf16 TFLOP/s (datasheet)"
        return None, f"{name}: unknown peak; pass --peak-tflops for an MFU"
    threads = max(1, round(cfg.cluster.pool().cpus_per_device))
    rate = measure_matmul_flops(threads)
    return rate, f"fp32 matmul rate measured on {threads} CPU thread(s) before the run: {rate / 1e9:.1f} GFLOP/s"


def measure_matmul_flops(threads: int, n: int = 1024, seconds: float = 1.0) -> float:
    """Best FLOP/s of an fp32 n x n matmul on ``threads`` threads (the CPU device's practical peak)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        best, end = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            start = time.perf_counter()
            a @ b
            best = max(best, 2 * n**3 / (time.perf_counter() - start))
        return best
    finally:
        torch.set_num_threads(before)
