"""Data: the batch protocol exchanged between the driver and workers (pure: torch + tensordict)."""

from megarl.data.batch import Batch

__all__ = ["Batch"]
