"""Build the tiny addition task offline, then train it with DAPO on CPU (dynamic sampling, clip-higher).

    .venv/bin/python examples/dapo_addition_tiny/run.py [key.path=value ...]

Writes outputs/dapo_addition_tiny/{task,run}; running it again resumes from the latest checkpoint.
"""

from __future__ import annotations

import sys
from pathlib import Path

from megarl.cli.common import run_cli

HERE = Path(__file__).parent


def main() -> int:
    from megarl.testing.addition import run_example

    return run_example(HERE / "config.yaml", "outputs/dapo_addition_tiny/task", sys.argv[1:])


if __name__ == "__main__":
    run_cli(main)
