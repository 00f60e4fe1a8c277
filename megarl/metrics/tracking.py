"""Where a run's metrics go: a console progress bar, ``metrics.jsonl``, TensorBoard, Weights & Biases.

:class:`Tracker` takes one flat ``{name: float}`` dict per step. The JSONL file is the record of the
run (one object per step, appended and flushed, so a crashed run keeps every finished step);
incidents (faults the run recovered from) go to ``incidents.jsonl``; TensorBoard gets every scalar;
W&B only when a project is configured and ``wandb`` is installed
(asking for it without the package is an error, not a silent skip). Pure: no Ray, no torch.distributed.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from megarl.errors import MissingDependencyError

logger = logging.getLogger(__name__)

# what the progress bar shows (label: metric), in order, when present
CONSOLE_KEYS = {"reward": "reward/mean", "val_reward": "val/reward/mean", "kl": "actor/kl", "entropy": "actor/entropy",
                "clip": "actor/clip_frac", "resp_len": "response/length_mean", "s/step": "timing/step_s"}


class Tracker:
    def __init__(self, output_dir: str | Path, *, total_steps: int, start_step: int = 0, tensorboard: bool = True,
                 wandb_project: str | None = None, run_config: dict[str, Any] | None = None,
                 progress: bool = True) -> None:
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (self.dir / "metrics.jsonl").open("a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tensorboard"))
        self._wandb = None
        if wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise MissingDependencyError(
                    f"trainer.wandb_project={wandb_project!r} needs the `wandb` package; `pip install wandb` or "
                    "unset trainer.wandb_project."
                ) from e
            self._wandb = wandb.init(project=wandb_project, config=run_config, dir=str(self.dir), resume="allow")
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def rewind(self, step: int) -> None:
        """The run went back to ``step`` (resumed from a checkpoint after a fault): the progress bar follows."""
        if self._bar is not None:
            self._bar.n = step
            self._bar.refresh()

    def incident(self, record: dict[str, Any]) -> None:
        """A fault the run recovered from (a lost worker): one line of ``incidents.jsonl`` (never truncated on
        resume, unlike ``metrics.jsonl``), a warning, and a TensorBoard text entry."""
        record = {"time": time.time(), **record}
        with (self.dir / "incidents.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        logger.warning("incident: %s", record)
        if self._tb is not None:
            self._tb.add_text("incidents", json.dumps(record), global_step=int(record.get("failed_step", 0)))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **{k: _finite_or_none(v) for k, v in sorted(metrics.items())}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        shown = {label: f"{metrics[k]:.4g}" for label, k in CONSOLE_KEYS.items() if k in metrics}
        if self._bar is not None:
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(1)
        logger.info("step %d: %s", step, " ".join(f"{k}={v}" for k, v in shown.items()))

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _finite_or_none(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def read_metrics(output_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` (for tests, plots and resume checks)."""
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
