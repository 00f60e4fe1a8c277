"""Benchmark the controller's dispatch: no-op group call latency and DP batch transfer bandwidth.

    .venv/bin/python benchmarks/dispatch.py [--mib 64] [--calls 300] [--iters 15] [--layouts dp4,tp2dp2]
        [--variant default|zero-copy-torch|numpy-batch] [--append] [--results FILE]

Measures a 4-rank WorkerGroup per layout against plain Ray actors in the same run (method: ``METHOD``, also
written to the results), prints the tables and writes them to benchmarks/results/dispatch-<date>.md.
``--variant`` is a what-if (Ray's zero-copy torch serializer, or Batch pickled as numpy arrays); ``--append``
adds its tables to the file.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import pickle
import platform
import subprocess
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from megarl.controller.role import Role, WorkerContext
from megarl.data.batch import Batch

logger = logging.getLogger("bench.dispatch")
LAYOUTS = {"dp4": (1, 4), "tp2dp2": (2, 2)}  # name -> (tp, dp); pp = 1
STEPS = ("split", "ray.put x dp", "submit", "to worker entry", "worker compute", "back to driver", "concat",
         "split, N-1 rows")
METHOD = """\
- Local Ray (`num_cpus=4`, 2 GiB object store); a pool of 4 CPU slots (0.5 CPU) and one WorkerGroup per layout,
  one after the other; 4 plain actors (0.5 CPU, torch imported). Latency: the six cases interleaved (each once per
  round, untimed warm-up rounds first), round trips timed in the driver. `raw actor.call` = the same
  `WorkerProcess.call` without megarl's driver code (`submit`/`gather`); `plain actor` = the floor.
- Transfer, interleaved (every case once per iteration, after warm-up). *send*: `handle.dp_split(TransferRole.receive)`
  (chunk, `ray.put` per DP shard, every rank of a DP rank reads it and sums x and id, owners return one row: a
  reduction, which `handle.dp` refuses, as it takes a whole number of result rows per input row) vs
  owned copies of the same shards (cloned before timing) as dicts of torch tensors / numpy arrays, `ray.put` once
  each and read by the plain actors of that DP rank (tp2dp2: each shard read by 2 actors, in both cases).
  *round trip*: owners return their shard, the driver concatenates. GB/s = batch bytes / median time;
  `vs plain X` = plain median / this median (> 1: faster).
- Step by step: `dp_async` replayed with the group's internals; `to worker entry` = the role method's first line
  minus the end of submit (dispatch, argument fetch, unpickling); `back to driver` = results in the driver minus the
  last worker's return; `split, N-1 rows` = pad + chunk of a batch one row short of a multiple of dp.
- Pickling table: the shard as `chunk` makes it (views into the whole batch); in the numpy-batch variant the
  registered serializer also applies to the first row.
- Noise: 2 cores shared by driver, raylet, 8 actors and other engineers' test runs (see load averages); absolute
  times are pessimistic; ratios between cases of the same iterations are the meaningful numbers."""


def batch_to_numpy(batch: Batch) -> tuple:
    """What-if serializer: tensors as uint8 numpy views, which pickle 5 (Ray) ships out-of-band, zero-copy."""
    arrays = {k: (t.contiguous().reshape(-1).view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."),
                  tuple(t.shape)) for k, t in batch.tensors.items()}
    return arrays, batch.non_tensors, batch.meta


def batch_from_numpy(state: tuple) -> Batch:
    arrays, non_tensors, meta = state
    with warnings.catch_warnings():  # read-only object-store buffers: tensors must not be written in place
        warnings.simplefilter("ignore", UserWarning)
        tensors = {k: torch.from_numpy(a).view(getattr(torch, dt)).reshape(s) for k, (a, dt, s) in arrays.items()}
    return Batch.from_dict(tensors, non_tensors, meta)


class TransferRole(Role):
    """Receives a shard, touches every byte (a sum) and returns one row, or returns the shard."""

    def __init__(self, ctx: WorkerContext, numpy_batch: bool = False) -> None:
        super().__init__(ctx)
        if numpy_batch:  # what-if, for this worker's own pickling (returned batches)
            import ray

            ray.util.register_serializer(Batch, serializer=batch_to_numpy, deserializer=batch_from_numpy)

    def receive(self, batch: Batch) -> Batch | None:
        t_enter = time.time()
        total = batch["x"].sum() + batch["id"].sum()
        if not self.ctx.is_collect_rank:
            return None
        stamps = torch.tensor([[t_enter, time.time()]], dtype=torch.float64)
        return Batch.from_dict({"sum": total.reshape(1).double(), "stamps": stamps})

    def echo(self, batch: Batch) -> Batch | None:
        return batch if self.ctx.is_collect_rank else None


class PlainActor:
    """The floor: a plain Ray actor that imports torch like the workers do."""

    def noop(self) -> None:
        return None

    def receive(self, shard: dict) -> float:
        return sum(float(v.sum()) for v in shard.values())

    def echo(self, shard: dict) -> dict:
        return shard


def interleaved(cases: dict[str, Callable[[], object]], n: int, warmup: int) -> list[tuple[str, dict]]:
    """Each case once per round (so load changes hit every case alike); stats of the last ``n`` rounds."""
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for i in range(warmup + n):
        for label, fn in cases.items():
            t = time.perf_counter()
            fn()
            if i >= warmup:
                samples[label].append(time.perf_counter() - t)
    return [(label, stats(s)) for label, s in samples.items()]


def stats(samples: list[float]) -> dict[str, float]:
    a = np.asarray(samples) * 1e3
    return {"n": len(a), "median": float(np.median(a)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


def bench_layout(name: str, plain: list, batch: Batch, args: argparse.Namespace) -> tuple[list, list, dict]:
    import ray

    from megarl.controller import dispatch
    from megarl.controller.group import WorkerGroup
    from megarl.controller.pools import ResourcePool
    from megarl.controller.spec import GroupOptions, PoolConfig, Timeouts
    from megarl.parallel.layout import ParallelLayout
    from megarl.testing.roles import EchoRole

    tp, dp = LAYOUTS[name]
    pool = ResourcePool(f"bench-{name}", PoolConfig(nodes=1, devices_per_node=4, cpus_per_device=0.5))
    t = time.perf_counter()
    group = WorkerGroup(f"bench-{name}", pool, ParallelLayout(tp=tp, dp=dp),
                        GroupOptions(timeouts=Timeouts(call_s=300.0), env=args.env))
    logger.info("%s: 4 ranks started in %.1f s", name, time.perf_counter() - t)
    echo = group.add_role("echo", EchoRole)
    xfer = group.add_role("xfer", TransferRole, args.variant == "numpy-batch")
    actors, members = group.actors, dispatch.dp_members(group.layout)
    lat = {"handle.all(noop), 4 ranks": lambda: echo.all(EchoRole.noop),
           "raw actor.call x4 + ray.get": lambda: ray.get([a.call.remote("echo", EchoRole.noop) for a in actors]),
           "plain actor noop x4 + ray.get": lambda: ray.get([a.noop.remote() for a in plain]),
           "handle.one(0, noop)": lambda: echo.one(0, EchoRole.noop),
           "raw actor.call x1 + ray.get": lambda: ray.get(actors[0].call.remote("echo", EchoRole.noop)),
           "plain actor noop x1 + ray.get": lambda: ray.get(plain[0].noop.remote())}
    lat_rows = [(f"{name} {k}", s) for k, s in interleaved(lat, args.calls, args.warmup)]

    owned = [{k: v.clone() for k, v in s.tensors.items()} for s in batch.chunk(dp)]  # exactly the shard's bytes

    def plain_case(method: str, to_numpy: bool) -> Callable[[], object]:
        def run() -> object:
            refs = []
            for d, shard in enumerate(owned):
                ref = ray.put({k: (v.numpy() if to_numpy else v) for k, v in shard.items()})
                refs += [getattr(plain[r], method).remote(ref) for r in members[d]]
            out = ray.get(refs)
            if method == "echo":  # the whole batch again, as Batch.concat does
                return {k: torch.cat([torch.as_tensor(o[k]) for o in out[::tp]]) for k in out[0]}
            return out
        return run

    cases = {"dp send: handle.dp_split(receive)": lambda: xfer.dp_split(TransferRole.receive, batch),
             "plain send: torch": plain_case("receive", False), "plain send: numpy": plain_case("receive", True),
             "dp round trip: handle.dp(echo)": lambda: xfer.dp(TransferRole.echo, batch),
             "plain round trip: torch": plain_case("echo", False), "plain round trip: numpy": plain_case("echo", True)}
    xfer_rows = [(f"{name} {k}", s) for k, s in interleaved(cases, args.iters, args.xfer_warmup)]

    prof: dict[str, list[float]] = {k: [] for k in STEPS}
    odd = batch.slice(0, len(batch) - 1)
    for _ in range(args.iters):  # dp_async step by step; worker clocks come back in the result
        t0 = time.time()
        padded, pad = batch.pad_to_multiple(dp)
        shards = padded.chunk(dp)
        t1 = time.time()
        refs = [ray.put(s) for s in shards]
        t2 = time.time()
        futures = {r: group.submit("xfer", r, TransferRole.receive, refs[d])
                   for d, ranks in enumerate(members) for r in ranks}
        t3 = time.time()
        res = group.gather("xfer", futures, 300.0)
        t4 = time.time()
        out = Batch.concat([res[r] for r in dispatch.collect_ranks(group.layout)]).unpad(pad)
        t5 = time.time()
        odd.pad_to_multiple(dp)[0].chunk(dp)
        t6 = time.time()
        enter, leave = out["stamps"][:, 0], out["stamps"][:, 1]
        for k, v in zip(STEPS, (t1 - t0, t2 - t1, t3 - t2, float(enter.max()) - t3, float((leave - enter).max()),
                                t4 - float(leave.max()), t5 - t4, t6 - t5), strict=True):
            prof[k].append(v)
    group.shutdown()
    pool.release()
    return lat_rows, xfer_rows, {k: float(np.median(v)) * 1e3 for k, v in prof.items()}


def pickling_costs(batch: Batch, dp: int) -> list[tuple[str, float, float, int, float]]:
    """One DP shard (a view, as ``chunk`` makes it) through cloudpickle protocol 5, as Ray pickles:
    (object, dumps ms, loads ms, out-of-band buffers, MiB pickled in-band + out-of-band)."""
    from ray import cloudpickle

    shard, same, rows = batch.chunk(dp)[0], (lambda o: o), []
    for kind, obj, to, back in (("Batch shard (TensorDict of views)", shard, same, same),
                                ("dict of torch views", dict(shard.tensors.items()), same, same),
                                ("dict of owned torch tensors", {k: v.clone() for k, v in shard.tensors.items()},
                                 same, same),
                                ("dict of numpy views", {k: v.numpy() for k, v in shard.tensors.items()}, same, same),
                                ("Batch shard, what-if numpy serializer", shard, batch_to_numpy, batch_from_numpy)):
        runs = []
        for _ in range(6):
            bufs: list = []
            t0 = time.perf_counter()
            data = cloudpickle.dumps(to(obj), 5, buffer_callback=bufs.append)
            t1 = time.perf_counter()
            back(pickle.loads(data, buffers=bufs))
            runs.append((t1 - t0, time.perf_counter() - t1))
        dumps, loads = np.median(np.asarray(runs[1:]), axis=0) * 1e3
        size = len(data) + sum(memoryview(b).nbytes for b in bufs)
        rows.append((kind, float(dumps), float(loads), len(bufs), size / 2**20))
    return rows


def render(info: dict, lat: list, xfer: list, prof: dict, pick: list, nbytes: int) -> str:
    ms = {k: s["median"] for k, s in xfer}
    lines = [f"# Dispatch benchmark, {info['date']}, variant: {info['variant']}", "",
             f"- megarl commit {info['commit']}; {info['machine']}; {info['platform']}",
             f"- Python {info['python']}, ray {info['ray']}, torch {info['torch']}, tensordict {info['tensordict']}, "
             f"numpy {np.__version__}; worker env {info['env'] or '{}'}",
             f"- load average (1 min): {info['load0']:.2f} at start, {info['load1']:.2f} at end", "",
             "## No-op call round trip (ms)", "", "| case | calls | median | p90 | p99 | mean |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {k} | {s['n']} | {s['median']:.2f} | {s['p90']:.2f} | {s['p99']:.2f} | {s['mean']:.2f} |"
              for k, s in lat]
    lines += ["", f"## Batch transfer, {nbytes / 2**20:.2f} MiB ({nbytes / 1e9:.4f} GB)", "",
              "| case | iters | median ms | p90 ms | GB/s (median) | vs plain torch | vs plain numpy |",
              "|---|---|---|---|---|---|---|"]
    for k, s in xfer:
        base = f"{k.split(' ')[0]} plain {'send' if 'send' in k else 'round trip'}"
        lines.append(f"| {k} | {s['n']} | {s['median']:.1f} | {s['p90']:.1f} | {nbytes / s['median'] / 1e6:.2f} | "
                     f"{ms[base + ': torch'] / s['median']:.2f}x | {ms[base + ': numpy'] / s['median']:.2f}x |")
    lines += ["", "## One dp send step by step (median ms; time.time() clocks of one host)", "",
              "| layout | " + " | ".join(STEPS) + " |", "|---" * (1 + len(STEPS)) + "|"]
    lines += [f"| {k} | " + " | ".join(f"{v:.1f}" for v in p.values()) + " |" for k, p in prof.items()]
    lines += ["", f"## One DP4 shard ({nbytes / 4 / 2**20:.2f} MiB) through cloudpickle protocol 5, in the driver", "",
              "| object | dumps ms | loads ms | out-of-band buffers | MiB pickled |", "|---|---|---|---|---|"]
    lines += [f"| {k} | {d:.1f} | {ld:.1f} | {b} | {mib:.2f} |" for k, d, ld, b, mib in pick]
    lines += ["", "## Targets", ""]
    lines += [f"- {k}: median {s['median']:.2f} ms < 10 ms: {'met' if s['median'] < 10 else 'MISSED'}"
              for k, s in lat if "handle.all" in k]
    for k, _ in xfer:
        for base in ("torch", "numpy") if " dp send" in k else ():
            r = ms[f"{k.split(' ')[0]} plain send: {base}"] / ms[k]
            lines.append(f"- {k}: {r:.2f}x the bandwidth of plain send ({base}); >= 0.5x: "
                         f"{'met' if r >= 0.5 else 'MISSED'}")
    return "\n".join([*lines, "", "## Method", "", METHOD]) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=64, help="size of x in MiB (float32 [N, D]); plus an int64 id column")
    p.add_argument("--dim", type=int, default=1024, help="row width D of x")
    p.add_argument("--calls", type=int, default=300, help="timed no-op rounds (each case once per round)")
    p.add_argument("--warmup", type=int, default=30, help="untimed no-op warm-up rounds")
    p.add_argument("--iters", type=int, default=15, help="timed transfer rounds")
    p.add_argument("--xfer-warmup", type=int, default=2, help="untimed transfer warm-up rounds")
    p.add_argument("--layouts", default="dp4,tp2dp2", help=f"comma-separated, from {sorted(LAYOUTS)}")
    p.add_argument("--variant", choices=("default", "zero-copy-torch", "numpy-batch"), default="default")
    p.add_argument("--results", help="results file (default: benchmarks/results/dispatch-<today>.md)")
    p.add_argument("--append", action="store_true", help="append to the results file instead of replacing it")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    args.env = {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"} if args.variant == "zero-copy-torch" else {}
    os.environ.update(args.env)  # read when ray is imported (driver); actors get it in their runtime_env
    import ray
    import tensordict

    root = Path(__file__).resolve().parent.parent
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = "a GPU" if torch.cuda.is_available() else "no GPU"
    info = dict(date=datetime.date.today().isoformat(), variant=args.variant, env=args.env,
                platform=platform.platform(), python=platform.python_version(), ray=ray.__version__,
                torch=torch.__version__, tensordict=tensordict.__version__, load0=os.getloadavg()[0],
                machine=f"{os.cpu_count()} CPU cores, {ram:.0f} GiB RAM, {gpu}",
                commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                      text=True).stdout.strip())
    n = args.mib * 2**20 // (4 * args.dim) // 4 * 4
    batch = Batch.from_dict({"x": torch.randn(n, args.dim), "id": torch.arange(n)})
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=2 * 1024**3, log_to_driver=False)
    try:
        if args.variant == "numpy-batch":
            ray.util.register_serializer(Batch, serializer=batch_to_numpy, deserializer=batch_from_numpy)
        plain = [ray.remote(num_cpus=0.5, runtime_env={"env_vars": args.env})(PlainActor).remote() for _ in range(4)]
        ray.get([a.noop.remote() for a in plain])
        lat, xfer, prof = [], [], {}
        for name in args.layouts.split(","):
            lat_rows, xfer_rows, prof[name] = bench_layout(name, plain, batch, args)
            lat, xfer = lat + lat_rows, xfer + xfer_rows
        pick = pickling_costs(batch, 4)
    finally:
        ray.shutdown()
    info["load1"] = os.getloadavg()[0]
    text = render(info, lat, xfer, prof, pick, batch.nbytes())
    print(text)
    out = Path(args.results or root / "benchmarks" / "results" / f"dispatch-{info['date']}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a" if args.append else "w") as f:
        f.write(("\n" if args.append else "") + text)
    logger.info("wrote %s", out)


if __name__ == "__main__":
    # Run as module `dispatch` (Ray puts this script's directory on the workers' sys.path), so TransferRole and
    # the what-if serializer are pickled by reference like a real role, not by value (~2 ms per call).
    import dispatch

    dispatch.main()
