"""The one place that initialises torch.distributed and megatron-core's parallel state.

A process joins a world either from the usual environment variables (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``: torchrun, Ray workers, Slurm) or, when none are set, as a world of
one (conversion tools, single-process tests). Backend: NCCL with CUDA, gloo without.
"""

from __future__ import annotations

import datetime
import logging
import os
import random

import torch
import torch.distributed as dist

from megarl.parallel import cpu_compat
from megarl.parallel.layout import ParallelLayout

logger = logging.getLogger(__name__)


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def comm_device() -> torch.device:
    """Where tensors for this world's collectives must live: the current GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(layout: ParallelLayout, *, seed: int = 1234, timeout_minutes: int = 30) -> None:
    """Join (or create) the torch.distributed world and initialise megatron-core for ``layout``.

    May be called again with another layout in the same world (megatron-core state is rebuilt).
    """
    cpu_compat.enable()
    from megatron.core import parallel_state, tensor_parallel

    timeout = datetime.timedelta(minutes=timeout_minutes)
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ:
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(default_backend(), timeout=timeout)
        else:
            dist.init_process_group(default_backend(), store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    layout.check_world_size(dist.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        distributed_timeout_minutes=timeout_minutes,
    )
    seed_everything(seed)
    # On CPU the CUDA RNG tracker cannot exist; the inference tracker is megatron's no-op tracker,
    # and every rank's CPU generator is seeded identically above.
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, inference_rng_tracker=cpu_compat.is_enabled(), force_reset_rng=True
    )
    logger.debug("rank %d: megatron-core initialised for %s", dist.get_rank(), layout)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def destroy_distributed() -> None:
    """Tear down megatron-core parallel state and the process group (safe to call twice)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
