"""Build the tiny addition task with a Qwen3-MoE-shaped model offline, then train it with GRPO at expert
parallelism 2 on CPU.

    .venv/bin/python examples/grpo_addition_moe/run.py [key.path=value ...]

Writes outputs/grpo_addition_moe/{task,run}; run/metrics.jsonl holds every step (with the router's
moe_load_max, moe_load_min and moe_load_balancing_loss), run/tensorboard the curves. Running it again
resumes from the latest checkpoint (delete run/ to start over).
"""

from __future__ import annotations

import sys
from pathlib import Path

from megarl.cli.common import run_cli

HERE = Path(__file__).parent
MODEL = dict(num_experts=4, top_k=2)  # 2 layers of 4 experts of width 64


def main() -> int:
    from megarl.testing.addition import run_example

    return run_example(HERE / "config.yaml", "outputs/grpo_addition_moe/task", sys.argv[1:], **MODEL)


if __name__ == "__main__":
    run_cli(main)
