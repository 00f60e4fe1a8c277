"""Build the tiny addition task offline (weights drawn at std 0.2), then train it with GRPO and rank-4 LoRA on CPU.

    .venv/bin/python examples/grpo_lora_addition_tiny/run.py [key.path=value ...]

Writes outputs/grpo_lora_addition_tiny/{task,run}; running it again resumes from the latest checkpoint (which
holds the adapters and their optimizer state only).
"""

from __future__ import annotations

import sys
from pathlib import Path

from megarl.cli.common import run_cli

HERE = Path(__file__).parent


def main() -> int:
    from megarl.testing.addition import run_example

    return run_example(HERE / "config.yaml", "outputs/grpo_lora_addition_tiny/task", sys.argv[1:], init_std=0.2)


if __name__ == "__main__":
    run_cli(main)
