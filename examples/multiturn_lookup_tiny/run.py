"""Build the hidden-digit task offline, then train it with multi-turn GRPO on CPU.

    .venv/bin/python examples/multiturn_lookup_tiny/run.py [key.path=value ...]

Run from the repository root (the config names env.py by its path from there). Writes
outputs/multiturn_lookup_tiny/{task,run}; running it again resumes from the latest checkpoint.
"""

from __future__ import annotations

import sys
from pathlib import Path

from megarl.cli.common import run_cli

HERE = Path(__file__).parent


def main() -> int:
    from megarl.config.train import load_config
    from megarl.testing.lookup import make_task
    from megarl.trainer.trainer import run

    make_task("outputs/multiturn_lookup_tiny/task")
    history = run(load_config(HERE / "config.yaml", sys.argv[1:]))
    print("mean reward per step:", " ".join(f"{m['reward/mean']:.2f}" for m in history))
    return 0


if __name__ == "__main__":
    run_cli(main)
