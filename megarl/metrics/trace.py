"""Spans for a timeline trace: where a step's time goes across the driver and every worker.

Each process keeps its own recorder. While :func:`enable` is on, :func:`span` records one complete
event (name, category, wall-clock start and duration in microseconds, small ``args``); :func:`drain`
hands the events over and forgets them. Off, :func:`span` costs one attribute check. Timestamps are
``time.time_ns()`` so processes on one host share a clock (across hosts they are as close as NTP
keeps them). :func:`chrome_trace` lays the events out in the Chrome trace-event JSON format
(``chrome://tracing``, https://ui.perfetto.dev), one track per process. Pure: stdlib only.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
MAX_EVENTS = 200_000  # a recorder that is never drained stops growing here


class _Recorder:
    def __init__(self) -> None:
        self.enabled = False
        self.events: list[dict[str, Any]] = []


_recorder = _Recorder()


def enable(on: bool = True) -> None:
    _recorder.enabled = on
    if not on:
        _recorder.events.clear()


def enabled() -> bool:
    return _recorder.enabled


def record(name: str, start_ns: int, end_ns: int, cat: str = "", **args: Any) -> None:
    if _recorder.enabled and len(_recorder.events) < MAX_EVENTS:
        _recorder.events.append({"name": name, "cat": cat, "ts": start_ns / 1e3, "dur": (end_ns - start_ns) / 1e3,
                                 "args": args})


@contextlib.contextmanager
def span(name: str, cat: str = "", **args: Any) -> Iterator[None]:
    if not _recorder.enabled:
        yield
        return
    start = time.time_ns()
    try:
        yield
    finally:
        record(name, start, time.time_ns(), cat, **args)


def spanned(name: str, cat: str = "") -> Callable[[F], F]:
    """Decorator: every call of the function is a span."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with span(name, cat):
                return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap


def drain() -> list[dict[str, Any]]:
    events, _recorder.events = _recorder.events, []
    return events


def chrome_trace(tracks: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """``{track name: events}`` -> a trace-event document: each track is one process row (in the
    given order), each event a complete ("X") event on it."""
    out: list[dict[str, Any]] = []
    for pid, (track, events) in enumerate(tracks.items()):
        out.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": track}})
        out.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": pid}})
        out.extend({"ph": "X", "pid": pid, "tid": 0, **e} for e in events)
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | Path, tracks: Mapping[str, Sequence[Mapping[str, Any]]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(chrome_trace(tracks)))
    tmp.replace(path)
    return path
