"""Online DPO on the tiny addition task: builds the task under outputs/online_dpo_addition_tiny/task, then trains
with config.yaml (and ``key.path=value`` overrides from the command line)."""

import logging
import sys
from pathlib import Path

from megarl.testing.addition import run_example

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    here = Path(__file__).parent
    sys.exit(run_example(here / "config.yaml", "outputs/online_dpo_addition_tiny/task", sys.argv[1:]))
