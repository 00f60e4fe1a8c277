"""The host memory allocator of megarl's processes: glibc's malloc, or tcmalloc / jemalloc preloaded.

PyTorch's own CPU launcher (``python -m torch.backends.xeon.run_cpu``) preloads tcmalloc (or jemalloc)
for the same reason megarl does: glibc serves every tensor above its mmap threshold (at most 32 MiB)
from fresh ``mmap`` pages, each page a fault to zero and map, and keeps the holes that a training
step's varied tensor sizes leave in its heap. Measured on the 30M-parameter GRPO benchmark (CPU, one
process, 2-step runs in the order tcmalloc, glibc, tcmalloc, jemalloc, glibc, tcmalloc, 2026-12-01):

=========  ===================  ===================================  ===========
allocator  step s (median)      policy update: page faults, sys s    peak RSS GB
=========  ===================  ===================================  ===========
glibc      68.4-73.3 (71.1)     746k-875k, 5.1-6.7                   3.91-3.97
tcmalloc   58.2-69.5 (64.5)     40k-140k, 1.2-1.6                    2.57
jemalloc   63.0-64.9            11k, 1.2                             3.05
=========  ===================  ===================================  ===========

The allocator must be chosen before a process starts, so ``megarl train`` re-executes itself once
with ``LD_PRELOAD`` set (:func:`exec_with`; its Ray daemons and workers inherit the environment), and
worker groups on an existing Ray cluster get the same variables (:func:`preload_env`). ``auto`` takes
the first of :data:`PREFERENCE` that is installed and otherwise stays on glibc; naming one that is
not installed is a configuration error.

Standard library and ``megarl.errors`` only: imported by the CLI before torch.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
from pathlib import Path

from megarl.errors import ConfigError

logger = logging.getLogger(__name__)



class Allocator(enum.StrEnum):
    """A ``cluster.allocator`` value: ``auto`` picks the first installed of :data:`PREFERENCE`, else glibc
    (``system``). An unknown name raises :class:`~megarl.errors.ConfigError` (a ValueError)."""

    AUTO = "auto"
    SYSTEM = "system"  # glibc malloc
    TCMALLOC = "tcmalloc"
    JEMALLOC = "jemalloc"

    @classmethod
    def _missing_(cls, value: object) -> Allocator:
        raise ConfigError(f"cluster.allocator: expected one of {', '.join(cls)}, found {value!r}.")


PREFERENCE = (Allocator.TCMALLOC, Allocator.JEMALLOC)  # for "auto": tcmalloc first, as torch.backends.xeon.run_cpu
_FILES = {
    Allocator.TCMALLOC: ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so"),
    Allocator.JEMALLOC: ("libjemalloc.so.2", "libjemalloc.so"),
}
_INSTALL = {Allocator.TCMALLOC: "libtcmalloc-minimal4 (Debian/Ubuntu) or gperftools (conda-forge, Fedora)",
            Allocator.JEMALLOC: "libjemalloc2 (Debian/Ubuntu) or jemalloc (conda-forge, Fedora)"}
# Keep freed pages for reuse instead of returning them after 10 s (jemalloc's default): a GRPO step
# frees and re-allocates the same activation sizes every phase, and each returned page costs a page
# fault to get back. background_thread: purging off the compute threads.
JEMALLOC_CONF = "background_thread:true,dirty_decay_ms:-1,muzzy_decay_ms:-1"
MARKER = "MEGARL_ALLOCATOR"  # set in a process tree whose allocator megarl has chosen


def search_dirs() -> list[Path]:
    """Where the shared libraries are looked for: this environment's lib, then the system's."""
    dirs = [Path(sys.prefix) / "lib", Path(sys.base_prefix) / "lib"]
    if conda := os.environ.get("CONDA_PREFIX"):
        dirs.append(Path(conda) / "lib")
    dirs += [Path(p) for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    multiarch = f"{os.uname().machine}-linux-gnu"
    for root in ("/usr/local/lib", "/usr/lib", "/lib"):
        dirs += [Path(root) / multiarch, Path(root), Path(root + "64")]
    return dirs


def find(name: Allocator) -> Path | None:
    """The shared library of allocator ``name`` (``TCMALLOC`` / ``JEMALLOC``), or None if not installed."""
    for d in search_dirs():
        for file in _FILES[name]:
            if (d / file).is_file():
                return d / file
    return None


def resolve(name: Allocator) -> tuple[Allocator, Path | None]:
    """``(allocator, library)`` for a ``cluster.allocator`` value; ``(Allocator.SYSTEM, None)`` for glibc."""
    if name is Allocator.SYSTEM:
        return Allocator.SYSTEM, None
    for candidate in PREFERENCE if name is Allocator.AUTO else (name,):
        if (lib := find(candidate)) is not None:
            return candidate, lib
    if name is not Allocator.AUTO:
        raise ConfigError(
            f"cluster.allocator: {name} is not installed (looked for {' / '.join(_FILES[name])} in "
            f"{', '.join(str(d) for d in search_dirs())}). Install {_INSTALL[name]}, or set "
            "cluster.allocator=auto (the first installed of "
            f"{' / '.join(PREFERENCE)}, else glibc) or cluster.allocator=system.")
    return Allocator.SYSTEM, None


def preload_env(name: Allocator) -> dict[str, str]:
    """Environment variables that start a process with allocator ``name`` (for glibc: only :data:`MARKER`)."""
    chosen, lib = resolve(name)
    if lib is None:
        return {MARKER: chosen.value}
    before = os.environ.get("LD_PRELOAD", "")
    env = {MARKER: chosen.value, "LD_PRELOAD": before if str(lib) in before.split() else f"{lib} {before}".strip()}
    if chosen is Allocator.JEMALLOC and "MALLOC_CONF" not in os.environ:
        env["MALLOC_CONF"] = JEMALLOC_CONF
    return env


def exec_with(name: Allocator) -> None:
    """Re-execute this command with allocator ``name`` preloaded, unless megarl already chose one for
    this process tree. Returns only when nothing is to be preloaded (glibc) or it already is."""
    if MARKER in os.environ:
        return
    env = preload_env(name)
    if "LD_PRELOAD" not in env:
        os.environ.update(env)
        logger.info("host allocator: glibc malloc (cluster.allocator=%s%s)", name,
                    "" if name is Allocator.SYSTEM else f"; none of {' / '.join(PREFERENCE)} is installed")
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], os.environ | env)


def loaded(pid: int | str = "self") -> Allocator:
    """The allocator mapped into process ``pid`` (read from its ``/proc/<pid>/maps``): one of
    :data:`PREFERENCE` or ``SYSTEM``."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return Allocator.SYSTEM
    return next((name for name in PREFERENCE if any(f in maps for f in _FILES[name])), Allocator.SYSTEM)
