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
    from megarl.testing.addition import make_task
    from megarl.trainer.config import load_config
    from megarl.trainer.trainer import run

    make_task("outputs/grpo_addition_tiny/task")
    history = run(load_config(HERE / "config.yaml", sys.argv[1:]))
    curve = [f"{m['reward/mean']:.2f}" for m in history]
    print("mean reward per step:", " ".join(curve))
    return 0


if __name__ == "__main__":
    run_cli(main)
