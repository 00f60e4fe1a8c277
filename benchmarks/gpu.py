"""Time the policy worker's CUDA paths on a lent GPU machine (never in CI): one prepared run.

    python benchmarks/gpu.py [--out DIR] [--batch 32] [--seq 1024] [--prompts 64] [--prompt-len 128] [--new 256]

In a NCCL world of one, on a random model of Qwen2.5-0.5B's shape (bf16 weights, fp32 master weights and
Adam states through megatron-core's distributed optimizer): the device's bf16 matmul rate, a log-prob pass
and a PPO update over ``batch x seq`` tokens (median of 3 after a warm-up), the weight sync into the
embedded rollout engine (bf16), sampling ``new`` tokens for each of ``prompts`` prompts (no stop token),
the sync back, and peak device memory per phase. MFU = model FLOPs (see megarl.bench.report.step_flops:
2N + 2 L d s/2 per token forward, 3x that forward+backward) / time / peak, against the datasheet peak and
the measured matmul rate. Writes gpu-<date>.md and .json to ``--out`` (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                  num_kv_heads=2, tied=True, max_positions=32768)
ITERS = 3


def matmul_tflops(n: int = 8192, iters: int = 10) -> float:
    a, b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, n, device="cuda",
                                                                               dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (start.elapsed_time(end) / 1e3) / 1e12


def timed(fn, *args):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn(*args)
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


def train_batch(b: int, s: int, vocab: int):
    from megarl.data.batch import Batch

    g = torch.Generator().manual_seed(0)
    resp = torch.zeros(b, s)
    resp[:, s // 2:] = 1
    return Batch.from_dict({"input_ids": torch.randint(5, vocab, (b, s), generator=g),
                            "attention_mask": torch.ones(b, s), "response_mask": resp,
                            "old_log_probs": -5.0 + 0.1 * torch.randn(b, s, generator=g) * resp,
                            "advantages": torch.randn(b, s, generator=g) * resp})


def profile(role, batch) -> dict:
    """One log-prob and one update pass under torch.profiler: GPU-busy share of the wall time (kernel time
    summed, so overlap would count twice) and the top ops by self CUDA and self CPU time."""
    from torch.profiler import ProfilerActivity

    out = {}
    for name, fn in (("log-prob", role.compute_log_probs), ("update", role.update)):
        with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall, _ = timed(fn, batch)
        ev = prof.key_averages()
        cuda_total = sum(e.self_device_time_total for e in ev) / 1e6
        out[name] = {"wall_s": wall, "kernel_s": cuda_total, "top_cuda": _top(ev, "self_device_time_total"),
                     "top_cpu": _top(ev, "self_cpu_time_total")}
    return out


def _top(events, key: str, n: int = 15) -> list:
    return [(e.key[:70], e.count, round(getattr(e, key) / 1e6, 4))
            for e in sorted(events, key=lambda e: -getattr(e, key))[:n]]


def run(args) -> dict:
    from megarl.algos.config import AlgorithmConfig
    from megarl.checkpoint.convert import convert_hf_to_megatron
    from megarl.controller.role import WorkerContext
    from megarl.data.batch import Batch
    from megarl.engine.config import EngineConfig, MicroBatchConfig, OptimConfig, Precision
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.policy import PolicyRole
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.config import RolloutConfig
    from megarl.rollout.mismatch import logprob_abs_diff
    from megarl.testing.tiny import write_random_model

    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda}
    res["matmul_bf16_tflops"] = matmul_tflops()
    res["shape"] = dict(QWEN25_05B)
    tmp = Path(tempfile.mkdtemp())
    t = time.perf_counter()
    n_params, _ = write_random_model(tmp / "hf", "qwen2", dtype=torch.bfloat16, **QWEN25_05B)
    convert_hf_to_megatron(tmp / "hf", tmp / "mc", dtype="bfloat16")
    res["prepare_s"], res["parameters"] = time.perf_counter() - t, n_params

    layout = ParallelLayout()
    init_distributed(layout)
    ctx = WorkerContext(0, 1, layout, layout.coords(0), "127.0.0.1", "local", 0, "cuda:0")
    engine = EngineConfig(optim=OptimConfig(lr=1e-6), precision=Precision.BF16,
                          micro_batch=MicroBatchConfig(max_tokens=args.max_tokens, max_size=64))
    # the update's PPO ratio takes the batch's old_log_probs (as a PPO run with several mini-batches does)
    role = PolicyRole(ctx, checkpoint_dir=str(tmp / "mc"), engine=engine,
                      algorithm=AlgorithmConfig(recompute_old_log_probs=True), temperature=1.0,
                      rollout=RolloutConfig(dtype=Precision.BF16))
    spec = role.spec
    batch = train_batch(args.batch, args.seq, spec.vocab_size)
    times: dict[str, list[float]] = {"log-prob": [], "update": []}
    mem: dict[str, float] = {}
    for i in range(ITERS + 1):
        for name, fn in (("log-prob", role.compute_log_probs), ("update", role.update)):
            torch.cuda.reset_peak_memory_stats()
            dt, out = timed(fn, batch)
            mem[name] = torch.cuda.max_memory_allocated() / 2**30
            if i:
                times[name].append(dt)
            if name == "update":
                res["update_metrics"] = out.metrics("")
    tokens = args.batch * args.seq
    n_flop = n_params  # tied: the embedding matrix is also the LM head, so every parameter does matmul work
    per_token = 2 * n_flop + 2 * spec.num_layers * spec.num_attention_heads * spec.head_dim * args.seq / 2
    peak = 989.0
    for name, mult in (("log-prob", 1), ("update", 3)):
        med = statistics.median(times[name])
        flops = mult * per_token * tokens
        res[name] = {"median_s": med, "all_s": times[name], "tokens_per_s": tokens / med,
                     "model_tflops": flops / med / 1e12, "mfu_datasheet": flops / med / 1e12 / peak,
                     "mfu_measured_matmul": flops / med / 1e12 / res["matmul_bf16_tflops"],
                     "peak_mem_gib": mem[name]}

    res["profile"] = profile(role, batch)
    res["args"] = vars(args)
    if args.no_rollout:
        return res

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, spec.vocab_size, (args.prompts, args.prompt_len), generator=g)
    prompts = Batch.from_dict({"prompt_ids": ids, "prompt_lengths": torch.full((args.prompts,), args.prompt_len)})
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new, seed=0)
    runs = []
    for _ in range(2):  # the first builds caches and the pinned host buffers
        torch.cuda.reset_peak_memory_stats()
        # one rollout phase (weight sync, sampling, back to training), then the old log-probs' forward and the
        # rollout-vs-training check
        start = time.perf_counter()
        _, sync = timed(role.sync_weights)
        _, rows = timed(role.generate, prompts, params)
        _, to_train_s = timed(role.to_train)
        old_s, lp = timed(role.compute_log_probs, rows.select("input_ids", "attention_mask"))
        dt = time.perf_counter() - start
        m = rows.meta["metrics"]
        runs.append({"total_s": dt, "to_rollout_s": sync.seconds, "generate_s": m["timing/generate_s"],
                     "to_train_s": to_train_s, "old_log_probs_s": old_s, "new_tokens": m["rollout/num_tokens"],
                     "logprob_abs_diff": logprob_abs_diff(lp["log_probs"], rows["rollout_log_probs"],
                                                          rows["response_mask"]),
                     "reshard_gb": (sync.transfer.bytes_kept + sync.transfer.bytes_received) / 1e9,
                     "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30})
    res["rollout"] = runs
    res["rollout"][-1]["decode_tokens_per_s"] = runs[-1]["new_tokens"] / runs[-1]["generate_s"]
    return res


def render(r: dict, date: str, commit: str) -> str:
    a = r["args"]
    out = [f"# GPU benchmark, {date}", "",
           f"- megarl commit {commit}; {r['device']}; torch {r['torch']} (CUDA {r['cuda']}); NCCL world of one",
           f"- bf16 matmul 8192^3: {r['matmul_bf16_tflops']:.0f} TFLOP/s measured (datasheet dense bf16 989)",
           f"- model: random Qwen2.5-0.5B shape {r['shape']}, {r['parameters'] / 1e6:.1f} M parameters; bf16 "
           "weights, fp32 master weights + Adam (megatron-core distributed optimizer); HF write + conversion "
           f"{r['prepare_s']:.0f} s",
           f"- training batch {a['batch']} x {a['seq']} tokens (response = last half), micro-batches <= "
           f"{a['max_tokens']} tokens; median of {ITERS} after 1 warm-up", "",
           "| pass | median s | tokens/s | model TFLOP/s | MFU (989) | MFU (measured matmul) | peak GiB |",
           "|---|---|---|---|---|---|---|"]
    for name in ("log-prob", "update"):
        p = r[name]
        out.append(f"| {name} | {p['median_s']:.3f} | {p['tokens_per_s']:.0f} | {p['model_tflops']:.0f} | "
                   f"{p['mfu_datasheet']:.1%} | {p['mfu_measured_matmul']:.1%} | {p['peak_mem_gib']:.1f} |")
    out += ["", f"Rollout: {a['prompts']} prompts x {a['prompt_len']} tokens, {a['new']} new tokens each (no stop), "
            "embedded engine (transformers, bf16), one replica:", "",
            "| run | to_rollout s | generate s | to_train s | old log-probs s | new tokens | decode tokens/s | "
            "reshard GB | rollout-vs-train mean abs log-prob diff | peak GiB |", "|---" * 10 + "|"]
    for i, x in enumerate(r.get("rollout", [])):
        out.append(f"| {i} | {x['to_rollout_s']:.3f} | {x['generate_s']:.2f} | {x['to_train_s']:.3f} | "
                   f"{x['old_log_probs_s'] or 0:.3f} | {x['new_tokens']:.0f} | "
                   f"{x['new_tokens'] / x['generate_s']:.0f} | {x['reshard_gb']:.2f} | {x['logprob_abs_diff']:.4f} | "
                   f"{x['peak_mem_gib']:.1f} |")
    for name, p in r.get("profile", {}).items():
        out += ["", f"Profile of one {name} pass: wall {p['wall_s']:.3f} s, GPU kernels {p['kernel_s']:.3f} s "
                f"({p['kernel_s'] / p['wall_s']:.0%} busy)", "", "| top self-CUDA op | calls | s | | top self-CPU op "
                "| calls | s |", "|---|---|---|---|---|---|---|"]
        for (a, an, at), (b, bn, bt) in zip(p["top_cuda"], p["top_cpu"], strict=False):
            out.append(f"| {a} | {an} | {at} | | {b} | {bn} | {bt} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--no-rollout", action="store_true", help="time the training passes only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA device")
    date = datetime.date.today().isoformat()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpu-{date}.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    text = render(res, date, commit or "unknown")
    (out / f"gpu-{date}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
