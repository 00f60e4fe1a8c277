"""The one place that initialises torch.distributed and megatron-core's parallel state.

A process joins a world either from the usual environment variables (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``: torchrun, Ray workers, Slurm) or, when none are set, as a world of
one (conversion tools, single-process tests). Backend: NCCL with CUDA, gloo without.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import random
from typing import TYPE_CHECKING

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


if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection


def process_groups() -> ProcessGroupCollection:
    """This process's megatron-core groups (tensor, pipeline, data, context and model parallel) as one object,
    which the roles hand to the engine and the rollout explicitly (after :func:`init_distributed`)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "pp", "dp", "mp", "cp"])


def init_distributed(layout: ParallelLayout, *, seed: int = 1234, collective_timeout_s: float | None = None) -> None:
    """Join (or create) the torch.distributed world and initialise megatron-core for ``layout``.

    ``collective_timeout_s``: how long one collective of the world (when created here) and of megatron-core's
    groups may wait (``cluster.timeouts.collective_s`` for a run's workers); None: torch's and megatron-core's
    defaults. May be called again in the same world: another layout rebuilds megatron-core's state, the same
    one keeps it.
    """
    cpu_compat.enable()
    from megatron.core import parallel_state, tensor_parallel

    timeout = None if collective_timeout_s is None else datetime.timedelta(seconds=collective_timeout_s)
    mcore_timeout = {} if collective_timeout_s is None else {"distributed_timeout_minutes": collective_timeout_s / 60}
    if not dist.is_initialized():
        backend = default_backend()
        if torch.cuda.is_available() and "WORLD_SIZE" in os.environ:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # NCCL is told its device: its barrier() and the groups split from the world then use it, not a guess
        # (torch warns at the first barrier without it; a wrong guess hangs a world whose ranks share a node)
        bound = {"device_id": torch.device("cuda", torch.cuda.current_device())} if backend == "nccl" else {}
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout, **bound)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **bound)
    layout.check_world_size(dist.get_world_size())
    initialised = parallel_state.model_parallel_is_initialized() and (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        parallel_state.get_expert_model_parallel_world_size(),
        parallel_state.get_context_parallel_world_size(),
    ) == (layout.tp, layout.pp, layout.vpp, layout.ep, layout.cp)  # dp follows from the world size checked above
    if not initialised:
        _destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp,
            context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=1,
            **mcore_timeout,
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


def _destroy_model_parallel() -> None:
    """megatron-core's ``destroy_model_parallel()`` destroys only its gloo groups and forgets the others, which
    then live on: on gloo each keeps three threads, one waking every 10 ms, so a process that re-initialised
    (checkpoint conversion, then a role's layout) held ~40 such polling threads instead of ~20. Destroy
    every group megatron-core created on this rank (a group's threads end once nothing refers to it)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return
    groups = [g for g in parallel_state._global_process_group_list or () if g is not None]
    parallel_state.destroy_model_parallel()
    # RotaryEmbedding.forward's lru_cache keeps its last 32 callers (and their process groups) alive
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    RotaryEmbedding.forward.cache_clear()
    for group in groups:
        with contextlib.suppress(ValueError):  # already destroyed by destroy_model_parallel (its gloo groups)
            dist.destroy_process_group(group)


def destroy_distributed() -> None:
    """Tear down megatron-core parallel state and the process group (safe to call twice)."""
    _destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
