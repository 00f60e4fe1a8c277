"""The GPU recipes rehearsed on this machine at their true widths, layers cut (issue #47; docs/rehearsal.md).

    .venv/bin/python benchmarks/rehearsal.py [--cases qwen7b,qwen30b,llama70b,qwen05b] [--workdir DIR] [--results FILE]
    python benchmarks/rehearsal.py --device cuda --world 1 --cases llama70b   # a GPU machine: the 70B's sync too

Each case is ``megarl rehearse`` on an example recipe (``megarl.bench.rehearse.run``): random HF weights of the
published config with its layers cut, transformers' float32 reference in a process of its own, the round trip
HF -> Megatron -> HF, and a world of 2 gloo ranks at the recipe's layout within 2 ranks (log-probs, resharding into
the embedded engine, greedy generation), each phase's peak resident memory beside the planner's terms. The cases
run one after the other (each needs most of a 24 GB machine). Writes benchmarks/results/rehearsal-<date>.md.

On a GPU (``--device cuda``, a world of ``--world`` GPUs) the cases run where the 70B's sync and generation fit: its
float32 training copy and the whole rollout replica are 11.8 GB each, twice this machine's memory together
(docs/rehearsal.md §5).
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
# case: (recipe, preset, layers, tp): the three true-width recipes of the issue, then the whole 0.5B at TP2
CASES = {
    "qwen7b": ("grpo_gsm8k_qwen2.5_7b", "qwen2.5-7b", 1, None),
    "qwen30b": ("grpo_gsm8k_qwen3_30b_a3b", "qwen3-30b-a3b", 1, None),
    "llama70b": ("ppo_llama3_70b", "llama3-70b", 1, None),
    "qwen05b": ("ppo_gsm8k_qwen2.5_0.5b", "qwen2.5-0.5b", 24, 2),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--device", default="cpu", help="cpu (gloo ranks) or cuda (NCCL ranks, a GPU each)")
    parser.add_argument("--world", type=int, default=2, help="ranks of each case's world (default 2)")
    parser.add_argument("--workdir", help="model files go here (default: a temporary directory, removed)")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results" /
                                                 f"rehearsal-{datetime.date.today()}.md"))
    args = parser.parse_args()
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) / 2**20
    lines = [f"# Rehearsals at true widths, {datetime.date.today()}", "",
             f"`python benchmarks/rehearsal.py --cases {args.cases} --device {args.device} --world {args.world}` on "
             f"{platform.processor() or platform.machine()}, {total:.1f} GiB of memory; each case a world of "
             f"{args.world} {args.device} ranks (docs/rehearsal.md).", ""]
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for case in args.cases.split(","):
            recipe, preset, layers, tp = CASES[case]
            start = time.perf_counter()
            report = rehearse.run(ROOT / "examples" / recipe / "config.yaml", Path(tmp) / case, layers=layers,
                                  preset=preset, tp=tp if tp is None else min(tp, args.world), world=args.world,
                                  device=args.device)
            lines += [rehearse.markdown(report).rstrip(), "",
                      f"Wall time {time.perf_counter() - start:.0f} s; "
                      + ("every check held." if not report["failures"] else "FAILED: " + "; ".join(report["failures"])),
                      ""]
            print("\n".join(lines[-4:]), flush=True)
    Path(args.results).write_text("\n".join(lines))
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
