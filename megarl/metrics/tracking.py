"""Where a run's metrics go: the console, ``metrics.jsonl``, TensorBoard, Weights & Biases.

:class:`Tracker` takes one flat ``{name: float}`` dict per step. The JSONL file is the record of the
run (one object per step, appended and flushed, so a crashed run keeps every finished step);
incidents (faults the run recovered from) go to ``incidents.jsonl``; TensorBoard gets every scalar;
W&B only when a project is configured and ``wandb`` is installed
(asking for it without the package is an error, not a silent skip). Pure: no Ray, no torch.distributed.

The console (:class:`ConsoleProgress`): each step is one log line, :func:`progress_line`. On a terminal a tqdm
bar stays below the lines; while it is live every line written to stdout or stderr (log records, Ray's
forwarded worker output, warnings, prints) is written above it, never onto it. Elsewhere (CI, a file,
``| tee``) there is no bar and no ``\\r``: the step lines are the progress.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from megarl.errors import MissingDependencyError

logger = logging.getLogger(__name__)

# what each step's console line shows (label: metric), in order, when present
CONSOLE_KEYS = {"reward": "reward/mean", "val_reward": "val/reward/mean", "kl": "actor/kl", "entropy": "actor/entropy",
                "clip": "actor/clip_frac", "resp_len": "response/length_mean", "s/step": "timing/step_s"}
BAR_KEYS = ("reward",)  # beside the live bar's count: the rest is in the step lines above it


class Tracker:
    def __init__(self, output_dir: str | Path, *, total_steps: int, start_step: int = 0, tensorboard: bool = True,
                 wandb_project: str | None = None, run_config: dict[str, Any] | None = None,
                 progress: bool = True) -> None:
        """``progress``: a live bar on a terminal (:func:`is_terminal`); the step lines are logged either way."""
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
        self._console = ConsoleProgress(total_steps, start_step, live=None if progress else False)

    def rewind(self, step: int) -> None:
        """The run went back to ``step`` (resumed from a checkpoint after a fault): the progress follows."""
        self._console.rewind(step)

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
        self._console.update(step, {label: f"{metrics[k]:.4g}" for label, k in CONSOLE_KEYS.items() if k in metrics})

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._console.close()

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


# ------------------------------------------------------------------------------------------ console


def is_terminal() -> bool:
    """Whether a live bar can be drawn: stdout and stderr are both terminals (not CI, a file or ``| tee``)."""
    return all(s is not None and s.isatty() for s in (sys.stdout, sys.stderr))


def progress_line(step: int, total: int, elapsed_s: float, start_step: int, shown: dict[str, str]) -> str:
    """One step's console line, ``step 3/100 [00:12<06:28, 4.00s/step] reward=0.5``: the rate and the time left
    count the ``step - start_step`` steps done in ``elapsed_s`` (tqdm's notation)."""
    from tqdm import tqdm

    rate = (step - start_step) / elapsed_s if step > start_step and elapsed_s > 0 else None
    left = "?" if rate is None else tqdm.format_interval((total - step) / rate)
    speed = "?" if rate is None else f"{1 / rate:.2f}s/step" if rate < 1 else f"{rate:.2f}step/s"
    meter = f"step {step}/{total} [{tqdm.format_interval(elapsed_s)}<{left}, {speed}]"
    return " ".join([meter, *(f"{k}={v}" for k, v in shown.items())])


class ConsoleProgress:
    """The steps of a run on the console: each step's :func:`progress_line` is logged (INFO); on a terminal
    (``live``, default :func:`is_terminal`) a tqdm bar stays below, and ``sys.stdout``/``sys.stderr`` and the
    logging handlers that write to them go through :class:`_AboveBar` until :meth:`close`."""

    def __init__(self, total: int, start: int, *, live: bool | None = None) -> None:
        self.total, self.start, self._t0 = total, start, time.monotonic()
        self._bar = None
        self._undo: list[Any] = []  # what close() puts back: (owner, attribute, our stream, theirs)
        if is_terminal() if live is None else live:
            self._open_bar()

    def _open_bar(self) -> None:
        from tqdm import tqdm

        out, err = sys.stdout, sys.stderr
        self._bar = tqdm(total=self.total, initial=self.start, desc="train", unit="step", dynamic_ncols=True,
                         file=err)
        above = {id(out): _AboveBar(self, out), id(err): _AboveBar(self, err)}
        for handler in _stream_handlers():
            if id(handler.stream) in above:  # e.g. logging.basicConfig's, Ray's: they hold the stream they started with
                self._undo.append((handler, "stream", above[id(handler.stream)], handler.stream))
                handler.setStream(above[id(handler.stream)])
        self._undo += [(sys, "stdout", above[id(out)], out), (sys, "stderr", above[id(err)], err)]
        sys.stdout, sys.stderr = above[id(out)], above[id(err)]

    def update(self, step: int, shown: dict[str, str]) -> None:
        if self._bar is not None:  # first: the line's redraw of the bar shows this step
            self._bar.set_postfix({k: shown[k] for k in BAR_KEYS if k in shown}, refresh=False)
            self._bar.update(step - self._bar.n)
        logger.info("%s", progress_line(step, self.total, time.monotonic() - self._t0, self.start, shown))

    def rewind(self, step: int) -> None:
        """Back to ``step``: the rate counts from here on."""
        self.start, self._t0 = step, time.monotonic()
        if self._bar is not None:
            self._bar.n = step
            self._bar.refresh()

    def close(self) -> None:
        """Close the bar (it stays on screen at its last state) and put the streams back (those nobody replaced
        since); a wrapper still held somewhere writes straight through from now on."""
        if self._bar is None:
            return
        self._bar.close()
        self._bar = None
        for owner, attr, ours, theirs in reversed(self._undo):
            ours.write_rest()
            if getattr(owner, attr) is not ours:
                continue
            if isinstance(owner, logging.StreamHandler):
                owner.setStream(theirs)
            else:
                setattr(owner, attr, theirs)
        self._undo = []


class _AboveBar:
    """A console stream while the bar is live: whole lines go out above the bar (cleared, written, redrawn under
    the lock tqdm's bars draw under: Ray prints worker output from its own thread); a partial line waits for its
    end, so nothing is glued to the bar. Everything else is the wrapped stream's (``isatty``, ``fileno``, ...)."""

    def __init__(self, console: ConsoleProgress, stream: TextIO) -> None:
        self._console, self._stream, self._buf = console, stream, ""

    def write(self, text: str) -> int:
        from tqdm import tqdm

        with tqdm.get_lock():
            bar = self._console._bar
            if bar is None:
                self._stream.write(text)
                return len(text)
            self._buf += text
            lines, newline, self._buf = self._buf.rpartition("\n")
            if newline:
                bar.clear(nolock=True)
                self._stream.write(lines + newline)
                self._stream.flush()
                bar.refresh(nolock=True)
        return len(text)

    def writelines(self, lines: list[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._stream.flush()

    def write_rest(self) -> None:
        """The bar has closed: a partial line still waiting goes out."""
        if self._buf:
            self._stream.write(self._buf)
            self._buf = ""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _stream_handlers() -> list[logging.StreamHandler]:
    """Every stream handler of the root logger and the named loggers that holds its stream (not files, not those
    that look ``sys.stderr`` up as they write, as ``logging.lastResort`` does)."""
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    return [h for lg in loggers for h in lg.handlers if isinstance(h, logging.StreamHandler)
            and not isinstance(h, logging.FileHandler) and not isinstance(getattr(type(h), "stream", None), property)]
