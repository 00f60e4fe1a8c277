"""GRPO on CPU: megarl against HuggingFace TRL's ``GRPOTrainer`` on the same model, prompts and settings (#6).

    .venv/bin/python benchmarks/grpo_cpu.py [--cases tiny,30m] [--repeats tiny=3,30m=2] [--wait-load 1.5]
        [--trl-python .venv-trl/bin/python] [--launcher ray|local] [--results FILE]

The TRL side runs in its own virtualenv (benchmarks/requirements-trl.txt says how to make it); this file
is also its entry point (``--trl-worker SPEC.json``), so nothing megarl is imported on that side.

Cases, both the addition task of ``examples/grpo_addition_tiny`` (``a+b=`` prompts, character
tokenizer, same HF model directory for both sides):

- ``tiny``: the example's random Qwen2 model (hidden 64, 2 layers), one-token responses ending at eos;
- ``30m``: hidden 512, 8 layers, MLP 2048 (~31.5M parameters), 64-token responses, no stop token
  (megarl ``rollout.stop_at_eos=false``: eos is sampled and generation goes on; TRL's generate is given no eos
  and the worker empties the trainer's ``eos_token_ids``, so it neither stops nor masks after an eos).

Both sides do the same work: the example's settings, read from megarl's resolved config (:func:`trl_args` maps
them; what TRL cannot express is asserted equal to TRL's fixed behaviour, ``TRL_BEHAVIOUR`` sets it on megarl's
side): 16 prompts x n=16 per step, temperature 1, AdamW (lr 2e-3, no weight decay, clip 1.0, constant LR), k3 KL
loss 0.001 unclamped with TRL's bias correction, 1e-4 on the group std, no rollout-mismatch weights,
entropy bonus 0.01, clip 0.2, token-mean loss, **one optimizer step per generation batch**
(megarl ``algorithm.mini_batches=1``; TRL ``num_iterations=1``, ``steps_per_generation`` =
``gradient_accumulation_steps``), the same update micro-batches of 64 rows, fp32, no recomputation.
Forward-only passes (reference log-probs) are micro-batched as each system does by default: TRL by
``per_device_train_batch_size`` (64 rows), megarl by ``policy.forward_micro_batch`` (default: the update's
8192-token budget with 4x its rows: one micro-batch of 256 rows for ``tiny``, 120 + 120 + 16 for ``30m``).

Same 2 cores for both: megarl runs 2 Ray worker processes (policy + colocated reference; TP2 for
``30m``, TP1 x DP2 for ``tiny``, where TP's per-layer all-reduces cost more than the model), 1 torch
thread each as Ray sets ``OMP_NUM_THREADS`` for 1-CPU actors, plus the
driver); with ``--launcher local`` megarl runs policy and reference in the driver process with 2 torch
threads, like TRL, which runs one process with 2 torch threads. megarl decodes all 256 rows at once
(``rollout.engine.max_batch_size=256``), as TRL generates the whole batch. Runs alternate (megarl, TRL, megarl,
TRL, ...), each a fresh subprocess. Measured per run, after ``warmup`` steps (start-up excluded):

- step time: megarl's ``timing/step_s``; TRL's wall time from ``on_step_begin`` to ``on_step_end``
  (generation, rewards, reference log-probs, forward/backward of every micro-batch, optimizer step;
  logging excluded on both sides);
- generated tokens/s: response tokens of the step (rows x mean length) / step time;
- peak memory: every ~50 ms the parent sums the RSS of all processes whose environment carries this
  run's token (``GRPO_CPU_BENCH_RUN``): the driver and everything started from it, which for megarl
  includes Ray's GCS, raylet, agents, idle and actor workers (children of raylet, not of the driver)
  and the one-time HF -> Megatron conversion process. RSS counts shared pages (libtorch, ...) once
  per process, so an estimate of the memory the run really holds is reported too: the sum of each
  process's anonymous (private) RSS plus the largest file-backed/shared RSS of any one process
  (``/proc/PID/statm``; PSS from ``smaps_rollup`` costs ~0.15 s per GB-sized process per read, too
  much to sample on 2 busy cores).

The report also puts each case against its matmul floor: the step's weight-matmul FLOPs (:func:`step_flops`)
at this machine's fp32 ``torch.mm`` rate on the model's own layer shapes, measured just before every run
(:func:`matmul_rates`), i.e. the step time of an implementation doing nothing else, and the lowest
megarl / TRL ratio any implementation of the same work could reach.

What still differs is listed by :func:`remaining_differences` in every results file. Two more modes
(:mod:`grpo_parity`, beside this file) show the equality: ``--replay N`` trains TRL on megarl's recorded
rollouts and compares loss, grad norm and weights after each of N steps; ``--learning SEEDS,STEPS`` trains both
on the tiny task over several seeds and compares reward, entropy and greedy accuracy.

Before the first run the script waits (up to ``--max-wait`` s) for the 1-minute load average to drop
below ``--wait-load``. Writes benchmarks/results/grpo_cpu-<date>.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo_addition_tiny" / "config.yaml"
MARKER = "GRPO_CPU_BENCH_RUN"
logger = logging.getLogger("bench.grpo_cpu")


@dataclasses.dataclass(frozen=True)
class Case:
    model: dict  # make_model keyword arguments
    max_new_tokens: int
    stop_at_eos: bool
    warmup: int  # steps excluded from the timing (first-call costs)
    steps: int  # measured steps
    tp: int = 2  # megarl's policy/reference TP over the 2 worker processes (the rest is DP)
    launcher: str = "ray"  # "local": megarl's one rank in the driver process, 2 torch threads (tp ignored)

    def layout(self) -> str:
        return "local: 1 process, 2 threads" if self.launcher == "local" else f"TP{self.tp} x DP{2 // self.tp}"


CASES = {
    # tiny: TP2's 28 gloo all-reduces per forward cost more than the model (0.53 -> 0.26 s per step at TP1 x DP2)
    "tiny": Case({}, 1, True, warmup=3, steps=100, tp=1),
    "30m": Case(dict(hidden_size=512, num_layers=8, intermediate_size=2048, max_position_embeddings=128), 64, False,
                warmup=1, steps=2),
}
PROMPT_TOKENS = 4  # "a+b=" with single digits, one token per character
# megarl / TRL step time: (target, goal) per case; peak memory (#27): at most MEMORY_TARGET x TRL's on the 30m case
TARGETS = {"tiny": (0.9, 0.9), "30m": (1.0, 0.8)}
MEMORY_TARGET = {"30m": 0.8}


# ------------------------------------------------------------------------------------ memory


class TreeSampler(threading.Thread):
    """Per-process RSS and its shared (file-backed + shmem) part, every ``interval`` s, of this run.

    A process belongs to the run when it is ``root`` (the launched command) or its environment holds
    ``MARKER=token``. A new pid that does not (yet) is re-read for ``PENDING_S``: between fork and exec
    a child still shows its parent's environment. Pid reuse within a run is ignored."""

    PENDING_S = 5.0

    def __init__(self, token: str, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        import psutil

        from megarl.host.allocator import loaded

        self._psutil, self._allocator, self.token, self.interval = psutil, loaded, token, interval
        self._stop_event = threading.Event()
        self._other: set[int] = self._pids()  # everything alive before the run is not ours
        self._members: dict[int, object] = {}
        self._pending: dict[int, float] = {}  # pid -> first seen (not ours so far)
        self.root: int | None = None
        self.samples: list[tuple[float, dict[int, tuple[int, int]]]] = []  # (time, {pid: (RSS, shared) bytes})
        self.labels: dict[int, str] = {}
        self.omp_threads: dict[int, str] = {}  # pid -> OMP_NUM_THREADS in its environment ("-": unset)
        self.thread_cpu: dict[int, list[float]] = {}  # pid -> CPU seconds of each thread (last read)
        self.allocator: dict[int, str] = {}  # pid -> malloc mapped into it (last read): jemalloc, tcmalloc or glibc

    @staticmethod
    def _pids() -> set[int]:
        return {int(p) for p in os.listdir("/proc") if p.isdigit()}

    def _admit(self, pid: int, now: float) -> None:
        try:
            proc = self._psutil.Process(pid)
            env = proc.environ()
            if env.get(MARKER) == self.token or pid == self.root:
                self._members[pid] = proc
                self._pending.pop(pid, None)
                self.omp_threads[pid] = env.get("OMP_NUM_THREADS", "-")
                self._label(pid, proc)
                return
        except self._psutil.NoSuchProcess:
            self._pending.pop(pid, None)
            self._other.add(pid)
            return
        except (self._psutil.Error, OSError):
            pass
        if now - self._pending.setdefault(pid, now) > self.PENDING_S:
            del self._pending[pid]
            self._other.add(pid)

    def _label(self, pid: int, proc) -> None:
        """What the process is (re-read every second: forked children exec, Ray workers retitle themselves)."""
        try:
            text = " ".join(" ".join(proc.cmdline()).split())
        except self._psutil.Error:
            return
        if text.startswith("ray::"):
            label = text.split()[0]
        elif "multiprocessing" in text:
            label = "multiprocessing child (spawn)"
        elif "default_worker.py" in text:
            label = "ray worker (starting)"
        else:
            words = [Path(w).name for w in text.split() if not w.startswith("-")]
            label = " ".join(words[:3])
        self.labels[pid] = label[:48]
        with contextlib.suppress(self._psutil.Error):
            self.thread_cpu[pid] = sorted((t.user_time + t.system_time for t in proc.threads()), reverse=True)
        self.allocator[pid] = {"system": "glibc"}.get(name := str(self._allocator(pid)), name)

    def busy_threads(self, pid: int) -> int:
        """Threads that used >= 15% of the busiest thread's CPU time (compute threads: OpenMP, main)."""
        cpu = self.thread_cpu.get(pid) or [0.0]
        return sum(c >= 0.15 * cpu[0] for c in cpu) if cpu[0] > 1.0 else 0

    def sample(self, relabel: bool) -> None:
        now = time.time()
        for pid in self._pids() - self._other - self._members.keys():
            self._admit(pid, now)
        mem = {}
        for pid, proc in list(self._members.items()):
            try:
                info = proc.memory_info()
            except self._psutil.Error:
                del self._members[pid]
                continue
            mem[pid] = (info.rss, info.shared)
            if relabel:
                self._label(pid, proc)
        self.samples.append((time.time(), mem))

    def run(self) -> None:
        i = 0
        while not self._stop_event.is_set():
            self.sample(relabel=i % 20 == 0)
            i += 1
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def peak(self, t0: float = 0.0, t1: float = math.inf) -> tuple[int, list[tuple[int, str]]]:
        """Highest RSS sum in [t0, t1] and the processes' RSS at that moment (largest first)."""
        window = [(sum(r for r, _ in m.values()), m) for t, m in self.samples if t0 <= t <= t1]
        if not window:
            return 0, []
        total, at = max(window, key=lambda w: w[0])
        return total, sorted(((r, self.labels.get(p, "?")) for p, (r, _) in at.items()), reverse=True)

    def peak_private(self, t0: float = 0.0, t1: float = math.inf) -> int:
        """Highest (sum of anonymous RSS + the largest shared RSS) in [t0, t1]."""
        return max((sum(r - sh for r, sh in m.values()) + max((sh for _, sh in m.values()), default=0)
                    for t, m in self.samples if t0 <= t <= t1), default=0)

    def series(self, every: float = 1.0) -> list[tuple[float, float]]:
        """(time, RSS sum GB), one point per ``every`` s (the maximum within it), for the results JSON."""
        out: dict[int, float] = {}
        for t, m in self.samples:
            k = int(t // every)
            out[k] = max(out.get(k, 0.0), sum(r for r, _ in m.values()) / 1e9)
        return [(k * every, round(v, 3)) for k, v in sorted(out.items())]

    def max_processes(self) -> int:
        return max((len(r) for _, r in self.samples), default=0)


# -------------------------------------------------------------------------------------- runs


@dataclasses.dataclass
class RunResult:
    side: str
    case: str
    repeat: int
    step_s: list[float]  # measured steps
    tokens_per_s: list[float]
    stages: dict[str, float]  # median seconds per stage over the measured steps
    peak_rss: int  # RSS sum, from start to the end of the last step (megarl's end-of-run save excluded)
    peak_rss_all: int  # the same over the whole run (megarl: + the final checkpoint save and shut-down)
    peak_priv: int  # sum of anonymous RSS + the largest shared RSS, from start to the end of the last step
    steady_rss: int  # RSS sum during the measured steps
    steady_priv: int
    max_procs: int
    peak_procs: list[tuple[int, str]]  # (RSS, process) at the peak_rss moment
    steady_procs: list[tuple[int, str]]  # at the steady_rss moment
    load: tuple[float, float]  # 1-min load average at start and end
    wall_s: float
    omp_threads: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # label -> OMP_NUM_THREADS seen
    allocators: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # label -> malloc of each process
    series: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # (time, RSS sum GB) per second
    steps_at: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # measured steps' (start, end)
    sampler_cpu: float = 0.0  # CPU share of one core the parent (the memory sampler) used during the run
    worker_peak_gb: float | None = None  # megarl's own memory/host_peak_gb (busiest worker), max over steps
    matmul_gflops: dict[str, float] = dataclasses.field(default_factory=dict)  # matmul_rates() just before the run


def megarl_overrides(task: Path, case: Case, out: Path) -> list[str]:
    pool = "cluster.pools.main"
    cluster = (["cluster.launcher=local", f"{pool}.devices_per_node=1", f"{pool}.tp=1"] if case.launcher == "local"
               else [f"{pool}.tp={case.tp}"])
    return [*cluster, f"model.path={task / 'model'}", f"data.train={task / 'train.jsonl'}",
            f"data.val={task / 'val.jsonl'}",
            "rollout.engine.max_batch_size=256",  # all 16 x 16 rows at once, as TRL does
            f"trainer.output_dir={out}", f"trainer.total_steps={case.warmup + case.steps}", "trainer.save_every=0",
            "trainer.val_every=0", "trainer.tensorboard=false", "algorithm.mini_batches=1",
            f"rollout.max_new_tokens={case.max_new_tokens}", f"rollout.stop_at_eos={str(case.stop_at_eos).lower()}",
            *TRL_BEHAVIOUR]


# What megarl sets to compute what TRL 1.16's GRPOTrainer computes (docs/trl.md, "Defaults that differ"):
# TRL's bias-corrected, unclamped k3 KL, its fixed 1e-4 on the group std, and no rollout-mismatch weights
# (TRL weights only vLLM's samples; megarl's default TIS weights are 1 to within 1e-5 on CPU, not exactly 1).
TRL_BEHAVIOUR = ("algorithm.kl_loss_bias_correction=true", "algorithm.kl_clamp=false", "algorithm.advantage.eps=1e-4",
                 "algorithm.rollout_correction.truncate=null")
TRL_ADVANTAGE_EPS = 1e-4  # TRL adds this to the std (grpo_trainer.py: `std_rewards + 1e-4`); not a GRPOConfig field


def trl_args(cfg, case: Case) -> dict:
    """TRL GRPOConfig keyword arguments equal to megarl's resolved ``cfg`` (raises where TRL differs).

    What TRL has an option for is mapped from ``cfg``; what it computes one way only (k3 KL without clamps,
    1e-4 on the std, no importance weights without vLLM, one optimizer step per generation, ...) must be
    what ``cfg`` asks for. Not covered here: ``case.stop_at_eos=False`` also needs the TRL worker to count
    tokens after a sampled eos (:func:`trl_worker`, ``ignore_eos`` in its spec)."""
    from megarl.algos.kl import KLEstimator
    from megarl.algos.ops import LossAggregation
    from megarl.engine.config import LRDecay, OptimizerName, Precision

    a, o, r, mb = cfg.algorithm, cfg.policy.optim, cfg.rollout.sampling, cfg.policy.micro_batch
    fixed = {"advantage.estimator": (a.advantage.estimator, "grpo"),
             "advantage.eps": (a.advantage.eps, TRL_ADVANTAGE_EPS),
             "policy_loss.loss": (a.policy_loss.loss, "ppo_clip"),
             "kl_estimator": (a.kl_estimator, KLEstimator.K3), "aggregation": (a.policy_loss.aggregation,
             LossAggregation.TOKEN_MEAN), "optimizer": (o.optimizer, OptimizerName.ADAM), "lr_decay": (o.lr_decay,
             LRDecay.CONSTANT), "lr_warmup_steps": (o.lr_warmup_steps, 0), "ppo_epochs": (a.ppo_epochs, 1),
             "mini_batches": (a.mini_batches, 1),
             "precision": (cfg.policy.precision.resolve(cuda=False), Precision.FP32),  # auto: fp32 on the CPU
             "kl_penalty": (a.kl_penalty, None), "dual clip": (a.policy_loss.clip_ratio_c, None),
             "rollout_correction active": (a.rollout_correction.active, False),
             "dynamic_sampling": (a.dynamic_sampling, None), "min_p": (r.min_p, 0.0),
             "repetition_penalty": (r.repetition_penalty, 1.0)}
    if a.kl_loss_coef:
        fixed["kl_clamp"] = (a.kl_clamp, False)
    for name, (found, want) in fixed.items():
        if found != want:
            raise SystemExit(f"megarl {name}={found} has no TRL equivalent here (TRL: {want}).")
    rows = cfg.data.batch_size * r.n
    seq = PROMPT_TOKENS + case.max_new_tokens
    micro = min(mb.max_size, mb.max_tokens // seq)
    if rows % micro:
        raise SystemExit(f"{rows} rows per step do not split into micro-batches of {micro}")
    accum = rows // micro
    args = dict(
        per_device_train_batch_size=micro, gradient_accumulation_steps=accum, steps_per_generation=accum,
        num_iterations=a.ppo_epochs, num_generations=r.n, max_completion_length=case.max_new_tokens,
        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, learning_rate=o.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2,
        adam_epsilon=o.adam_eps, max_grad_norm=o.clip_grad, beta=a.kl_loss_coef, epsilon=a.policy_loss.clip_low,
        epsilon_high=a.policy_loss.clip_high, loss_type="dapo", scale_rewards=a.advantage.scale_rewards.value,
        use_bias_correction_kl=a.kl_loss_bias_correction, top_entropy_quantile=a.top_entropy_quantile,
        mask_truncated_completions=a.mask_truncated,
        entropy_coef=a.entropy_coef, seed=cfg.trainer.seed, max_steps=cfg.trainer.total_steps,
        bf16=False, fp16=False, activation_checkpointing=False, use_cpu=True, logging_steps=1, report_to="none",
        save_strategy="no", disable_tqdm=True, log_completions=False, dataloader_num_workers=0,
        shuffle_dataset=cfg.data.shuffle, model_init_kwargs={"dtype": "float32"},
    )
    if not case.stop_at_eos:  # megarl samples eos and carries on: TRL's generate must not stop at it either
        args["generation_kwargs"] = {"eos_token_id": []}
    return args


def remaining_differences(case: Case) -> list[str]:
    """What still differs between the two sides of ``case`` once :func:`trl_args` and ``TRL_BEHAVIOUR`` hold,
    and why each does or does not change the work (written into every results file)."""
    out = [
        "Samples and prompt order: each side draws its own (megarl's sampler and seeds, TRL's RepeatSampler and "
        "torch RNG): the same distributions, not the same draws. `--replay` removes this: TRL trains on megarl's "
        "recorded prompts and responses.",
        "Entropy bonus: TRL takes the token mean per micro-batch and averages the micro-batches, megarl one token "
        "mean over the whole batch. Equal here: every response has the same length "
        f"({case.max_new_tokens} token{'s' if case.max_new_tokens > 1 else ''}"
        f"{', ending at eos or cut' if case.stop_at_eos else ', no stop'}), so every micro-batch counts the same "
        "tokens (`--replay` checks it per step).",
        "Arithmetic order: megarl's Megatron layers (TP/DP splits, its own Adam) against transformers' model and "
        "torch's AdamW, forward micro-batches of the reference pass (TRL: per_device_train_batch_size rows, "
        "megarl: policy.forward_micro_batch), TRL's shuffle of rows into micro-batches: rounding only.",
    ]
    if not case.stop_at_eos:
        out.append("Eos without stopping: megarl (rollout.stop_at_eos=false) samples eos and goes on, counting every "
                   "token; TRL gets generation_kwargs eos_token_id=[] and the worker empties the trainer's "
                   "eos_token_ids (no GRPOConfig field does it), so it neither stops nor masks after an eos.")
    return out


def _steps_megarl(out: Path, rows: int, warmup: int) -> tuple[list[dict], float | None]:
    from megarl.metrics.tracking import read_metrics

    records = read_metrics(out)
    steps = [{"start": m["time"] - m["timing/step_s"], "end": m["time"], "step_s": m["timing/step_s"],
              "tokens": rows * m["response/length_mean"],
              "stages": {k[len("timing/"):-2]: v for k, v in m.items()
                         if k.startswith("timing/") and k != "timing/step_s"}}
             for m in records]
    peak = max((m.get("memory/host_peak_gb") or 0.0 for m in records), default=None)
    return steps[warmup:], peak


def _steps_trl(path: Path, rows: int, warmup: int) -> list[dict]:
    steps = []
    for line in path.read_text().splitlines():
        m = json.loads(line)
        gen, gs = m["generate_s"], m["generate_and_score_s"]
        steps.append({"start": m["start"], "end": m["end"], "step_s": m["end"] - m["start"],
                      "tokens": rows * m["completions/mean_length"],
                      "stages": {"generate": gen, "reward+reference+prep": gs - gen,
                                 "train (fwd+bwd+optim)": m["end"] - m["start"] - gs}})
    return steps[warmup:]


def run_side(side: str, case_name: str, repeat: int, task: Path, work: Path, cfg, trl_python: str,
             trl_env: dict[str, str] | None = None) -> RunResult:
    case = CASES[case_name]
    out = work / f"{case_name}-{side}-{repeat}"
    if out.exists():
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True)
    token = uuid.uuid4().hex
    env = os.environ | {MARKER: token, "RAY_ADDRESS": "local", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                        "TOKENIZERS_PARALLELISM": "false"}
    rows = cfg.data.batch_size * cfg.rollout.sampling.n
    if side == "megarl":
        cmd = [sys.executable, "-m", "megarl.cli.main", "train", str(EXAMPLE), *megarl_overrides(task, case, out)]
    else:
        spec = {"model": str(task / "model"), "train": str(task / "train.jsonl"), "out": str(out / "steps.jsonl"),
                "threads": os.cpu_count(), "args": trl_args(cfg, case) | {"output_dir": str(out / "trl")},
                "ignore_eos": not case.stop_at_eos}
        (out / "spec.json").write_text(json.dumps(spec, indent=1))
        cmd = [trl_python, str(Path(__file__).resolve()), "--trl-worker", str(out / "spec.json")]
        env |= trl_env or {}
    sampler = TreeSampler(token)
    load0, start, cpu0 = os.getloadavg()[0], time.time(), sum(os.times()[:2])
    sampler.start()
    with (out / "log.txt").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        sampler.root = proc.pid
        try:
            proc.wait()
        except BaseException:
            proc.terminate()  # megarl's driver then shuts its Ray cluster down
            proc.wait(60)
            raise
    sampler.stop()
    wall, load1 = time.time() - start, os.getloadavg()[0]
    sampler_cpu = (sum(os.times()[:2]) - cpu0) / wall
    if proc.returncode:
        raise SystemExit(f"{side} {case_name} failed ({proc.returncode}); see {out / 'log.txt'}")
    worker_peak = None
    if side == "megarl":
        steps, worker_peak = _steps_megarl(out, rows, case.warmup)
    else:
        steps = _steps_trl(out / "steps.jsonl", rows, case.warmup)
    t0, t1 = steps[0]["start"], steps[-1]["end"]
    peak, peak_procs = sampler.peak(0.0, t1)
    steady, steady_procs = sampler.peak(t0, t1)
    omp: dict[str, list[str]] = {}  # label -> "OMP_NUM_THREADS/busy threads" of each such process
    for pid, value in sampler.omp_threads.items():
        omp.setdefault(sampler.labels.get(pid, "?"), []).append(f"{value}/{sampler.busy_threads(pid)}")
    allocators: dict[str, list[str]] = {}
    for pid, name in sampler.allocator.items():
        if sampler.busy_threads(pid):
            allocators.setdefault(sampler.labels.get(pid, "?"), []).append(name)
    return RunResult(
        side, case_name, repeat, [s["step_s"] for s in steps], [s["tokens"] / s["step_s"] for s in steps],
        {k: statistics.median(s["stages"].get(k, 0.0) for s in steps) for k in steps[0]["stages"]},
        peak, sampler.peak()[0], sampler.peak_private(0.0, t1), steady, sampler.peak_private(t0, t1),
        sampler.max_processes(), peak_procs, steady_procs, (load0, load1), wall, omp_threads=omp,
        allocators=allocators, series=sampler.series(), steps_at=[(s["start"], s["end"]) for s in steps],
        sampler_cpu=sampler_cpu, worker_peak_gb=worker_peak)


# ---------------------------------------------------------------------------------- TRL side


def integer_answer(completions, answer, **_):
    """TRL reward function equal to megarl's built-in ``integer_answer`` (``match: first``): 1 when the first
    integer of the completion equals the row's answer."""
    import re

    found = [re.search(r"-?\d+", c) for c in completions]
    return [1.0 if m is not None and int(m.group()) == int(a) else 0.0 for m, a in zip(found, answer, strict=True)]


def trl_worker(spec_path: str) -> None:
    """Runs under the TRL virtualenv: GRPOTrainer on the spec's model and prompts, one JSON line per step
    (spec ``mode`` ``replay`` or ``learning``: :mod:`grpo_parity`'s worker instead)."""
    import torch

    spec = json.loads(Path(spec_path).read_text())
    if spec.get("mode"):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import grpo_parity

        return grpo_parity.trl_worker(spec)
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(spec["threads"])
    rows = [json.loads(line) for line in Path(spec["train"]).read_text().splitlines() if line.strip()]
    timers = {"generate_s": 0.0, "generate_and_score_s": 0.0}

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate(self, prompts):
            start = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                timers["generate_s"] += time.perf_counter() - start

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                timers["generate_and_score_s"] += time.perf_counter() - start

    out = Path(spec["out"]).open("w")  # noqa: SIM115 (written by the callback, closed after train())

    class StepClock(TrainerCallback):
        record: dict = {}

        def on_step_begin(self, args, state, control, **kwargs):
            self.record = {"start": time.time()}

        def on_step_end(self, args, state, control, **kwargs):
            self.record |= {"end": time.time(), "step": state.global_step, "load": os.getloadavg()[0], **timers}
            timers.update(dict.fromkeys(timers, 0.0))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs and "end" in self.record:
                out.write(json.dumps(self.record | logs) + "\n")
                out.flush()
                self.record = {}

    args = GRPOConfig(**spec["args"])
    print(f"torch threads {torch.get_num_threads()}, optim {args.optim}, bf16 {args.bf16}, activation checkpointing "
          f"{args.activation_checkpointing}", flush=True)
    trainer = TimedGRPOTrainer(model=spec["model"], reward_funcs=integer_answer, args=args,
                               train_dataset=Dataset.from_list(rows), callbacks=[StepClock()])
    if spec.get("ignore_eos"):  # megarl's rollout.stop_at_eos=false: no mask after a sampled eos (trl_args)
        trainer.eos_token_ids = []
    trainer.train()
    out.close()


# ------------------------------------------------------------------------------ matmul floor


def layer_matmuls(c) -> list[tuple[int, int]]:
    """(in, out) features of one decoder layer's weight matmuls (HF config ``c``): q/k/v, attention output,
    gate + up, down."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return [(c.hidden_size, q + 2 * kv), (q, c.hidden_size), (c.hidden_size, 2 * c.intermediate_size),
            (c.intermediate_size, c.hidden_size)]


def step_flops(c, rows: int, seq: int) -> dict[str, float]:
    """Weight-matmul FLOPs of one GRPO step, per stage: 2 per weight and token for a forward, 6 for forward +
    backward (attention's score and value products, < 2% here, are not counted). Generation feeds every row's
    prompt and all but its last response token; the reference and the update see whole rows of ``seq`` tokens."""
    weights = c.num_hidden_layers * sum(a * b for a, b in layer_matmuls(c)) + c.vocab_size * c.hidden_size
    return {"generate": 2 * weights * rows * (seq - 1), "reference": 2 * weights * rows * seq,
            "update": 6 * weights * rows * seq}


def matmul_rates(c, rows: int, micro_tokens: int, threads: int, seconds: float = 1.0) -> dict[str, float]:
    """GFLOP/s of fp32 ``torch.mm`` on one layer's weight matmuls, ``threads`` threads: ``decode`` with ``rows``
    token rows (forward); ``train`` with a micro-batch's ``micro_tokens`` (forward, input- and weight-gradient
    shapes: ``x W``, ``g W^T``, ``x^T g``)."""
    import torch

    torch.set_num_threads(threads)

    def rate(m: int, backward: bool) -> float:
        ops = []  # (a, b, out): out = a b, written in place (no allocation, no page faults in the timing)
        for a, b in layer_matmuls(c):
            x, w, g = torch.randn(m, a), torch.randn(a, b), torch.randn(m, b)
            ops += [(x, w, torch.empty(m, b))] + ([(g, w.t(), torch.empty(m, a)), (x.t(), g, torch.empty(a, b))]
                                                 if backward else [])
        flops = sum(2 * x.shape[0] * x.shape[1] * w.shape[1] for x, w, _ in ops)

        def run(limit: float) -> float:
            reps, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < limit:
                for x, w, out in ops:
                    torch.mm(x, w, out=out)
                reps += 1
            return flops * reps / elapsed / 1e9

        run(seconds / 4)  # warm-up: MKL's buffers, the CPU's clock
        return run(seconds)

    return {"decode": rate(rows, False), "train": rate(micro_tokens, True)}


def floor_s(flops: dict[str, float], rates: dict[str, float]) -> float:
    """Seconds a step would take doing only its weight matmuls at ``rates`` (GFLOP/s)."""
    return (flops["generate"] / rates["decode"] + (flops["reference"] + flops["update"]) / rates["train"]) / 1e9


# ------------------------------------------------------------------------------------ report


def wait_for_load(limit: float, max_wait: float) -> tuple[tuple[float, float, float], float, bool]:
    start = time.time()
    while os.getloadavg()[0] >= limit and time.time() - start < max_wait:
        logger.info("1-min load %.2f >= %.2f; waiting", os.getloadavg()[0], limit)
        time.sleep(15)
    return os.getloadavg(), time.time() - start, os.getloadavg()[0] < limit


def _versions(trl_python: str) -> dict[str, str]:
    code = ("import importlib.metadata as m, json; print(json.dumps({p: m.version(p) for p in "
            "['trl', 'transformers', 'accelerate', 'datasets', 'torch']}))")
    trl = json.loads(subprocess.run([trl_python, "-c", code], capture_output=True, text=True, check=True).stdout)
    import importlib.metadata as md

    ours = {p: md.version(p) for p in ("torch", "transformers", "megatron-core", "ray")}
    return {f"megarl venv {k}": v for k, v in ours.items()} | {f"TRL venv {k}": v for k, v in trl.items()}


def _med(values) -> float:
    return statistics.median(values)


def _gb(b: float) -> str:
    return f"{b / 1e9:.2f}"


DRIVER_STAGES = ("rollout", "reward", "reference", "advantages", "update_policy")  # megarl's top-level timers


def _procs(procs: list[tuple[int, str]]) -> str:
    """Processes grouped by what they are: ``label xN GB``, largest first."""
    groups: dict[str, list[int]] = {}
    for b, label in procs:
        groups.setdefault(label, []).append(b)
    rows = sorted(groups.items(), key=lambda g: -sum(g[1]))
    return "; ".join(f"{k}{f' x{len(v)}' if len(v) > 1 else ''} {_gb(sum(v))}" for k, v in rows)


def _stages(side: str, stages: dict[str, float]) -> str:
    if side != "megarl":
        return ", ".join(f"{k} {v:.3f}" for k, v in stages.items())
    top = [f"{k} {stages[k]:.3f}" for k in DRIVER_STAGES if k in stages]
    inner = [f"{k} {v:.3f}" for k, v in stages.items() if k not in DRIVER_STAGES]
    return ", ".join(top) + f" (inside rollout, per worker: {', '.join(inner)})"


def report(results: list[RunResult], meta: dict) -> str:
    done = {(r.case, r.side) for r in results}
    meta = meta | {"cases": {n: v for n, v in meta["cases"].items() if (n, "megarl") in done and (n, "trl") in done}}
    lines = [f"# GRPO on CPU: megarl vs TRL GRPOTrainer, {meta['date']}", "",
             f"- megarl commit {meta['commit']}; {meta['machine']}",
             "- " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
             f"- 1-min load average before the first run: {meta['load_before_wait']:.2f}; waited "
             f"{meta['waited_s']:.0f} s for < {meta['wait_load']} ({'reached' if meta['reached'] else 'NOT reached'}); "
             f"load (1/5/15 min) at start {' / '.join(f'{x:.2f}' for x in meta['load_start'])}",
             "- cores: 2 for both. megarl (layout per case below): Ray launcher: driver + 2 Ray worker processes "
             "(policy + colocated reference), 1 torch thread per worker; local launcher: policy and reference in the "
             "driver process, 2 torch threads. TRL: 1 process, 2 torch threads", "",
             "## Cases", "", "| case | parameters | rows/step (prompts x n) | response tokens | warm-up + measured "
             "steps | micro-batches | megarl layout |", "|---|---|---|---|---|---|---|"]
    for name, info in meta["cases"].items():
        c = CASES[name]
        lines.append(f"| {name} | {info['params'] / 1e6:.2f} M | {info['rows']} | {c.max_new_tokens}"
                     f"{' (stop at eos)' if c.stop_at_eos else ' (no stop)'} | {c.warmup} + {c.steps} | "
                     f"{info['micro']} | {c.layout()} |")
    lines += ["", "## Results", "", "Medians over runs of each run's median measured step (min-max over runs in "
              "brackets). Memory: sums over the run's processes, GB (*private*: anonymous RSS summed + the largest "
              "shared RSS); *peak* = start-up and all steps (megarl's end-of-run checkpoint save excluded, TRL saves "
              "nothing), *steps* = during the measured steps.", "",
              "| case | side | runs | step s | generated tokens/s | peak RSS | peak private | steps RSS | "
              "steps private | RSS incl. final save | processes |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    summary = {}
    keys = ("peak_rss", "peak_priv", "steady_rss", "steady_priv", "peak_rss_all")
    for name in meta["cases"]:
        for side in ("megarl", "trl"):
            runs = [r for r in results if r.case == name and r.side == side]
            step = [_med(r.step_s) for r in runs]
            tps = [_med(r.tokens_per_s) for r in runs]
            mem = {k: _med(getattr(r, k) for r in runs) for k in keys}
            summary[name, side] = dict(step=_med(step), **mem)
            rss = [r.peak_rss for r in runs]
            lines.append(f"| {name} | {side} | {len(runs)} | {_med(step):.3f} [{min(step):.3f}-{max(step):.3f}] | "
                         f"{_med(tps):.0f} [{min(tps):.0f}-{max(tps):.0f}] | {_gb(mem['peak_rss'])} [{_gb(min(rss))}-"
                         f"{_gb(max(rss))}] | {_gb(mem['peak_priv'])} | {_gb(mem['steady_rss'])} | "
                         f"{_gb(mem['steady_priv'])} | {_gb(mem['peak_rss_all'])} | {max(r.max_procs for r in runs)} |")
    lines += ["", "## Ratios megarl / TRL against the targets", "",
              "*Pairs*: each megarl run's median step over the TRL run right after it (min / median / max): how far "
              "the machine's drift moves one comparison.", "",
              "| case | step time | pairs | step-time target | peak RSS | peak private | steps RSS | steps private | "
              "memory target |", "|---|---|---|---|---|---|---|---|---|"]
    for name in meta["cases"]:
        m, t = summary[name, "megarl"], summary[name, "trl"]
        ratio = {k: m[k] / t[k] for k in ("step", *keys[:4])}
        step = {(r.side, r.repeat): _med(r.step_s) for r in results if r.case == name}
        pairs = sorted(step["megarl", i] / step["trl", i] for side, i in step
                       if side == "megarl" and ("trl", i) in step)
        target, goal = TARGETS[name]
        verdict = ("met" if ratio["step"] <= goal else f"met, goal <= {goal:.1f}x missed" if ratio["step"] <= target
                   else "MISSED")
        mem_target, mem = MEMORY_TARGET.get(name), max(ratio[k] for k in keys[:4])
        mem_ok = "none" if mem_target is None else f"<= {mem_target:.1f}x: {'met' if mem <= mem_target else 'MISSED'}"
        lines.append(f"| {name} | {ratio['step']:.2f}x | {pairs[0]:.2f} / {_med(pairs):.2f} / {pairs[-1]:.2f} | "
                     f"<= {target:.1f}x: {verdict} | " +
                     " | ".join(f"{ratio[k]:.2f}x" for k in keys[:4]) + f" | {mem_ok} |")
    lines += ["", "## Matmul floor", "", "Weight-matmul work of one step (`step_flops`: 2 FLOPs per weight and "
              "token forward, 6 forward + backward; generation counts every row's prompt and response tokens but "
              "the last, as a batch without prompt sharing would) against this machine's fp32 `torch.mm` rate on the "
              "model's own layer matmuls, measured just before each run (`matmul_rates`; *decode*: one "
              "token per row, *train*: an update micro-batch, forward and both gradient shapes). *Floor*: a step "
              "that did nothing but these matmuls at those rates; *floor / TRL*: the lowest step-time ratio any "
              "implementation doing this work in fp32 could reach.", "",
              "| case | TFLOP/step (generate + reference + update) | mm GFLOP/s decode / train | floor s | "
              "megarl GFLOP/s | TRL GFLOP/s | floor / TRL step |", "|---|---|---|---|---|---|---|"]
    for name, info in meta["cases"].items():
        runs = [r for r in results if r.case == name and r.matmul_gflops]
        if not runs:
            continue
        flops = info["flops"]
        rates = {k: _med(r.matmul_gflops[k] for r in runs) for k in ("decode", "train")}
        floor = _med(floor_s(flops, r.matmul_gflops) for r in runs)
        achieved = {side: sum(flops.values()) / summary[name, side]["step"] / 1e9 for side in ("megarl", "trl")}
        parts = " + ".join(f"{v / 1e12:.3f}" for v in flops.values())
        lines.append(f"| {name} | {sum(flops.values()) / 1e12:.3f} ({parts}) | {rates['decode']:.0f} / "
                     f"{rates['train']:.0f} | {floor:.3f} | {achieved['megarl']:.0f} | {achieved['trl']:.0f} | "
                     f"{floor / summary[name, 'trl']['step']:.2f}x |")
    lines += ["", "## Step breakdown (median seconds per measured step, median over runs)", ""]
    for name in meta["cases"]:
        for side in ("megarl", "trl"):
            runs = [r for r in results if r.case == name and r.side == side]
            stages = {k: _med(r.stages[k] for r in runs) for k in runs[0].stages}
            lines.append(f"- {name} {side}: {_stages(side, stages)}")
    lines += ["", "## Processes at the memory peaks (last run of each; RSS GB)", ""]
    for name in meta["cases"]:
        for side in ("megarl", "trl"):
            r = [r for r in results if r.case == name and r.side == side][-1]
            lines.append(f"- {name} {side}, peak: {_procs(r.peak_procs)}")
            lines.append(f"- {name} {side}, during steps: {_procs(r.steady_procs)}")
            omp = {k: v for k, v in r.omp_threads.items() if any(not x.endswith("/0") for x in v)}
            lines.append(f"- {name} {side}, OMP_NUM_THREADS at exec (\"-\": unset) / threads that used >= 15% of "
                         f"the busiest thread's CPU time, per process that computed: {omp}")
            lines.append(f"- {name} {side}, host memory allocator of each process that computed: {r.allocators}")
    lines += ["", "## Per run", "", "| case | side | repeat | step s (median) | measured steps s | load 1-min "
              "start/end | wall s | sampler CPU | peak RSS | megarl's busiest-worker peak |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        worker = f"{r.worker_peak_gb:.2f}" if r.worker_peak_gb else ""
        lines.append(f"| {r.case} | {r.side} | {r.repeat} | {_med(r.step_s):.3f} | "
                     f"{' '.join(f'{s:.2f}' for s in r.step_s)} | {r.load[0]:.2f} / {r.load[1]:.2f} | {r.wall_s:.0f} | "
                     f"{r.sampler_cpu:.1%} | {_gb(r.peak_rss)} | {worker} |")
    lines += ["", "## Exact configurations", ""]
    for name, info in meta["cases"].items():
        overrides = " ".join(info["overrides"]).replace(f"{ROOT}/", "")
        lines += [f"**{name}** model: `make_task(dir, **{CASES[name].model})` (megarl.testing.addition)", "",
                  f"megarl: `{meta['megarl_cmd']} {EXAMPLE.relative_to(ROOT)} " + overrides + "`",
                  "", f"TRL `GRPOConfig(**...)`: `{json.dumps(info['trl'], sort_keys=True)}`", ""]
    lines += ["## What still differs", ""]
    for name in meta["cases"]:
        lines += [f"**{name}**", "", *(f"- {d}" for d in remaining_differences(CASES[name])), ""]
    lines += ["## Reproduce", "", "```", meta["command"], "```", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="tiny,30m")
    parser.add_argument("--repeats", default="tiny=3,30m=2", help="runs per side: N, or CASE=N,CASE=N")
    parser.add_argument("--wait-load", type=float, default=1.5)
    parser.add_argument("--max-wait", type=float, default=900.0)
    parser.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"))
    parser.add_argument("--work", default=str(ROOT / "outputs" / "bench_grpo_cpu"))
    parser.add_argument("--results", default=None)
    parser.add_argument("--quick", action="store_true", help="1 warm-up + 2 measured steps (smoke test)")
    parser.add_argument("--launcher", choices=("ray", "local"), default=None,
                        help="megarl's launcher for every case (default: each case's own)")
    parser.add_argument("--trl-allocator", default="system", help="host allocator preloaded for TRL (megarl's "
                        "cluster.allocator values; default: glibc, as TRL ships); megarl uses its default, auto")
    parser.add_argument("--replay", type=int, metavar="N", help="instead of timing: TRL replays N steps of "
                        "megarl's rollouts; loss, grad norm and weights compared per step (grpo_parity.py)")
    parser.add_argument("--learning", metavar="SEEDS,STEPS", help="instead of timing: both learn the tiny task over "
                        "SEEDS seeds x STEPS steps; reward, entropy, greedy accuracy compared (grpo_parity.py)")
    parser.add_argument("--val-every", type=int, default=25, help="--learning: steps between greedy validations")
    parser.add_argument("--window", type=int, default=50, help="--learning: steps per window of the report")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    parser.add_argument("--megarl-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        return trl_worker(args.trl_worker)
    if args.replay or args.learning or args.megarl_worker:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import grpo_parity

        return grpo_parity.main(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from tqdm import tqdm
    from transformers import AutoConfig

    from megarl.bench.report import cpu_description
    from megarl.config.train import load_config
    from megarl.host import allocator
    from megarl.testing.addition import make_task

    trl_preload = allocator.preload_env(allocator.Allocator(args.trl_allocator))
    trl_env = {k: v for k, v in trl_preload.items() if k != allocator.MARKER}

    if not Path(args.trl_python).is_file():
        raise SystemExit(f"{args.trl_python} not found; make the TRL venv (see benchmarks/requirements-trl.txt).")
    names = args.cases.split(",")
    if args.quick:
        CASES.update({n: dataclasses.replace(CASES[n], warmup=1, steps=2) for n in names})
    if args.launcher:
        CASES.update({n: dataclasses.replace(CASES[n], launcher=args.launcher) for n in names})
    work = Path(args.work)
    cases, cfgs, shapes = {}, {}, {}
    for name in names:
        case, task = CASES[name], work / name / "task"
        make_task(task, **case.model)
        overrides = megarl_overrides(task, case, Path("<out>"))
        cfgs[name] = load_config(EXAMPLE, overrides)
        c = AutoConfig.from_pretrained(task / "model")
        qkv_bias = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim  # Qwen2
        layer = sum(a * b for a, b in layer_matmuls(c)) + qkv_bias + 2 * c.hidden_size  # + 2 RMSNorms
        params = c.vocab_size * c.hidden_size + c.num_hidden_layers * layer + c.hidden_size  # tied LM head
        trl = trl_args(cfgs[name], case)
        micro = f"{trl['gradient_accumulation_steps']} x {trl['per_device_train_batch_size']}"
        rows = cfgs[name].data.batch_size * cfgs[name].rollout.sampling.n
        seq = PROMPT_TOKENS + case.max_new_tokens
        cases[name] = dict(params=params, rows=rows, overrides=overrides, trl=trl, micro=micro,
                           flops=step_flops(c, rows, seq))
        shapes[name] = (c, rows, trl["per_device_train_batch_size"] * seq)  # for matmul_rates
    load_before = os.getloadavg()[0]
    load_start, waited, reached = wait_for_load(args.wait_load, args.max_wait)
    results = []
    repeats = {n: int(args.repeats) for n in names} if args.repeats.isdigit() else {
        k: int(v) for k, v in (item.split("=") for item in args.repeats.split(","))}
    plan = [(n, r, s) for n in names for r in range(repeats[n]) for s in ("megarl", "trl")]
    date = datetime.date.today().isoformat()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    meta = dict(date=date, commit=commit.strip(), cases=cases, versions=_versions(args.trl_python),
                machine=f"{os.cpu_count()} CPU cores ({platform.machine()}, {cpu_description()}), "
                        f"{_mem_gib():.0f} GiB RAM, {platform.platform()}, Python {platform.python_version()}",
                load_before_wait=load_before, load_start=load_start, waited_s=waited, reached=reached,
                wait_load=args.wait_load, megarl_cmd=".venv/bin/python -m megarl.cli.main train",
                command=f".venv/bin/python benchmarks/grpo_cpu.py --cases {args.cases} --repeats {args.repeats}"
                        + (f" --launcher {args.launcher}" if args.launcher else "")
                        + (f" --trl-allocator {args.trl_allocator}" if args.trl_allocator != "system" else ""))
    path = Path(args.results or ROOT / "benchmarks" / "results" / f"grpo_cpu-{date}.md")
    for name, repeat, side in tqdm(plan, desc="runs", unit="run"):
        rates = matmul_rates(*shapes[name], os.cpu_count())
        res = run_side(side, name, repeat, work / name / "task", work / name, cfgs[name], args.trl_python,
                       trl_env)
        res.matmul_gflops = rates
        logger.info("%s %s #%d: step %.3f s, peak RSS %s GB, load %.2f/%.2f", name, side, repeat,
                    _med(res.step_s), _gb(res.peak_rss), *res.load)
        results.append(res)
        if side == "trl":  # a complete pair: rewrite the report with what has run so far
            _write(results, meta, path, work)
    print(path.read_text())


def _write(results: list[RunResult], meta: dict, path: Path, work: Path) -> None:
    path.write_text(report(results, meta))
    (work / f"results-{meta['date']}.json").write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))


def _mem_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


if __name__ == "__main__":
    main()
