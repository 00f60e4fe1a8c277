"""Parallelism: layouts (pure), the CPU compatibility layer for megatron-core, and the one place
that initialises torch.distributed and megatron-core's parallel state."""

from megarl.parallel.layout import ParallelLayout

__all__ = ["ParallelLayout"]
