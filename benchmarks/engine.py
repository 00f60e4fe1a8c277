"""Benchmark the engine: tokens/s of PolicyRole log-prob and PPO-update passes vs their fp32 FLOP floor, and the
peak memory of a log-prob pass vs vocabulary size.

    .venv/bin/python benchmarks/engine.py [--layouts tp1,tp2,tp2pp2] [--iters 3] [--batch 16] [--seq 256]
        [--max-tokens 1024] [--variant default|malloc] [--no-profile] [--no-memory] [--append] [--results FILE]

A random Llama (hidden 512, 8 layers, vocab 32000) converted at tp=1 is loaded by each layout (a spawned gloo world,
Adam, token-budget micro-batches). Floor time = FLOPs / rate: FLOPs = 2N per token forward, 6N forward+backward,
N = parameters but the input embedding (a lookup); rate = the sum over ranks of each rank's GFLOP/s on the model's own
GEMMs (one micro-batch through its linear layers), all ranks timing at once after every iteration. TP1 is profiled
(torch.profiler). Memory: a fresh one-rank world per (vocab, micro-batch tokens) samples its RSS during its first
log-prob pass. ``--variant malloc`` is a what-if: glibc keeps freed memory (no mmap/munmap and page faults per large
tensor). The 1-minute load average is sampled while each world runs (the cores may be shared). Prints and writes
(or appends to) benchmarks/results/engine-<date>.md.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import logging
import os
import platform
import resource
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

logger = logging.getLogger("bench.engine")
LAYOUTS = {"tp1": (1, 1, 2), "tp1-1thread": (1, 1, 1), "tp2": (2, 1, 1), "tp2pp2": (2, 2, 1)}  # tp, pp, threads/rank
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**34), "MALLOC_TRIM_THRESHOLD_": str(2**34)}  # --variant malloc
SHAPE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8, num_kv_heads=4)
MEM_SHAPE = dict(hidden_size=256, intermediate_size=704, num_layers=2, num_heads=4, num_kv_heads=2)
TARGET = 1.5
MIB = 2**20


def flop_params(spec) -> int:
    """N for the FLOP floor: every parameter but the input embedding (a lookup); the LM head counts."""
    return spec.num_parameters() - spec.vocab_size * spec.hidden_size


def gemms(spec) -> list[tuple[str, int, int, int]]:
    """(name, k, n, count) of the model's linear layers: x[T, k] @ w[k, n], ``count`` times per forward."""
    h, f, L = spec.hidden_size, spec.ffn_hidden_size, spec.num_layers
    return [("qkv", h, spec.qkv_rows, L), ("proj", spec.num_attention_heads * spec.head_dim, h, L),
            ("fc1", h, 2 * f, L), ("fc2", f, h, L), ("head", h, spec.vocab_size, 1)]


def gemm_rates(spec, tokens: int, seconds: float = 0.25) -> dict[str, float]:
    """GFLOP/s of this process per GEMM shape and for the model's mix (FLOP-weighted: total FLOPs / total time)."""
    rates, flops, total = {}, 0.0, 0.0
    for name, k, n, count in gemms(spec):
        a, b = torch.randn(tokens, k), torch.randn(k, n)
        a @ b
        runs, t_end = [], time.perf_counter() + seconds
        while time.perf_counter() < t_end or len(runs) < 3:
            t = time.perf_counter()
            a @ b
            runs.append(time.perf_counter() - t)
        dt = statistics.median(runs)
        rates[f"{name} [{tokens},{k}]x[{k},{n}]"] = 2 * tokens * k * n / dt / 1e9
        flops, total = flops + count * 2 * tokens * k * n, total + count * dt
    return {**rates, "model mix": flops / total / 1e9}


class LoadSampler:
    """The 1-minute load average, sampled every ``period`` seconds in a thread while a world runs."""

    def __init__(self, period: float = 2.0) -> None:
        self.samples: list[float] = []
        self._done, self._period = threading.Event(), period
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._done.wait(self._period if self.samples else 0.0):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def summary(self) -> str:
        return f"{min(self.samples):.1f} / {statistics.median(self.samples):.1f} / {max(self.samples):.1f}"


def make_batch(b: int, s: int, vocab: int, response: int):
    from megarl.data.batch import Batch

    g = torch.Generator().manual_seed(0)
    resp = torch.zeros(b, s)
    resp[:, s - response:] = 1
    return Batch.from_dict({"input_ids": torch.randint(5, vocab, (b, s), generator=g),
                            "attention_mask": torch.ones(b, s), "response_mask": resp,
                            "old_log_probs": -5.0 + 0.1 * torch.randn(b, s, generator=g) * resp,
                            "advantages": torch.randn(b, s, generator=g) * resp})


def make_role(rank: int, world: int, ckpt: str, tp: int, pp: int, threads: int, max_tokens: int, trainable=True):
    torch.set_num_threads(threads)  # run_world pins 1 thread per rank; TP1 uses both cores
    from megarl.algos.config import AlgorithmConfig
    from megarl.controller.role import WorkerContext
    from megarl.engine.config import EngineConfig, MicroBatchConfig
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.policy import PolicyRole

    layout = ParallelLayout.for_world(world, tp=tp, pp=pp)
    init_distributed(layout)
    ctx = WorkerContext(rank, world, layout, layout.coords(rank), "127.0.0.1", "local", os.getpid(), "cpu")
    engine = EngineConfig(micro_batch=MicroBatchConfig(max_tokens=max_tokens, max_size=64))
    # the update's PPO ratio takes the batch's old_log_probs (as a PPO run with several mini-batches does)
    return PolicyRole(ctx, checkpoint_dir=ckpt, engine=engine, algorithm=AlgorithmConfig(recompute_old_log_probs=True),
                      temperature=1.0, trainable=trainable)


def _marked(fn, label: str):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        with torch.profiler.record_function(label):
            return fn(*a, **kw)
    return wrapper


def profile(role, batch) -> dict:
    """One log-prob and one update pass under torch.profiler: time by region and the top ops by self time."""
    import megarl.roles.policy as policy

    eng = role.engine
    policy.token_log_probs = _marked(policy.token_log_probs, "megarl: token_log_probs (fwd)")
    eng.optimizer.step = _marked(eng.optimizer.step, "megarl: optimizer.step")
    eng._micro_batches = _marked(eng._micro_batches, "megarl: micro-batch cutting")
    eng._all_finite = _marked(eng._all_finite, "megarl: finite check")
    out = {}
    for name, call in (("log-prob", role.compute_log_probs), ("update", role.update)):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            call(batch)
            wall = time.perf_counter() - t
        ev = prof.key_averages()
        incl = {e.key: e.cpu_time_total / 1e6 for e in ev}
        self_t = {e.key: e.self_cpu_time_total / 1e6 for e in ev}
        regions = {k: v for k, v in incl.items() if k.startswith("megarl:") or "VocabParallel" in k}
        regions["GEMMs (aten::mm/addmm/bmm/baddbmm self)"] = sum(
            self_t.get(k, 0.0) for k in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"))
        regions["attention softmax (+backward, self)"] = sum(
            self_t.get(k, 0.0) for k in ("aten::_softmax", "aten::_softmax_backward_data"))
        regions["remainder (wall - the above, not nested)"] = wall - sum(
            v for k, v in regions.items() if k.startswith(("GEMMs", "attention", "megarl: opt", "megarl: fin",
                                                          "megarl: micro", "megarl: token", "autograd::")))
        top = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:12]
        out[name] = {"wall": wall, "regions": regions,
                     "top": [(e.key, e.count, e.self_cpu_time_total / 1e6) for e in top]}
    return out


def bench_world(rank: int, world: int, ckpt: str, tp: int, pp: int, threads: int, args: dict) -> dict:
    import torch.distributed as dist

    role = make_role(rank, world, ckpt, tp, pp, threads, args["max_tokens"])
    batch = make_batch(args["batch"], args["seq"], role.spec.vocab_size, args["seq"] // 2)
    mb_tokens = min(args["max_tokens"], args["batch"] * args["seq"])

    times, rates = {"log-prob": [], "update": []}, []
    for i in range(args["iters"] + 1):  # iteration 0: warm-up; all interleaved so load changes hit everything
        for name, call in (("log-prob", role.compute_log_probs), ("update", role.update)):
            dist.barrier()
            t = time.perf_counter()
            call(batch)
            dist.barrier()
            if i:
                times[name].append(time.perf_counter() - t)
        dist.barrier()  # every rank at once: the rate this world's processes get together
        rates.append(gemm_rates(role.spec, mb_tokens, 0.15)["model mix"])
    res = {"rates": rates, "times": times, "threads": torch.get_num_threads()}
    if args["profile"] and world == 1:
        res["profile"] = profile(role, batch)
    return res


def mem_world(rank: int, world: int, ckpt: str, max_tokens: int, args: dict) -> dict:
    """Peak RSS above the pre-pass RSS during this fresh process's first log-prob pass (1 ms psutil sampling
    and ru_maxrss, whichever is higher)."""
    role = make_role(rank, world, ckpt, 1, 1, 2, max_tokens, trainable=False)
    batch = make_batch(args["batch"], args["seq"], role.spec.vocab_size, args["seq"] // 2)
    proc, peak, done = psutil.Process(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.001)

    base, maxrss0 = proc.memory_info().rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sampler = threading.Thread(target=sample)
    sampler.start()
    role.compute_log_probs(batch)
    done.set()
    sampler.join()
    maxrss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    top = max(peak[0], maxrss1 if maxrss1 > maxrss0 else 0)
    return {"peak_delta": top - base, "padded_vocab": role.spec.padded_vocab_size(1)}


def model(tmp: Path, name: str, **shape) -> tuple[str, object]:
    from megarl.checkpoint.convert import convert_hf_to_megatron
    from megarl.models.spec import load_hf_config, spec_from_hf_config
    from megarl.testing.tiny import make_tiny_model

    hf = make_tiny_model(tmp / f"{name}-hf", "llama", with_tokenizer=False, **shape)
    convert_hf_to_megatron(hf, tmp / f"{name}-mc", tp=1, pp=1)
    return str(tmp / f"{name}-mc"), spec_from_hf_config(load_hf_config(hf))


def render(info: dict, spec, rates: dict, rows: list, prof: dict | None, mem: list, args) -> str:
    n, tokens = flop_params(spec), args.batch * args.seq
    out = [f"# Engine benchmark, {info['date']}, variant: {args.variant}", "",
           f"- megarl commit {info['commit']}; {info['machine']}; {info['platform']}",
           f"- Python {platform.python_version()}, torch {torch.__version__}, megatron-core {info['mcore']}; "
           f"worlds' extra env {info['env'] or '{}'}",
           f"- load average (1/5/15 min): {info['load0']} at start, {info['load1']} at end (other engineers' "
           "processes share the 2 cores)", "", "## Model and batch", "",
           f"- Llama {SHAPE}: {spec.num_parameters() / 1e6:.2f} M parameters in all; N = {n / 1e6:.2f} M for the "
           f"floor (all but the {spec.vocab_size * spec.hidden_size / 1e6:.2f} M input embedding, a lookup; the "
           "untied LM head counts)",
           f"- batch {args.batch} x {args.seq} tokens (all attended, response = last {args.seq // 2}), {tokens} "
           f"tokens; micro-batches of <= {args.max_tokens} tokens; Adam, fp32; median of {args.iters} iterations "
           "after 1 warm-up", "", "## fp32 matmul rate (GFLOP/s, main process, before the worlds)", "",
           "| GEMM | 1 thread | 2 threads |", "|---|---|---|"]
    out += [f"| {k} | {rates[1][k]:.1f} | {rates[2][k]:.1f} |" for k in rates[1]]
    if rows:
        out += ["", "## Throughput vs FLOP floor", "", "Rate: after every iteration's two passes all ranks time the "
                "model mix at once; the floor uses the median over iterations of the ranks' sum. The target is judged "
                "on medians; 'best' is the fastest iteration (least disturbed by other processes on the shared "
                "cores) against the same floor.", "",
                "| layout | ranks x threads | 1-min load min/median/max | rate GFLOP/s min/median/max | pass | "
                "median s | tokens/s | floor tokens/s | measured/floor | target <= 1.5x | best s | best/floor |",
                "|---" * 12 + "|"]
    for name, (tp, pp, threads), r in rows:
        agg = [sum(x) for x in zip(*r["rates"], strict=True)]
        rate = statistics.median(agg)
        for p, mult in (("log-prob", 2), ("update", 6)):
            t = statistics.median(r["times"][p])
            floor = rate * 1e9 / (mult * n)
            ratio = floor / (tokens / t)
            met = ("met" if ratio <= TARGET else "MISSED") if name.startswith("tp1") else "n/a"
            best = min(r["times"][p])  # the iteration least disturbed by other processes
            best_ratio = floor / (tokens / best)
            out.append(f"| {name} | {tp * pp} x {threads} | {r['load']} | {min(agg):.0f} / {rate:.0f} / "
                       f"{max(agg):.0f} | {p} | {t:.2f} | {tokens / t:.0f} | {floor:.0f} | {ratio:.2f}x | {met} | "
                       f"{best:.2f} | {best_ratio:.2f}x |")
    if prof:
        out += ["", "## TP1 profile (torch.profiler, one pass each; seconds, profiler overhead included)", ""]
    for p, d in (prof or {}).items():
        out += [f"**{p}**: wall {d['wall']:.2f} s", "", "| region (inclusive) | s |", "|---|---|"]
        out += [f"| {k} | {v:.2f} |" for k, v in sorted(d["regions"].items(), key=lambda kv: -kv[1])]
        out += ["", "| op | calls | self s |", "|---|---|---|"]
        out += [f"| {k} | {c} | {s:.2f} |" for k, c, s in d["top"]] + [""]
    if mem:
        out += ["", f"## Log-prob pass peak RSS vs vocabulary ({tokens} tokens; model {MEM_SHAPE})", "",
                "| vocab (padded) | micro-batch tokens | full [B,S,V] fp32 MiB | one micro-batch's logits MiB | peak "
                "RSS increase MiB | peak / micro-batch logits | peak / full logits |", "|---" * 7 + "|"]
    for v, mt, m in mem:
        full, mbl = tokens * m["padded_vocab"] * 4 / MIB, min(mt, tokens) * m["padded_vocab"] * 4 / MIB
        pk = m["peak_delta"] / MIB
        out.append(f"| {v} ({m['padded_vocab']}) | {min(mt, tokens)} | {full:.0f} | {mbl:.0f} | {pk:.0f} | "
                   f"{pk / mbl:.2f} | {pk / full:.2f} |")
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="tp1,tp2,tp2pp2", help=f"comma-separated, from {list(LAYOUTS)}")
    p.add_argument("--iters", type=int, default=3, help="timed iterations per pass (after 1 warm-up)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=1024, help="micro-batch token budget")
    p.add_argument("--mem-vocabs", default="8000,32000,64000")
    p.add_argument("--mem-max-tokens", default="1024,4096", help="micro-batch budgets of the memory runs")
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--no-memory", dest="memory", action="store_false")
    p.add_argument("--variant", choices=("default", "malloc"), default="default")
    p.add_argument("--append", action="store_true", help="append to the results file instead of replacing it")
    p.add_argument("--results", help="results file (default: benchmarks/results/engine-<today>.md)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import megatron.core

    from megarl.testing.dist import run_world

    root = Path(__file__).resolve().parent.parent
    ram = psutil.virtual_memory().total / 2**30
    info = dict(date=datetime.date.today().isoformat(), platform=platform.platform(), mcore=megatron.core.__version__,
                load0=" / ".join(f"{x:.2f}" for x in os.getloadavg()),
                machine=f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), {ram:.0f} GiB "
                        f"RAM, {'a GPU' if torch.cuda.is_available() else 'no GPU'}",
                commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                      text=True).stdout.strip())
    info["env"] = MALLOC_ENV if args.variant == "malloc" else {}
    os.environ.update(info["env"])  # read by glibc when each spawned rank starts (this process is already running)
    wargs = dict(batch=args.batch, seq=args.seq, iters=args.iters, max_tokens=args.max_tokens, profile=args.profile)
    with tempfile.TemporaryDirectory(prefix="megarl-bench-engine-") as tmp:
        ckpt, spec = model(Path(tmp), "main", **SHAPE)
        mb_tokens = min(args.max_tokens, args.batch * args.seq)
        rates = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            rates[threads] = gemm_rates(spec, mb_tokens)
            logger.info("%d thread(s): model mix %.1f GFLOP/s", threads, rates[threads]["model mix"])
        rows, prof = [], None
        for name in filter(None, args.layouts.split(",")):
            tp, pp, threads = LAYOUTS[name]
            t = time.perf_counter()
            with LoadSampler() as load:
                res = run_world(bench_world, tp * pp, ckpt, tp, pp, threads, wargs, timeout_s=1200)
            logger.info("%s: %.0f s, times %s", name, time.perf_counter() - t, res[0]["times"])
            rows.append((name, (tp, pp, res[0]["threads"]), {"times": res[0]["times"], "load": load.summary(),
                                                             "rates": [r["rates"] for r in res]}))
            prof = prof or res[0].get("profile")
        mem = []
        for v in map(int, args.mem_vocabs.split(",")) if args.memory else ():
            mckpt, _ = model(Path(tmp), f"mem{v}", vocab_size=v, **MEM_SHAPE)
            for mt in map(int, args.mem_max_tokens.split(",")):
                mem.append((v, mt, run_world(mem_world, 1, mckpt, mt, wargs, timeout_s=600)[0]))
                logger.info("memory: vocab %d, max_tokens %d: %s", v, mt, mem[-1][2])
    info["load1"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    text = render(info, spec, rates, rows, prof, mem, args)
    print(text)
    out = Path(args.results or root / "benchmarks" / "results" / f"engine-{info['date']}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a" if args.append else "w") as f:
        f.write(("\n" if args.append else "") + text)
    logger.info("wrote %s", out)


if __name__ == "__main__":
    main()
