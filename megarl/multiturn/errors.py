"""What went wrong in multi-turn rollouts, kept where a user finds it: every environment failure scored under
``on_env_error: score`` and every tool error, with its text, in the run directory (``env_errors.jsonl``), and the
first of each kind in the log.

A *kind* says what and where: ``KeyError in HiddenDigit.step``, ``timeout in HiddenDigit.step``, ``invalid result
from HiddenDigit.step``, ``ValueError in tool search``, ``unknown tool``, ``malformed tool call``. A failure that
recurs on every step is one kind: it is logged once per run (one warning per kind, not per step), and its texts
accumulate in the file, at most :attr:`EnvErrorLog.per_kind` lines of one kind per step (``kind_count`` says how
many there were).

Pure module: the standard library.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EnvError:
    """One thing that went wrong in an environment call or a tool call."""

    kind: str  # what and where (module docstring): the unit of "first of its kind"
    message: str
    traceback: str = ""  # the last frames, when something raised


_PLUMBING = (str(Path(__file__).parent) + "/", "/concurrent/futures/")  # frames of the loop and its thread pool


def traceback_tail(error: BaseException, frames: int = 4, max_chars: int = 2000) -> str:
    """The last ``frames`` frames of ``error``'s traceback outside megarl's loop and its thread pool (the user's
    environment or tool) and its message (chained causes included), at most ``max_chars`` characters (the end
    kept)."""
    summary = traceback.TracebackException.from_exception(error)
    own = [f for f in summary.stack if not any(part in f.filename for part in _PLUMBING)]
    summary.stack = traceback.StackSummary.from_list(own[-frames:])
    text = "".join(summary.format())
    return text if len(text) <= max_chars else "..." + text[-max_chars:]


class EnvErrorLog:
    """The run's record of environment and tool errors: each one a JSON line of ``path`` (``step``, ``phase``,
    ``conversation``, ``row``, ``turn``, ``kind``, ``ended``, ``message``, ``traceback``, ``kind_count``), and
    the first of each kind a warning. ``path`` None: logged only. The file is created by the first error."""

    per_kind = 16  # lines of one kind written per step; the rest only counted (a broken environment fails them all)

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.seen: set[str] = set()

    def record(self, step: int, errors: Sequence[dict[str, Any]], *, phase: str = "train") -> None:
        """Keep ``errors`` (:meth:`megarl.multiturn.rollout.MultiTurnResult.errors`) of ``step``."""
        counts = collections.Counter(e["kind"] for e in errors)
        written: collections.Counter[str] = collections.Counter()
        lines = []
        for e in errors:
            kind = e["kind"]
            if kind not in self.seen:
                self.seen.add(kind)
                self._warn(step, phase, e, counts[kind])
            if written[kind] < self.per_kind:
                written[kind] += 1
                lines.append(json.dumps({"step": step, "phase": phase, **e, "kind_count": counts[kind]}) + "\n")
        if lines and self.path is not None:
            with self.path.open("a") as f:
                f.writelines(lines)

    def _warn(self, step: int, phase: str, e: dict[str, Any], count: int) -> None:
        turn = "opening" if e["turn"] is None else f"turn {e['turn']}"
        what = "ended its conversation" if e["ended"] else "answered to the model"
        where = f"every one's text goes to {self.path}" if self.path is not None else "not kept (no run directory)"
        tail = f"\n{e['traceback'].rstrip()}" if e["traceback"] else ""
        logger.warning("multi-turn: first %s (%s step %d, conversation %d, row %d, %s; %d of this kind in the step, "
                       "%s; %s; not repeated for this kind): %s%s", e["kind"], phase, step, e["conversation"],
                       e["row"], turn, count, what, where, e["message"], tail)
