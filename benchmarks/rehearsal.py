"""The GPU recipes rehearsed on this machine at their true widths, layers cut (issue #47; docs/rehearsal.md).

    .venv/bin/python benchmarks/rehearsal.py [--cases qwen7b,qwen30b,llama70b,qwen05b] [--workdir DIR] [--results FILE]
    python benchmarks/rehearsal.py --device cuda --world 1 --cases llama70b   # a GPU: the 70B's sync in float32

Each case is ``megarl rehearse`` on an example recipe (``megarl.bench.rehearse.run``): random HF weights of the
published config with its layers cut, transformers' float32 reference in a process of its own, the round trip
HF -> Megatron -> HF, and a world of 2 gloo ranks at the recipe's layout within 2 ranks (log-probs, resharding into
the embedded engine, greedy generation), each phase's peak resident memory beside the planner's terms. The cases
run one after the other (each needs most of a 24 GB machine). Writes benchmarks/results/rehearsal-<date>.md.

The 70B's sync and generation run at a world of one with a bfloat16 training copy (``llama70b_sync``): in float32 its
training copy and the whole rollout replica are 11.8 GB each, more than this machine's memory together. On a GPU
(``--device cuda``, a world of ``--world`` GPUs) ``llama70b`` runs them in float32.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import tempfile
import time
from pathlib import Path

from megarl.bench import rehearse

ROOT = Path(__file__).resolve().parents[1]
# case: (recipe, preset, options of rehearse.run): the three true-width recipes of the issue at 2 ranks, the 70B's
# sync and generation at a world of one with a bfloat16 training copy (float32, the training copy and the replica are
# 23.7 GB together at any layout of 2 ranks), then the whole 0.5B at TP2
CASES = {
    "qwen7b": ("grpo_gsm8k_qwen2.5_7b", "qwen2.5-7b", {"layers": 1}),
    "qwen30b": ("grpo_gsm8k_qwen3_30b_a3b", "qwen3-30b-a3b", {"layers": 1}),
    "llama70b": ("ppo_llama3_70b", "llama3-70b", {"layers": 1}),
    "llama70b_sync": ("ppo_llama3_70b", "llama3-70b", {"layers": 1, "world": 1, "tp": 1, "train_dtype": "bfloat16"}),
    "qwen05b": ("ppo_gsm8k_qwen2.5_0.5b", "qwen2.5-0.5b", {"layers": 24, "tp": 2}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--device", default="cpu", help="cpu (gloo ranks) or cuda (NCCL ranks, a GPU each)")
    parser.add_argument("--world", type=int, help="ranks of every case's world (default: the case's, else 2)")
    parser.add_argument("--workdir", help="model files go here (default: a temporary directory, removed)")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results" /
                                                 f"rehearsal-{datetime.date.today()}.md"))
    args = parser.parse_args()
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) / 2**20
    lines = [f"# Rehearsals at true widths, {datetime.date.today()}", "",
             f"`python benchmarks/rehearsal.py --cases {args.cases} --device {args.device}"
             + (f" --world {args.world}" if args.world else "") + f"` on {platform.processor() or platform.machine()}, "
             f"{total:.1f} GiB of memory (docs/rehearsal.md).", ""]
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for case in args.cases.split(","):
            recipe, preset, options = CASES[case]
            if args.world:  # the case's TP within the world given
                options = options | {"world": args.world, "tp": min(options.get("tp", args.world), args.world)}
            start = time.perf_counter()
            report = rehearse.run(ROOT / "examples" / recipe / "config.yaml", Path(tmp) / case, preset=preset,
                                  device=args.device, **options)
            lines += [rehearse.markdown(report).rstrip(), "",
                      f"Wall time {time.perf_counter() - start:.0f} s; "
                      + ("every check held." if not report["failures"] else "FAILED: " + "; ".join(report["failures"])),
                      ""]
            print("\n".join(lines[-4:]), flush=True)
    Path(args.results).write_text("\n".join(lines))
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
