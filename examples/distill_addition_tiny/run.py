"""On-policy distillation on CPU: the policy `make demo` trained teaches the demo's fresh model.

    make demo                                          # trains the teacher (outputs/grpo_addition_tiny/run)
    .venv/bin/python examples/distill_addition_tiny/run.py [key.path=value ...]

Writes outputs/distill_addition_tiny/run; `reward/function_mean` is the student's accuracy on the task (not
trained on), `distill/reverse_kl` its per-token KL to the teacher.
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
