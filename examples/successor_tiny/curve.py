"""Read a run's metrics.jsonl the way docs/tasks.md §1.6 does: is the reward rising?

    .venv/bin/python examples/successor_tiny/curve.py outputs/successor_tiny/run/metrics.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def curve(path: str) -> dict[str, float]:
    steps = [json.loads(line) for line in Path(path).read_text().splitlines()]
    reward = [m["reward/mean"] for m in steps]
    val = [m["val/reward/mean"] for m in steps if "val/reward/mean" in m]
    return {"steps": len(steps), "first_10": statistics.mean(reward[:10]), "last_20": statistics.mean(reward[-20:]),
            "val_first": val[0] if val else float("nan"), "val_last": val[-1] if val else float("nan")}


if __name__ == "__main__":
    print(" ".join(f"{k}={v:.3g}" for k, v in curve(sys.argv[1]).items()))
