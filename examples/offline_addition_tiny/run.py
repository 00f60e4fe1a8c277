"""The offline programs on single-digit addition: builds the task (model, sft.jsonl, pairs.jsonl) under
outputs/offline_addition_tiny/task, then trains with the config given (sft.yaml, dpo.yaml or reward_model.yaml):

    .venv/bin/python examples/offline_addition_tiny/run.py examples/offline_addition_tiny/dpo.yaml [key=value ...]
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from megarl.config.train import load_config
from megarl.testing.addition import make_model, make_offline_datasets
from megarl.trainer.trainer import run

TASK = Path("outputs/offline_addition_tiny/task")


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not (TASK / "model" / "config.json").is_file():
        make_model(TASK / "model")
    make_offline_datasets(TASK)
    history = run(load_config(argv[0], argv[1:]))
    logging.info("loss per step: %s", " ".join(f"{m['loss']:.3f}" for m in history))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
