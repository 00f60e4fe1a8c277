"""Peak memory of a phase: host RSS (Linux ``VmHWM``, resettable) and CUDA allocator peaks.

``reset_peaks()`` starts a phase, ``peaks()`` reads its high-water marks. Host numbers come from
``/proc/self/status``; writing ``5`` to ``/proc/self/clear_refs`` resets ``VmHWM`` to the current
RSS (Linux >= 4.0). Elsewhere the host values are reported as 0. Pure: torch only.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclasses.dataclass(frozen=True)
class MemoryPeaks:
    host_rss: int  # bytes resident now
    host_peak: int  # highest resident bytes since the last reset
    device_peak: int  # highest CUDA bytes allocated since the last reset (0 without CUDA)

    def metrics(self, prefix: str = "memory/") -> dict[str, float]:
        return {f"{prefix}host_peak_gb": self.host_peak / 1e9, f"{prefix}device_peak_gb": self.device_peak / 1e9}


def _status_kb(key: str) -> int:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def reset_peaks(*, trim: bool = True) -> None:
    """Start a phase. ``trim``: first return the C heap's free pages to the OS (glibc ``malloc_trim``),
    so that memory freed earlier and reused by the phase counts as growth instead of hiding in RSS. Under a
    preloaded jemalloc or tcmalloc (``cluster.allocator``) this returns nothing: their kept pages stay in RSS."""
    if trim:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
    with contextlib.suppress(OSError):
        _CLEAR_REFS.write_text("5")
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peaks() -> MemoryPeaks:
    device = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    return MemoryPeaks(_status_kb("VmRSS") * 1024, _status_kb("VmHWM") * 1024, device)


def take_peaks() -> dict[str, float]:
    """This process's peak memory metrics since the last phase began, then a new phase begins."""
    out = peaks().metrics()
    reset_peaks()
    return out
