"""A small role for testing and benchmarking the controller (no model): reports where it runs,
exercises the process groups and echoes batches with its rank attached."""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from megarl.controller.role import Role, WorkerContext
from megarl.data.batch import Batch


@dataclasses.dataclass(frozen=True)
class RankReport:
    rank: int
    pid: int
    node_id: str
    tp: int
    pp: int
    dp: int
    cp: int
    mcore_tp: int  # as megatron-core's parallel_state reports them
    mcore_pp: int
    mcore_dp: int
    mcore_cp: int
    malloc_libs: tuple[str, ...] = ()  # mapped shared libraries with "malloc" in their name (jemalloc, tcmalloc)
    group_timeouts_s: dict[str, float] = dataclasses.field(default_factory=dict)  # world, tp, pp, dp: a collective's
    visible_gpus: str | None = None  # $CUDA_VISIBLE_DEVICES of the process (None: not set)


def _malloc_libs() -> tuple[str, ...]:
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if line.rstrip().endswith(".so") or ".so." in line}
    return tuple(sorted({os.path.basename(p) for p in paths if "malloc" in os.path.basename(p)}))


def _group_timeouts_s() -> dict[str, float]:
    """How long one collective may wait in the world and in megatron-core's groups, as their backends hold it."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.parallel.init import comm_device

    groups = {"world": dist.group.WORLD, "tp": ps.get_tensor_model_parallel_group(),
              "pp": ps.get_pipeline_model_parallel_group(), "dp": ps.get_data_parallel_group()}
    return {name: g._get_backend(comm_device()).options._timeout.total_seconds() for name, g in groups.items()}


class EchoRole(Role):
    def __init__(self, ctx: WorkerContext, scale: float = 2.0) -> None:
        super().__init__(ctx)
        self.scale = scale

    def report(self) -> RankReport:
        from megatron.core import parallel_state as ps

        c = self.ctx.coords
        return RankReport(
            rank=self.ctx.rank, pid=os.getpid(), node_id=self.ctx.node_id, tp=c.tp, pp=c.pp, dp=c.dp, cp=c.cp,
            mcore_tp=ps.get_tensor_model_parallel_rank(), mcore_pp=ps.get_pipeline_model_parallel_rank(),
            mcore_dp=ps.get_data_parallel_rank(), mcore_cp=ps.get_context_parallel_rank(), malloc_libs=_malloc_libs(),
            group_timeouts_s=_group_timeouts_s(),
            visible_gpus=os.environ.get("CUDA_VISIBLE_DEVICES"),
        )

    def all_reduce(self, value: float) -> dict[str, float]:
        """Sums of ``value * (rank + 1)`` over the world, the TP group and the DP group."""
        from megatron.core import parallel_state as ps

        from megarl.parallel import collectives

        out = {}
        for name, group in (("world", None), ("tp", ps.get_tensor_model_parallel_group()),
                            ("dp", ps.get_data_parallel_group())):
            t = torch.tensor([value * (self.ctx.rank + 1)], dtype=torch.float64)
            collectives.all_reduce(t, group=group)  # NCCL takes no host tensor
            out[name] = t.item()
        return out

    def scale_batch(self, batch: Batch) -> Batch | None:
        """``y = scale * x`` and the DP rank that computed each sample; None on non-owner ranks."""
        if not self.ctx.is_collect_rank:
            return None
        dp = torch.full((len(batch),), self.ctx.coords.dp, dtype=torch.long)
        return Batch.from_dict({"y": batch["x"] * self.scale, "dp_rank": dp}, {"id": batch["id"]})

    def fail(self, rank: int) -> None:
        """Raise on ``rank``; the others enter a collective the failed rank never joins."""
        if self.ctx.rank == rank:
            raise ValueError(f"deliberate failure on rank {rank}")
        import torch.distributed as dist

        dist.barrier()

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def noop(self) -> None:
        return None


def rollout_engine_state(role) -> dict[str, torch.Tensor]:
    """The weights a rollout pool's engine holds (call it on :class:`megarl.roles.split.RolloutRole` ranks)."""
    return {n: p.detach().clone() for n, p in role.engine.model.state_dict().items()}
