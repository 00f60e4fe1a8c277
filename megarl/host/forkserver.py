"""The fork server megarl's helper processes start from (``multiprocessing``'s ``forkserver``): a child is forked
from a server that has imported what the children need once per process, instead of being a fresh interpreter
that imports torch and megatron-core again (~7 s of CPU on a 2-core machine).

Users: the run's HF -> Megatron conversion child (``megarl.trainer.cluster.Conversions``) and the test worlds
(``megarl.testing.dist.run_world``). The server is started by the first child of the process and imports the
union of the modules named by :func:`preload` before that: a test session names the worlds' modules at its start
(tests/conftest.py), so a conversion that happens to start the server first does not leave them out. The server is
a fresh interpreter (not a fork of a threaded driver), imports modules only (no CUDA is initialised there: a child
initialises its own) and exits with the process that started it. A child starts with the server's environment: a
user passes its own (see both users). Standard library only.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context

_PRELOAD: list[str] = []


def preload(*modules: str) -> None:
    """Add ``modules`` to what the server imports when it starts (no effect once it runs; a module that cannot be
    imported is skipped by the server and imported, or not, by the child itself)."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)
    multiprocessing.set_forkserver_preload(list(_PRELOAD))


def context() -> multiprocessing.context.ForkServerContext:
    """The fork-server context to create children with (``ProcessPoolExecutor(mp_context=...)``)."""
    return multiprocessing.get_context("forkserver")
