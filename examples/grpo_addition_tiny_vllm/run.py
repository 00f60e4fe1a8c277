"""The CPU demo's GRPO run with vLLM as the rollout engine (vLLM's CPU build, which `make install` brings).

    .venv/bin/python examples/grpo_addition_tiny_vllm/run.py [key.path=value ...]

The task is the demo's with a 128-wide model (head_dim 32: vLLM's CPU attention has no kernel for the
demo model's 16). Writes outputs/grpo_addition_tiny_vllm/{task,run}; re-running resumes.
"""

from __future__ import annotations

import sys
from pathlib import Path

from megarl.cli.common import run_cli

HERE = Path(__file__).parent


def main() -> int:
    from megarl.testing.addition import run_example

    return run_example(HERE / "config.yaml", "outputs/grpo_addition_tiny_vllm/task", sys.argv[1:], hidden_size=128)


if __name__ == "__main__":
    run_cli(main)
