"""The host memory allocator of megarl's processes: glibc's malloc, or tcmalloc / jemalloc preloaded.

PyTorch's own CPU launcher (``python -m torch.backends.xeon.run_cpu``) preloads tcmalloc (or jemalloc)
for the same reason megarl does: glibc serves every tensor above its mmap threshold (at most 32 MiB)
from fresh ``mmap`` pages, each page a fault to zero and map, and keeps the holes that a training
step's varied tensor sizes leave in its heap. Every install has a jemalloc to preload: Ray's wheel
ships one (``ray/core/libjemalloc.so``), found without importing Ray (:func:`search_dirs`).

Measured on the 30M-parameter GRPO benchmark (CPU, one process, 1 warm-up + 2 steps, AMD EPYC
2 cores, 2026-12-03; whole run: page faults and system seconds; peak: VmHWM over the steps):

==============================================  ========  ===========  ======  =======
setting                                         step s    page faults  sys s   peak GB
==============================================  ========  ===========  ======  =======
glibc                                           56.1      5.18 M       40.0    4.02
glibc, torch's THP_MEM_ALLOC_ENABLE=1           53.6      0.82 M       40.4    3.82
glibc, mmap_max=0 + trim_threshold 16 GiB       53.3      2.70 M       30.9    4.01
glibc, mmap_threshold=2 MiB + THP               64.7      7.75 M       70.9    2.58
Ray's jemalloc, never purging                   48.6      0.80 M       16.0    3.09
Ray's jemalloc, jemalloc's defaults             66.4      29.2 M       79.7    2.58
==============================================  ========  ===========  ======  =======

With :data:`JEMALLOC_CONF` (``oversize_threshold:0`` added) and LeanRMSNorm, in a slower phase of the
machine the same day: 54.8 s, peak 2.85 GB (2.80 sampled over the whole run) against 55.5 s, 2.92 GB
(3.14) without ``oversize_threshold:0``.

Huge pages cut the faults but not the zeroing (the system time stays); keeping freed memory in
glibc's heap keeps the faults of its other arenas; only retaining freed pages for reuse (jemalloc,
never purging) removes both. An earlier series on an Intel Xeon (2026-12-01) had tcmalloc at a
median 64.5 s and 2.57 GB against glibc's 71.1 s and 3.91 GB.

The allocator must be chosen before a process starts, so ``megarl train`` re-executes itself once
with ``LD_PRELOAD`` set (:func:`exec_with`; its Ray daemons and workers inherit the environment), before
it imports torch (that import, ~4 s here, would otherwise be paid twice: it was, and made every small
run slower under jemalloc than under glibc), and worker groups on an existing Ray cluster get the same
variables (:func:`preload_env`). ``auto`` takes the first of :data:`PREFERENCE` that is installed and
otherwise stays on glibc; naming one that is not installed is a configuration error.

Standard library and ``megarl.errors`` only: imported by the CLI before torch.
"""

from __future__ import annotations

import enum
import importlib.util
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


DEFAULT = Allocator.AUTO  # cluster.allocator when a config does not set it
PREFERENCE = (Allocator.TCMALLOC, Allocator.JEMALLOC)  # for "auto": tcmalloc first, as torch.backends.xeon.run_cpu
_FILES = {
    Allocator.TCMALLOC: ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so"),
    Allocator.JEMALLOC: ("libjemalloc.so.2", "libjemalloc.so"),
}
_INSTALL = {Allocator.TCMALLOC: "libtcmalloc-minimal4 (Debian/Ubuntu) or gperftools (conda-forge, Fedora)",
            Allocator.JEMALLOC: "libjemalloc2 (Debian/Ubuntu) or jemalloc (conda-forge, Fedora), or reinstall "
                                "Ray (its wheel ships ray/core/libjemalloc.so)"}
# Keep freed pages for reuse instead of returning them after 10 s (jemalloc's default): a GRPO step
# frees and re-allocates the same activation sizes every phase, and each returned page costs a page
# fault to get back. oversize_threshold:0: no separate arena for allocations over 8 MiB (nearly every
# activation of a 30M model's micro-batch), so freed large and small extents serve each other (peak
# 3.13 -> 2.80 GB on the 30M benchmark). background_thread: purging off the compute threads.
JEMALLOC_CONF = "background_thread:true,dirty_decay_ms:-1,muzzy_decay_ms:-1,oversize_threshold:0"
MARKER = "MEGARL_ALLOCATOR"  # set in a process tree whose allocator megarl has chosen


def search_dirs() -> list[Path]:
    """Where the shared libraries are looked for: this environment's lib, the system's, then the directory
    of the jemalloc that Ray's wheel ships (``ray/core/libjemalloc.so``, jemalloc 5.3.0 in Ray 2.60): Ray
    is one of megarl's dependencies, so every install has an allocator to preload."""
    dirs = [Path(sys.prefix) / "lib", Path(sys.base_prefix) / "lib"]
    if conda := os.environ.get("CONDA_PREFIX"):
        dirs.append(Path(conda) / "lib")
    dirs += [Path(p) for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    multiarch = f"{os.uname().machine}-linux-gnu"
    for root in ("/usr/local/lib", "/usr/lib", "/lib"):
        dirs += [Path(root) / multiarch, Path(root), Path(root + "64")]
    if (ray := _package_dir("ray")) is not None:
        dirs.append(ray / "core")
    return dirs


def _package_dir(name: str) -> Path | None:
    """The directory of installed package ``name``, found without importing it (None if not installed)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    locations = spec.submodule_search_locations if spec is not None else None
    return Path(next(iter(locations))) if locations else None


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
