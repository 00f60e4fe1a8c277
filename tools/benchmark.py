#!/usr/bin/env python
"""Benchmark a training config: N measured PPO/GRPO iterations after warm-up, the step time split by
stage (generation, weight sync, log-probs, reference, values, reward, training), tokens/s per
device, peak memory per device, bytes each rank moves per weight sync, MFU.

    python tools/benchmark.py CONFIG [key.path=value ...] [--warmup 2] [--iters 5] [--out DIR]
                              [--workload hybridflow] [--trace trace.json] [--peak-tflops T]

Writes DIR/benchmark.json and DIR/benchmark.md (default DIR: outputs/benchmark/<config name>) and
prints the table. The tiny CPU example (its task is built by `examples/grpo_addition_tiny/run.py`
or `--prepare-addition-task`):

    python tools/benchmark.py examples/grpo_addition_tiny/config.yaml --prepare-addition-task --trace t.json

Open the trace in https://ui.perfetto.dev or chrome://tracing: one track for the driver, one per
worker process; spans per stage, per worker call, per weight-sync bucket. Exit status 2 on bad input.
"""

import argparse
from pathlib import Path

from megarl.cli.common import run_cli


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="a training config (YAML), as for `megarl train`")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides")
    p.add_argument("--warmup", type=int, default=2, help="iterations run before measuring")
    p.add_argument("--iters", type=int, default=5, help="measured iterations")
    p.add_argument("--out", help="output directory (default outputs/benchmark/<config name>)")
    p.add_argument("--workload", help="a workload preset: hybridflow (1024 prompts x 1024 + 1024 tokens)")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace of the measured iterations here")
    p.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per device for the MFU (default: known GPUs' "
                   "datasheet bf16 value; on CPU one core's measured fp32 matmul rate)")
    p.add_argument("--prepare-addition-task", action="store_true",
                   help="first build the tiny addition task under outputs/grpo_addition_tiny/task")
    args = p.parse_intermixed_args()  # overrides may come after the flags (the launch scripts pass them so)

    from megarl.bench.report import markdown
    from megarl.bench.runner import BenchmarkOptions, run_benchmark

    if args.prepare_addition_task:
        from megarl.testing.addition import make_task

        make_task("outputs/grpo_addition_tiny/task")
    out = args.out or f"outputs/benchmark/{Path(args.config).parent.name or Path(args.config).stem}"
    options = BenchmarkOptions(warmup=args.warmup, iterations=args.iters, workload=args.workload,
                               trace_file=args.trace, peak_tflops=args.peak_tflops)
    result = run_benchmark(args.config, args.overrides, out, options)
    print(markdown(result))
    print(f"wrote {out}/benchmark.json and {out}/benchmark.md" + (f" and {args.trace}" if args.trace else ""))
    return 0


if __name__ == "__main__":
    run_cli(main)
