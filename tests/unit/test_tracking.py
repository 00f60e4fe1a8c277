"""The console of a run (megarl/metrics/tracking.py): one step line per progress update, a live bar on a terminal
that log lines, worker output and prints never glue onto, no bar and no carriage return anywhere else.

A terminal is emulated: each ``\\n``-separated line shows what its carriage-return overwrites leave (the way
tqdm redraws); a negative control draws the bar the way the tracker used to and finds a log record glued to it.
"""

from __future__ import annotations

import io
import logging
import re
import sys

import pytest

from megarl.metrics.tracking import ConsoleProgress, Tracker, progress_line, read_metrics


class _Terminal(io.StringIO):
    """stdout and stderr of a terminal (one screen)."""

    def isatty(self) -> bool:
        return True


def _screen(raw: str) -> list[str]:
    """What a terminal shows for ``raw``: each line as its last carriage-return overwrite leaves it."""
    lines = []
    for line in raw.split("\n"):
        shown = ""
        for piece in line.split("\r"):
            shown = piece + shown[len(piece):]
        lines.append(shown.rstrip())
    return lines


@pytest.fixture
def console(monkeypatch):
    """A console handler as ``logging.basicConfig`` makes one, on a stream that stands for stdout and stderr."""
    def make(stream):
        monkeypatch.setattr(sys, "stdout", stream)
        monkeypatch.setattr(sys, "stderr", stream)
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        for name in ("megarl", "elsewhere"):
            log = logging.getLogger(name)
            monkeypatch.setattr(log, "level", logging.INFO)
            monkeypatch.setattr(log, "handlers", [handler])
            monkeypatch.setattr(log, "propagate", False)
        return handler
    return make


def test_progress_line_by_hand():
    # 3 of 100 steps in 12 s: 4 s/step, 97 left -> 388 s = 06:28
    assert progress_line(3, 100, 12.0, 0, {"reward": "0.5", "kl": "0.01"}) == \
        "step 3/100 [00:12<06:28, 4.00s/step] reward=0.5 kl=0.01"
    # resumed at 50: 3 steps in 10 s, 47 left -> 156.7 s = 02:36
    assert progress_line(53, 100, 10.0, 50, {}) == "step 53/100 [00:10<02:36, 3.33s/step]"
    # faster than a step a second: steps per second
    assert progress_line(10, 10, 2.0, 0, {"reward": "1"}) == "step 10/10 [00:02<00:00, 5.00step/s] reward=1"
    assert progress_line(50, 100, 0.0, 50, {}) == "step 50/100 [00:00<?, ?]"  # no step done yet


def test_not_a_terminal_one_plain_line_per_step(tmp_path, console):
    out = io.StringIO()  # CI, a file, `| tee`
    console(out)
    with Tracker(tmp_path, total_steps=3, tensorboard=False) as tracker:
        assert sys.stdout is out and sys.stderr is out  # nothing wrapped
        for step in (1, 2, 3):
            tracker.log(step, {"reward/mean": 0.25 * step, "timing/step_s": 1.0, "other": 7.0})
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 3
    for step, line in zip((1, 2, 3), lines, strict=True):
        assert re.fullmatch(rf"INFO megarl\.metrics\.tracking: step {step}/3 \[\S+<\S+, \S+\] "
                            rf"reward={0.25 * step:.4g} s/step=1", line), line
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


def test_terminal_bar_stays_below_every_line(tmp_path, console):
    term = _Terminal()
    handler = console(term)
    with Tracker(tmp_path, total_steps=3, tensorboard=False) as tracker:
        assert sys.stdout is not term and sys.stdout.isatty()  # lines written meanwhile go above the bar
        tracker.log(1, {"reward/mean": 0.5})
        print("(PolicyRole pid=1) a worker's line forwarded by Ray")
        print("a line in", end=" ")
        print("two writes")
        logging.getLogger("elsewhere").warning("a warning mid-run")
        tracker.log(2, {"reward/mean": 0.625})
        tracker.log(3, {"reward/mean": 0.75})
    assert sys.stdout is term and sys.stderr is term and handler.stream is term  # put back
    screen = _screen(term.getvalue())
    expected = [r"INFO megarl\.metrics\.tracking: step 1/3 \[.*\] reward=0\.5",
                r"\(PolicyRole pid=1\) a worker's line forwarded by Ray",
                r"a line in two writes",
                r"WARNING elsewhere: a warning mid-run",
                r"INFO megarl\.metrics\.tracking: step 2/3 \[.*\] reward=0\.625",
                r"INFO megarl\.metrics\.tracking: step 3/3 \[.*\] reward=0\.75",
                r"train: 100%\|#+\| 3/3 \[.*, reward=0\.75\]",
                ""]
    assert len(screen) == len(expected), screen
    for pattern, line in zip(expected, screen, strict=True):
        assert re.fullmatch(pattern, line), (pattern, line)
    # after close the wrappers pass straight through: no bar left to clear
    print("after the run")
    assert term.getvalue().endswith("\nafter the run\n")


def test_negative_control_the_old_bar_glues_log_lines(console):
    """The bar as the tracker drew it before (tqdm, then a log record on the same stream): the screen shows the
    record glued to the bar, which the emulation above would catch."""
    from tqdm import tqdm

    term = _Terminal()
    console(term)
    bar = tqdm(total=3, desc="train", unit="step", file=term)
    bar.update(1)
    logging.getLogger("megarl").info("step 1: reward=0.5")
    bar.close()
    assert any("%|" in line and "INFO megarl: step 1" in line for line in _screen(term.getvalue()))


def test_rewind_moves_the_bar_and_restarts_the_rate(console):
    term = _Terminal()
    console(term)
    progress = ConsoleProgress(10, 0, live=True)
    progress.update(4, {})
    progress.rewind(2)
    assert progress.start == 2 and progress._bar.n == 2
    progress.close()
    assert _screen(term.getvalue())[-2].startswith("train:  20%")
