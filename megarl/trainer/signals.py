"""Graceful stop on SIGTERM / SIGINT (what Slurm sends at the time limit or on preemption, and Ctrl-C).

The first signal asks the run to stop after the step in progress: the trainer finishes it, writes a
checkpoint (``trainer.save_on_signal``) and raises :class:`~megarl.errors.RunStopped` (exit status
75). A signal while the run starts (before the training loop: conversion, worker start-up), or a
second one, abandons what is in progress at once: :class:`Abandoned` is raised wherever the driver is
(usually waiting on workers), the workers are torn down and the previous checkpoint stays the latest.

Ray's driver installs its own SIGTERM handler when it starts a local cluster (it exits at once with
status 1), so :meth:`StopRequest.install` is called again once the cluster is up; :meth:`StopRequest.restore`
puts the handlers from before back. Only the main thread can install handlers: elsewhere (a notebook's
worker thread) signals keep their previous behaviour. Pure: stdlib only.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Abandoned(BaseException):
    """A second stop signal: leave the step now. A BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int, when: str) -> None:
        super().__init__(f"{signal.Signals(signum).name} received {when}")
        self.signum = signum


class StopRequest:
    """Which signal asked the run to stop (None: none yet), from :meth:`install` until :meth:`restore`."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.in_loop = False  # set by the training loop: before it (start-up) a signal abandons at once
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "no signal"

    def install(self) -> None:
        """Route SIGTERM and SIGINT here; call again after anything that may have replaced the handlers
        (``ray.init``). Only the main thread can: elsewhere signals keep their behaviour."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in SIGNALS:
            previous = signal.signal(sig, self.handle)
            self._previous.setdefault(sig, previous)  # the handlers before the first install

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def handle(self, signum: int, frame: object) -> None:
        if not self.in_loop:
            logger.warning("%s received while starting: stopping", signal.Signals(signum).name)
            raise Abandoned(signum, "while the run was starting")
        if self.signum is None:
            self.signum = signum
            logger.warning("%s received: finishing the current step, then stopping (send it again to abandon "
                           "the step)", signal.Signals(signum).name)
            return
        logger.warning("%s received again: abandoning the current step", signal.Signals(signum).name)
        raise Abandoned(signum, "again: the step in progress was abandoned")
