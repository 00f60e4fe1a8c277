"""Conversion runs on the CPU whatever the machine has: the environment that hides CUDA from its process.

HF <-> Megatron conversion holds a whole model in one process (Llama-3-70B in bf16: 141 GB). With CUDA
visible, megarl builds a model on the current GPU and joins an NCCL world (``megarl/models/provider.py``,
``megarl/parallel/init.py``), so a conversion would put all of it on GPU 0, beside the ranks starting there.
In a process started with ``CUDA_VISIBLE_DEVICES`` empty, CUDA reports no device: the model is built in host
memory and the world of one is gloo, the path the CPU test suite runs. The tools set it before anything
queries CUDA (:func:`hide_cuda`); the run's conversion child calls it before its first conversion
(``megarl/trainer/cluster.py``). The local launcher converts inside its one rank's process, which
keeps its GPU. Pure: standard library only, so a tool can import it before torch.
"""

from __future__ import annotations

import os

CPU_ONLY_ENV = {"CUDA_VISIBLE_DEVICES": ""}


def hide_cuda() -> None:
    """Hide CUDA from this process. Call it before anything queries CUDA: the CUDA runtime reads the variable
    once, when it initialises (importing torch does not initialise it)."""
    os.environ.update(CPU_ONLY_ENV)
