"""The rollout schedules on the same processes: sync, one_step_off and async against their ideal step (#23).

    .venv/bin/python benchmarks/schedules.py [--algorithm grpo|dapo] [--cases tiny,30m]
        [--modes sync,one_step_off,async[,async_partial]] [--repeats tiny=3,30m=1] [--steps tiny=30,30m=10]
        [--warmup tiny=5,30m=2] [--wait-load 1.5] [--results FILE]
    .venv/bin/python benchmarks/schedules.py --report-from outputs/bench_schedules/results-<date>.json

The addition task of ``examples/grpo_addition_tiny`` with the models of ``benchmarks/grpo_cpu.py`` (same
``make_task`` shapes, response lengths and stop rule): ``tiny`` (hidden 64, 2 layers, one-token responses ending
at eos) and ``30m`` (hidden 512, 8 layers, MLP 2048, ~31.5M parameters, 64-token responses, no stop). The
example's GRPO settings otherwise (16 prompts x n=16 per step, 2 mini-batches, so the old log-probs get a
forward of their own in every mode), all 256 rows decoded at once (``rollout.engine.max_batch_size=256``).

Every mode runs on the same split placement: pool ``main`` (1 device, TP1: the policy and its colocated
reference, one Ray worker process) and pool ``gen`` (1 device: the embedded rollout engine, one Ray worker
process, ``cluster.placement.rollout=gen``), plus the driver. Modes:

- ``sync``: weight sync, generation, scoring, training in turn (each pool idle while the other works);
- ``one_step_off``: ``rollout.schedule=one_step_off`` (step k+1 generates while step k trains);
- ``async``: ``rollout.schedule=async`` with ``max_staleness=1``, ``on_stale=wait``, ``push_every=1``, whole
  responses per call;
- ``async_partial`` (run only when named in ``--modes``): ``async`` with ``max_staleness=2`` and partial rollouts
  (``rollout.asynchronous.partial_chunk_tokens=16``: a push lands between 16-token calls).

Algorithms (``--algorithm``): ``grpo`` (the default: the settings above, ``examples/grpo_addition_tiny``) and
``dapo``: the same task, placement and overrides on ``examples/dapo_addition_tiny``'s settings, i.e. DAPO's
dynamic sampling (``algorithm.dynamic_sampling``: prompt groups whose 16 rewards are all equal are dropped and
more prompts sampled, up to 4 more rounds, ``on_short: train``), clip-higher (``clip_high=0.28``), token-mean
aggregation, no KL term (so no reference pass) and no entropy bonus. Its results file is
``schedules-<date>-dapo.md``.

Each run is a fresh ``megarl train`` subprocess (its own Ray cluster; start-up is outside the measured steps);
with ``--repeats`` above 1 the modes alternate (sync, one_step_off, async, sync, ...). From each run's
``metrics.jsonl``, after ``warmup`` steps, medians over the measured steps of:

- step time ``timing/step_s`` and tokens/s: generated response tokens of the step (``rollout/num_tokens``) /
  step time;
- groups sampled per group trained (a ratio of sums over the measured steps, over all runs of the mode): prompt
  groups generated and scored (``dynamic/groups_sampled``, all rounds of the step; ``data.batch_size`` without
  dynamic sampling) plus the groups the asynchronous buffer dropped as too stale (``async/dropped_groups``),
  over the groups trained (``dynamic/groups_trained``; ``data.batch_size`` without dynamic sampling). Groups
  still in flight or in the buffer when the run ends are in neither;
- stage times: generation ``timing/rollout_s`` (the driver's wait for the rollout pool's responses: in
  ``sync`` the whole generation, dispatch and transfer included; in the overlapped modes only what was left
  of it), the engine's own decode ``timing/generate_s`` (reported by the rollout worker; absent in ``async``,
  whose producer thread calls the engine outside any step), scoring ``timing/reward_s``, training = the sum of
  ``timing/old_log_probs_s``, ``timing/reference_s``, ``timing/advantages_s`` and ``timing/update_policy_s``,
  weight sync ``timing/weight_sync_s``; ``bookkeeping`` and the rest of the step are reported as they are;
- busy shares: training pool = training / step, rollout pool = the engine's decode / step (``async``: the
  sync run's decode seconds per batch / the async step, marked ``~``, and at most 1 - the producer's wait
  ``async/rollout_wait_s`` / step).

**Ideal = the planner's prediction**: ``megarl.planner.modes.predict_step`` (docs/planner.md §8) on the
stage times of the ``sync`` run, i.e. each stage measured in isolation: ``StageTimes(gen_s=timing/rollout_s,
train_s=training, sync_s=timing/weight_sync_s, reward_s=timing/reward_s)`` (the inputs docs/planner.md §8
names), split placement, push every update. sync: ``gen + reward + train + sync``; one_step_off and async:
``max(gen + reward, train) + sync``. Target (#23): one_step_off's measured step within 1.15x of that ideal.
Beside it, the planner on each mode's own stage times (gen = the engine's decode; async: the sync run's), which
separates what the schedule loses (waits, dispatch, the driver's serial work) from what its stages lost by
running at the same time on shared cores.

The parent also samples, every 0.5 s, the CPU seconds of every process of the run (the driver and its
descendants: Ray's GCS, raylet, agents and the two worker processes, told apart by ``MEGARL_WORKER_GROUP``),
their threads and the whole machine's busy CPU, so the report says how many cores each used during the
measured steps, with how many busy threads, what ``OMP_NUM_THREADS`` each started with, and how much CPU the
machine's *other* processes took during each step. The machine is shared: the medians are taken over the
steps during which other processes used under ``QUIET_CORES`` (0.25 cores), when at least 3 were, over all
measured steps otherwise (the per-run table says which). Before every run the script waits (up to
``--max-wait`` s) for the 1-minute load average to drop below ``--wait-load``. Writes
benchmarks/results/schedules-<date>.md and the raw runs as JSON under ``--work``, from which
``--report-from`` rewrites the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from grpo_cpu import CASES as GRPO_CASES  # the same models, response lengths and stop rule
from grpo_cpu import wait_for_load

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TARGET = 1.15  # one_step_off measured / ideal
QUIET_CORES = 0.25  # a step is measured when the machine's other processes used less CPU than this meanwhile
logger = logging.getLogger("bench.schedules")

_ASYNC = ["rollout.schedule=async", "rollout.asynchronous.on_stale=wait", "rollout.asynchronous.push_every=1"]
MODES = {
    "sync": [],
    "one_step_off": ["rollout.schedule=one_step_off"],
    "async": [*_ASYNC[:1], "rollout.asynchronous.max_staleness=1", *_ASYNC[1:]],
    "async_partial": [*_ASYNC[:1], "rollout.asynchronous.max_staleness=2", *_ASYNC[1:],
                      "rollout.asynchronous.partial_chunk_tokens=16"],
}
DEFAULT_MODES = ("sync", "one_step_off", "async")
PLANNER_MODE = {"sync": "sync", "one_step_off": "one_step_off", "async": "async", "async_partial": "async"}


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """The training settings a run starts from: an example's config, on which every run's overrides land."""

    example: Path
    suffix: str  # of the results file's name
    description: str  # for the report's header

    @property
    def batch_size(self) -> int:
        """Prompt groups a step trains (``data.batch_size``)."""
        import yaml

        return yaml.safe_load(self.example.read_text())["data"]["batch_size"]


ALGORITHMS = {
    "grpo": Algorithm(EXAMPLES / "grpo_addition_tiny" / "config.yaml", "",
                      "GRPO (examples/grpo_addition_tiny): 16 prompts x 16 responses per step, KL loss to a colocated "
                      "reference, entropy bonus 0.01"),
    "dapo": Algorithm(EXAMPLES / "dapo_addition_tiny" / "config.yaml", "-dapo",
                      "DAPO (examples/dapo_addition_tiny): 16 trained prompt groups x 16 responses per step, dynamic "
                      "sampling (groups with all-equal rewards dropped, up to 4 more rounds of 16 prompts, on_short: "
                      "train, i.e. fewer groups when they run out), clip-higher (clip_high 0.28), token-mean "
                      "aggregation, no KL term (no reference pass), no entropy bonus"),
}
PLACEMENT = ["cluster.pools.main.devices_per_node=1", "cluster.pools.main.tp=1",
             "cluster.pools.gen.devices_per_node=1", "cluster.placement.rollout=gen"]
TRAIN_STAGES = ("old_log_probs", "reference", "advantages", "update_policy")  # the training pool's stages
DEFAULT_STEPS = {"tiny": 30, "30m": 10}
DEFAULT_WARMUP = {"tiny": 5, "30m": 2}


@dataclasses.dataclass
class Step:
    step_s: float
    tokens: float  # generated response tokens
    rollout_s: float  # the driver's wait for the responses
    generate_s: float | None  # the engine's own decode (None: async)
    reward_s: float
    train_s: float
    sync_s: float
    bookkeeping_s: float
    lag_max: float
    rollout_wait_s: float | None  # async: the producer's wait for room in the buffer or for fresher weights
    start: float  # wall clock
    end: float
    foreign_cores: float | None = None  # CPU the machine's other processes used during the step, in cores
    groups_sampled: float | None = None  # generated and scored, plus dropped as too stale (None: not recorded)
    groups_trained: float | None = None


@dataclasses.dataclass
class RunResult:
    case: str
    mode: str
    repeat: int
    steps: list[Step]
    cores: dict[str, float]  # process label -> cores used during the measured steps
    threads: dict[str, str]  # process label -> "OMP_NUM_THREADS / busy threads"
    load: tuple[float, float]  # 1-min load average at start and end
    wall_s: float
    commit: str = ""  # the code the run started with: HEAD, "+" when megarl/ had uncommitted changes
    waited_s: float = 0.0  # waited for the load average before the run

    @property
    def quiet(self) -> list[Step]:
        """The steps during which other processes used under ``QUIET_CORES`` (all of them when fewer than 3
        were, or when that is unknown)."""
        quiet = [s for s in self.steps if s.foreign_cores is not None and s.foreign_cores < QUIET_CORES]
        return quiet if len(quiet) >= 3 else self.steps

    def med(self, field: str) -> float | None:
        values = [getattr(s, field) for s in self.quiet]
        return None if None in values else statistics.median(values)


# ------------------------------------------------------------------------------------ CPU use


class CpuSampler(threading.Thread):
    """CPU seconds of the driver and all its descendants, per process and per thread, and of the whole
    machine, every ``interval`` s."""

    def __init__(self, root: int, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        import psutil

        self.psutil, self.root, self.me, self.interval = psutil, psutil.Process(root), psutil.Process(), interval
        self.samples: list[tuple[float, dict[int, tuple[str, float, dict[int, float]]]]] = []
        self.machine: list[float] = []  # busy CPU seconds of the whole machine at each sample (steal included)
        self.omp: dict[str, str] = {}  # label -> OMP_NUM_THREADS at exec ("-": unset)
        self._stop_event = threading.Event()

    def _label(self, proc) -> str:
        if proc.pid == self.root.pid:
            return "driver"
        group = proc.environ().get("MEGARL_WORKER_GROUP")
        return f"worker {group}" if group else "ray (other)"

    def sample(self) -> None:
        now, seen, total = time.time(), {}, self.psutil.cpu_times()
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except self.psutil.Error:
            return
        mine = self.me.cpu_times()
        seen[self.me.pid] = ("benchmark (this script)", mine.user + mine.system, {})
        for proc in procs:
            try:
                label, cpu = self._label(proc), proc.cpu_times()
                threads = ({t.id: t.user_time + t.system_time for t in proc.threads()} if label != "ray (other)"
                           else {})
                if label != "ray (other)":
                    self.omp.setdefault(label, proc.environ().get("OMP_NUM_THREADS", "-"))
            except self.psutil.Error:
                continue
            seen[proc.pid] = (label, cpu.user + cpu.system, threads)
        self.samples.append((now, seen))
        self.machine.append(sum(getattr(total, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq", "steal")))

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def window(self, t0: float, t1: float) -> tuple[dict[str, float], dict[str, int]]:
        """Cores used per label between the first and the last sample inside [t0, t1] (the workers are gone
        soon after the last step) and each labelled process's busy threads (those that used >= 15 % of its
        busiest thread's CPU time there)."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            raise SystemExit(f"the measured steps lasted {t1 - t0:.1f} s, too short for CPU samples every "
                             f"{self.interval} s; measure more steps")
        (ta, a), (tb, b) = inside[0], inside[-1]
        cores: dict[str, float] = {}
        busy: dict[str, int] = {}
        for pid, (label, cpu, threads) in b.items():
            if pid not in a:
                continue
            old = a[pid]
            cores[label] = cores.get(label, 0.0) + (cpu - old[1]) / (tb - ta)
            used = [v - old[2].get(tid, 0.0) for tid, v in threads.items()]
            if used and max(used) > 0.05 * (tb - ta):
                busy[label] = sum(u >= 0.15 * max(used) for u in used)
        return cores, busy

    def foreign(self, t0: float, t1: float) -> float | None:
        """Cores the machine's other processes used in [t0, t1]: the machine's busy CPU minus this run's,
        per interval between samples, averaged over the intervals' overlap with [t0, t1]."""
        used = weight = 0.0
        for i in range(len(self.samples) - 1):
            (ta, a), (tb, b) = self.samples[i], self.samples[i + 1]
            overlap = min(tb, t1) - max(ta, t0)
            if overlap <= 0:
                continue
            ours = sum(cpu - a[pid][1] for pid, (_, cpu, _) in b.items() if pid in a)
            used += max(self.machine[i + 1] - self.machine[i] - ours, 0.0) / (tb - ta) * overlap
            weight += overlap
        return used / weight if weight else None


# -------------------------------------------------------------------------------------- runs


def overrides(task: Path, case: str, mode: str, out: Path, total_steps: int) -> list[str]:
    c = GRPO_CASES[case]
    return [*PLACEMENT, *MODES[mode], f"model.path={task / 'model'}", f"data.train={task / 'train.jsonl'}",
            f"data.val={task / 'val.jsonl'}", "rollout.engine.max_batch_size=256", f"trainer.output_dir={out}",
            f"trainer.total_steps={total_steps}", "trainer.save_every=0", "trainer.val_every=0",
            "trainer.tensorboard=false", f"rollout.max_new_tokens={c.max_new_tokens}",
            f"rollout.stop_at_eos={str(c.stop_at_eos).lower()}"]


def _step(m: dict, batch_size: int) -> Step:
    """One step's record from its metrics; without dynamic sampling a step trains the ``batch_size`` groups it
    takes (the dynamic/ counts are absent)."""
    t = {k[len("timing/"):-2]: v for k, v in m.items() if k.startswith("timing/")}
    return Step(step_s=m["timing/step_s"], tokens=m["rollout/num_tokens"], rollout_s=t.get("rollout", 0.0),
                generate_s=t.get("generate"), reward_s=t.get("reward", 0.0),
                train_s=sum(t.get(k, 0.0) for k in TRAIN_STAGES), sync_s=t.get("weight_sync", 0.0),
                bookkeeping_s=t.get("bookkeeping", 0.0), lag_max=m.get("async/version_lag_max", 0.0),
                rollout_wait_s=m.get("async/rollout_wait_s"),
                start=m["time"] - m["timing/step_s"], end=m["time"],
                groups_sampled=m.get("dynamic/groups_sampled", batch_size) + m.get("async/dropped_groups", 0.0),
                groups_trained=m.get("dynamic/groups_trained", batch_size))


def run_mode(algorithm: Algorithm, case: str, mode: str, repeat: int, task: Path, work: Path, steps: int,
             warmup: int) -> RunResult:
    from megarl.metrics.tracking import read_metrics

    out = work / f"{case}-{mode}-{repeat}{algorithm.suffix}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = os.environ | {"RAY_ADDRESS": "local", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "megarl.cli.main", "train", str(algorithm.example),
           *overrides(task, case, mode, out, warmup + steps)]
    load0, start, commit = os.getloadavg()[0], time.time(), _commit()
    with (out / "log.txt").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        sampler = CpuSampler(proc.pid)
        sampler.start()
        try:
            proc.wait()
        except BaseException:
            proc.terminate()  # the driver then shuts its Ray cluster down
            proc.wait(60)
            raise
        finally:
            sampler.stop()
    if proc.returncode:
        raise SystemExit(f"{case} {mode} failed ({proc.returncode}); see {out / 'log.txt'}")
    measured = [_step(m, algorithm.batch_size) for m in read_metrics(out)][warmup:]
    for s in measured:
        s.foreign_cores = sampler.foreign(s.start, s.end)
    cores, busy = sampler.window(measured[0].start, measured[-1].end)
    threads = {label: f"{sampler.omp.get(label, '?')} / {n}" for label, n in busy.items()}
    return RunResult(case, mode, repeat, measured, cores, threads, (load0, os.getloadavg()[0]), time.time() - start,
                     commit)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def _commit() -> str:
    return _git("rev-parse", "--short", "HEAD") + ("+" if _git("status", "--porcelain", "--", "megarl") else "")


# ------------------------------------------------------------------------------------ report


def _med(values) -> float:
    return statistics.median(values)


def _stages(runs: list[RunResult]) -> dict[str, float | None]:
    """Median stage seconds per step over ``runs`` (each run's median)."""
    fields = ("rollout_s", "generate_s", "reward_s", "train_s", "sync_s", "bookkeeping_s", "step_s")
    return {f: _med(r.med(f) for r in runs) if runs[0].med(f) is not None else None for f in fields}


def predictions(runs: list[RunResult]) -> dict[str, tuple[float, float]]:
    """Per mode: (the planner's step from the sync runs' stage times, i.e. each stage alone with gen =
    ``timing/rollout_s``; the planner's step from the mode's own stage times, with gen = the engine's decode
    (async: the sync runs') and, for sync, ``timing/rollout_s``)."""
    from megarl.planner.modes import Mode, StageTimes, predict_step

    def step(mode: str, st: dict, gen: float) -> float:
        times = StageTimes(gen_s=gen, train_s=st["train_s"], sync_s=st["sync_s"], reward_s=st["reward_s"])
        return predict_step(times, Mode(PLANNER_MODE[mode]), split=True).step_s

    base = _stages([r for r in runs if r.mode == "sync"])
    out = {}
    for mode in MODES:
        if rs := [r for r in runs if r.mode == mode]:
            own = _stages(rs)
            gen = own["rollout_s"] if mode == "sync" else own["generate_s"] or base["generate_s"]
            out[mode] = (step(mode, base, base["rollout_s"]), step(mode, own, gen))
    return out


def round_ratios(runs: list[RunResult], mode: str) -> list[float]:
    """Each repeat's ``mode`` step over the planner's ideal from the same repeat's sync run."""
    out = []
    for r in runs:
        if r.mode == mode and (sync := [x for x in runs if x.mode == "sync" and x.repeat == r.repeat]):
            out.append(r.med("step_s") / predictions([sync[0], r])[mode][0])
    return out


def groups(runs: list[RunResult], step_s: float) -> str:
    """Groups sampled per group trained over all measured steps of ``runs`` (a ratio of sums: a step may train
    none), the median of the groups trained per step and the seconds per group trained (``step_s``, the mode's
    median step, over the mean groups trained per step: with dynamic sampling a step may train fewer than
    ``data.batch_size``); ``-`` where the runs did not record them."""
    steps = [s for r in runs for s in r.steps]
    if any(s.groups_sampled is None for s in steps):
        return "- | - | -"
    trained = sum(s.groups_trained for s in steps)
    if not trained:
        return "inf (none trained) | 0 | -"
    return (f"{sum(s.groups_sampled for s in steps) / trained:.2f} | {_med(s.groups_trained for s in steps):.0f} | "
            f"{step_s * len(steps) / trained:.3g}")


def case_table(case: str, runs: list[RunResult]) -> tuple[list[str], dict[str, tuple[float, float]]]:
    pred, base = predictions(runs), _stages([r for r in runs if r.mode == "sync"])
    lines = [f"### {case}", "", "| mode | runs | step s | tokens/s | training pool busy | rollout pool busy | "
             "ideal = planner s | measured / ideal | ideal from own stages s | measured / that | lag max | "
             "groups sampled / trained | groups trained / step | s / group trained |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ratios = {}
    for mode, (ideal, own) in pred.items():
        rs = [r for r in runs if r.mode == mode]
        step = _med(r.med("step_s") for r in rs)
        tps = _med(_med(s.tokens / s.step_s for s in r.quiet) for r in rs)
        train_busy = _med(_med(s.train_s / s.step_s for s in r.quiet) for r in rs)
        if rs[0].med("generate_s") is not None:
            gen_busy = f"{_med(_med(s.generate_s / s.step_s for s in r.quiet) for r in rs):.0%}"
        else:  # async: the sync run's decode seconds; at most the share the producer did not wait
            most = _med(_med(1 - s.rollout_wait_s / s.step_s for s in r.quiet) for r in rs)
            gen_busy = f"~{base['generate_s'] / step:.0%} (<= {most:.0%})"
        ratios[mode] = (step / ideal, step / own)
        lag = max(s.lag_max for r in rs for s in r.steps)
        lines.append(f"| {mode} | {len(rs)} | {step:.3f} | {tps:.0f} | {train_busy:.0%} | {gen_busy} | {ideal:.3f} | "
                     f"{step / ideal:.2f}x | {own:.3f} | {step / own:.2f}x | {lag:.0f} | {groups(rs, step)} |")
    lines += ["", "Stage times, median seconds per measured step (median over runs). *gen wait*: `timing/rollout_s`; "
              "*decode*: the engine's own `timing/generate_s`; *train*: old log-probs + reference + advantages + "
              "update; *other*: step - (gen wait + reward + train + sync + bookkeeping).", "",
              "| mode | gen wait | decode | reward | train | weight sync | bookkeeping | other | step |",
              "|---|---|---|---|---|---|---|---|---|"]
    for mode in pred:
        rs = [r for r in runs if r.mode == mode]
        f = _stages(rs)
        other = _med(_med(s.step_s - s.rollout_s - s.reward_s - s.train_s - s.sync_s - s.bookkeeping_s
                          for s in r.quiet) for r in rs)
        decode = "-" if f["generate_s"] is None else f"{f['generate_s']:.3f}"
        lines.append(f"| {mode} | {f['rollout_s']:.3f} | {decode} | {f['reward_s']:.3f} | {f['train_s']:.3f} | "
                     f"{f['sync_s']:.3f} | {f['bookkeeping_s']:.3f} | {other:.3f} | {f['step_s']:.3f} |")
    return lines + [""], ratios


def cpu_table(runs: list[RunResult]) -> list[str]:
    labels = ["driver", "worker main", "worker gen", "ray (other)", "benchmark (this script)"]
    lines = ["| case | mode | repeat | " + " | ".join(labels) + " | total | OMP_NUM_THREADS / busy threads |",
             "|---|---|---|" + "---|" * (len(labels) + 2)]
    for r in runs:
        cells = [f"{r.cores.get(k, 0.0):.2f}" for k in labels]
        threads = ", ".join(f"{k} {v}" for k, v in sorted(r.threads.items()))
        lines.append(f"| {r.case} | {r.mode} | {r.repeat} | " + " | ".join(cells) +
                     f" | {sum(r.cores.values()):.2f} | {threads} |")
    return lines


def report(runs: list[RunResult], meta: dict) -> str:
    cases = [c for c in meta["cases"] if any(r.case == c for r in runs)]
    algorithm = ALGORITHMS[meta["algorithm"]]
    modes = [m for m in MODES if any(r.mode == m for r in runs)]
    lines = [f"# Rollout schedules on one split placement, {meta['algorithm'].upper()}: {', '.join(modes)}, "
             f"{meta['date']}", "", f"- algorithm: {algorithm.description}",
             f"- megarl commit {meta['commit']}{meta['dirty']} at the start (each run's: *Per run*); {meta['machine']}",
             "- " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
             f"- 1-min load average before the first run: {meta['load_before']:.2f}; waited {meta['waited_s']:.0f} s "
             f"for < {meta['wait_load']} ({'reached' if meta['reached'] else 'NOT reached'}); load (1/5/15 min) at "
             f"start {' / '.join(f'{x:.2f}' for x in meta['load_start'])}",
             "- processes: the driver, pool `main` (1 Ray worker: policy TP1 + colocated reference if any), pool "
             "`gen` (1 Ray "
             "worker: the embedded rollout engine), Ray's own processes; all on the machine's cores", "",
             "## Method", "", meta["method"], "", "## Cases", "",
             "| case | model | rows/step (prompts x n) | response tokens | warm-up + measured steps |",
             "|---|---|---|---|---|"]
    for c in cases:
        g = GRPO_CASES[c]
        lines.append(f"| {c} | `make_task(dir, **{g.model})` | 16 x 16 | {g.max_new_tokens}"
                     f"{' (stop at eos)' if g.stop_at_eos else ' (no stop)'} | {meta['warmup'][c]} + "
                     f"{meta['steps'][c]} |")
    lines += ["", "## Results", "", "Medians over each run's measured steps (median over runs when repeated). "
              "*Ideal = planner*: `predict_step` on the sync run's stage times (gen = `timing/rollout_s`); *ideal "
              "from own stages*: `predict_step` on the mode's own stage times (gen = the engine's decode, async: the "
              "sync run's; sync: `timing/rollout_s`). Busy shares from each run's own stage times "
              "(async rollout pool: `~` = the sync run's decode seconds / the async step; in brackets 1 - the "
              "producer's wait `async/rollout_wait_s` / step, an upper bound). *Groups sampled / trained*: prompt "
              "groups generated and scored (`dynamic/groups_sampled`, all rounds; `data.batch_size` without dynamic "
              "sampling) plus those dropped as too stale (`async/dropped_groups`) over the groups trained "
              "(`dynamic/groups_trained`), summed over all measured steps of all runs; *groups trained / step*: their "
              "median; *s / group trained*: the step (its median, the column *step s*) over the mean groups "
              "trained per step (with dynamic sampling a step can train fewer than 16 groups: `on_short: train`).", ""]
    verdicts = []
    for c in cases:
        table, ratios = case_table(c, [r for r in runs if r.case == c])
        lines += table
        if "one_step_off" in ratios:
            ideal, own = ratios["one_step_off"]
            each = sorted(round_ratios([r for r in runs if r.case == c], "one_step_off"))
            spread = f"{each[0]:.2f} / {_med(each):.2f} / {each[-1]:.2f} ({len(each)})" if len(each) > 1 else "-"
            verdicts.append(f"| {c} | {ideal:.3f}x | {spread} | <= {TARGET}x | "
                            f"{'met' if ideal <= TARGET else 'MISSED'} | {own:.2f}x |")
    lines += ["## Target", "", "*Rounds*: each repeat's one_step_off run against the ideal from the sync run of the "
              "same round (min / median / max, rounds).", "",
              "| case | one_step_off measured / ideal | rounds | target | verdict | measured / ideal from its own "
              "stages |", "|---|---|---|---|---|---|",
              *verdicts, "",
              "## CPU during the measured steps", "", "Cores used per process (CPU seconds over the measured steps' "
              "wall time; *ray (other)*: GCS, raylet, agents, idle workers; *benchmark*: this script's sampling), and "
              "`OMP_NUM_THREADS` of each labelled "
              "process at exec (`-`: unset) / its threads that used >= 15 % of its busiest thread's CPU time.", "",
              *cpu_table(runs), "", "## Per run", "",
              "*Other processes*: CPU the machine's other processes used during each measured step (the machine's "
              "busy CPU, steal included, minus this run's processes'), median / max over the steps, in cores; "
              f"*used*: the steps with under {QUIET_CORES} cores of it, which the medians above are taken over "
              "(all steps, marked `all`, when fewer than 3).", "",
              "| case | mode | repeat | step s (median of used) | measured steps s | other processes | used | "
              "load 1-min start/end | waited s | wall s | commit |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        foreign = [s.foreign_cores for s in r.steps if s.foreign_cores is not None]
        other = f"{_med(foreign):.2f} / {max(foreign):.2f}" if foreign else "-"
        quiet = sum(f < QUIET_CORES for f in foreign)
        used = f"{quiet} of {len(r.steps)}" if foreign and quiet >= 3 else f"all {len(r.steps)}"
        lines.append(f"| {r.case} | {r.mode} | {r.repeat} | {r.med('step_s'):.3f} | "
                     f"{' '.join(f'{s.step_s:.2f}' for s in r.steps)} | {other} | {used} | "
                     f"{r.load[0]:.2f} / {r.load[1]:.2f} | {r.waited_s:.0f} | {r.wall_s:.0f} | {r.commit} |")
    common = " ".join(overrides(Path("<task>"), "tiny", "sync", Path("<out>"), 0))
    lines += ["", "## Exact configurations", "", f"`.venv/bin/python -m megarl.cli.main train "
              f"{algorithm.example.relative_to(ROOT)} " + common
              .replace("trainer.total_steps=0", "trainer.total_steps=<warm-up + measured>") + "` with "
              "`rollout.max_new_tokens` / `rollout.stop_at_eos` per case and per mode:", ""]
    lines += [f"- {m}: {' '.join(f'`{o}`' for o in MODES[m]) or '(nothing more)'}" for m in modes]
    lines += ["", "## Reproduce", "", "```", meta["command"], "```", ""]
    return "\n".join(lines)


METHOD = (
    "Each mode is a fresh `megarl train` subprocess on the same placement (pools `main` and `gen`, 1 device "
    "each); Ray start-up, model conversion and the warm-up steps are outside the measurement. Stage times come "
    "from each step's `timing/*` metrics; the ideal of every mode is the planner's `predict_step` "
    "(docs/planner.md §8) on the **sync** run's stage times, where every stage runs alone: gen = "
    "`timing/rollout_s`, reward = `timing/reward_s`, train = old log-probs + reference + advantages + update, sync "
    "= `timing/weight_sync_s`; sync: gen + reward + train + sync, one_step_off and async (push every update): "
    "max(gen + reward, train) + sync. Driver bookkeeping (callbacks, the workers' memory peaks) and dispatch "
    "between the timed stages are in no stage, so even sync measures above its ideal by them. Medians over the "
    f"measured steps during which the machine's other processes used under {QUIET_CORES} cores (*Per run*).")


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    return {p: md.version(p) for p in ("torch", "transformers", "megatron-core", "ray")}


def _parse(spec: str, names: list[str], default: dict[str, int]) -> dict[str, int]:
    if not spec:
        return {n: default[n] for n in names}
    if spec.isdigit():
        return dict.fromkeys(names, int(spec))
    return {n: default[n] for n in names} | {k: int(v) for k, v in (item.split("=") for item in spec.split(","))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithm", default="grpo", choices=list(ALGORITHMS))
    parser.add_argument("--cases", default="tiny,30m")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"of {', '.join(MODES)}")
    parser.add_argument("--repeats", default="", help="runs per mode (alternating): N or CASE=N,... (default 1)")
    parser.add_argument("--steps", default="", help="measured steps: N or CASE=N,... (default tiny=30,30m=10)")
    parser.add_argument("--warmup", default="", help="warm-up steps: N or CASE=N,... (default tiny=5,30m=2)")
    parser.add_argument("--wait-load", type=float, default=1.5)
    parser.add_argument("--max-wait", type=float, default=1200.0)
    parser.add_argument("--work", default=str(ROOT / "outputs" / "bench_schedules"))
    parser.add_argument("--results", default=None)
    parser.add_argument("--report-from", metavar="JSON", help="only rewrite the report from a run's raw results "
                        "(the results-<date>[-dapo].json it left under --work)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.report_from:
        return rewrite_report(Path(args.report_from), args.results)
    from tqdm import tqdm

    from megarl.bench.report import cpu_description
    from megarl.testing.addition import make_task

    names, modes = args.cases.split(","), args.modes.split(",")
    unknown = [m for m in modes if m not in MODES] + [n for n in names if n not in DEFAULT_STEPS]
    if unknown or "sync" not in modes:
        raise SystemExit(f"unknown cases/modes {unknown} (cases {list(DEFAULT_STEPS)}, modes {list(MODES)}); the "
                         "ideals need the sync mode")
    steps, warmup = _parse(args.steps, names, DEFAULT_STEPS), _parse(args.warmup, names, DEFAULT_WARMUP)
    repeats = _parse(args.repeats, names, dict.fromkeys(names, 1))
    work = Path(args.work)
    tasks = {n: make_task(work / n / "task", **GRPO_CASES[n].model) for n in names}
    load_before = os.getloadavg()[0]
    load_start, waited, reached = wait_for_load(args.wait_load, args.max_wait)
    date, algorithm = datetime.date.today().isoformat(), ALGORITHMS[args.algorithm]
    dirty = _git("status", "--porcelain", "--", "megarl")
    meta = dict(date=date, algorithm=args.algorithm, commit=_git("rev-parse", "--short", "HEAD"), cases=names,
                steps=steps, warmup=warmup,
                dirty=(f" + uncommitted changes to {len(dirty.splitlines())} file(s) under megarl/ (the working tree "
                       "measured)") if dirty else "",
                machine=f"{os.cpu_count()} CPU cores ({platform.machine()}, {cpu_description()}), "
                        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM, "
                        f"{platform.platform()}, Python {platform.python_version()}",
                versions=_versions(), load_before=load_before, load_start=load_start, waited_s=waited,
                reached=reached, wait_load=args.wait_load, method=METHOD,
                command=f".venv/bin/python benchmarks/schedules.py {' '.join(sys.argv[1:])}".strip())
    path = Path(args.results or ROOT / "benchmarks" / "results" / f"schedules-{date}{algorithm.suffix}.md")
    plan = [(n, r, m) for n in names for r in range(repeats[n]) for m in modes]
    runs: list[RunResult] = []
    for i, (name, repeat, mode) in enumerate(tqdm(plan, desc="runs", unit="run")):
        waited = wait_for_load(args.wait_load, args.max_wait)[1] if i else 0.0  # the first run waited above
        res = run_mode(algorithm, name, mode, repeat, tasks[name], work / name, steps[name], warmup[name])
        res.waited_s = waited
        logger.info("%s %s #%d: step %.3f s (median of %d of %d steps), load %.2f/%.2f", name, mode, repeat,
                    res.med("step_s"), len(res.quiet), len(res.steps), *res.load)
        runs.append(res)
        if mode == modes[-1]:  # a full round: rewrite the report with what has run so far
            path.write_text(report(runs, meta))
            raw = {"meta": meta, "runs": [dataclasses.asdict(r) for r in runs]}
            (work / f"results-{date}{algorithm.suffix}.json").write_text(json.dumps(raw, indent=1))
    print(path.read_text())


def rewrite_report(raw_path: Path, results: str | None) -> None:
    raw = json.loads(raw_path.read_text())
    runs = [RunResult(**(r | {"steps": [Step(**s) for s in r["steps"]], "load": tuple(r["load"])}))
            for r in raw["runs"]]
    meta = {"algorithm": "grpo"} | raw["meta"] | {"method": METHOD}  # the files before --algorithm: GRPO
    suffix = ALGORITHMS[meta["algorithm"]].suffix
    path = Path(results or ROOT / "benchmarks" / "results" / f"schedules-{meta['date']}{suffix}.md")
    path.write_text(report(runs, meta))
    print(path.read_text())


if __name__ == "__main__":
    main()
