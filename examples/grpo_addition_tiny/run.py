"""Build the tiny addition task offline, then train it with GRPO on CPU (what `make demo` runs).

    .venv/bin/python examples/grpo_addition_tiny/run.py [key.path=value ...]

Writes outputs/grpo_addition_tiny/{task,run}; run/metrics.jsonl holds every step, run/tensorboard
the curves. Running it again resumes from the latest checkpoint (delete run/ to start over).
"""

from __future__ import annotations

import sys
from pathlib import Path

from megarl.cli.common import run_cli

HERE = Path(__file__).parent


def main() -> int:
    from megarl.testing.addition import run_example

    return run_example(HERE / "config.yaml", "outputs/grpo_addition_tiny/task", sys.argv[1:])


if __name__ == "__main__":
    run_cli(main)
