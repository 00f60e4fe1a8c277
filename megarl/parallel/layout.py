"""ParallelLayout: how one model is spread over a world of processes.

Pure value type: no torch.distributed, no megatron-core. It knows megatron-core's default rank
order ("tp-cp-ep-dp-pp": tensor parallel innermost, pipeline outermost) so that planners and tests
can compute any rank's coordinates without a process group.

Context parallelism (``cp``) splits every sequence over ``cp`` ranks that hold the same weights and the
same data-parallel shard (megatron-core's load-balanced split: docs/packing.md); its ranks sit between
tensor and data parallelism. Expert parallelism (``ep``) adds no processes: as in megatron-core, the
experts of an MoE layer are split over ``ep`` ranks carved out of each pipeline stage's ``tp * cp * dp``
ranks (expert tensor parallelism is 1: every expert is whole on its rank). Within a stage, rank ``r``
holds expert shard ``r mod ep`` and is replica ``r div ep`` of it (:meth:`ParallelLayout.expert_coords`).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

from megarl.errors import LayoutError


class Auto(enum.Enum):
    """``auto`` in place of a layout size in a run's config (a pool's ``tp``, ``pp``, ``ep``; ``rollout.engine.tp``):
    megarl asks the layout planner for the cheapest layout that fits the pool's devices before any worker starts
    (:func:`megarl.config.auto.decide_layout`). A resolved config, and every layout, holds ints only."""

    AUTO = "auto"


class RankCoords(NamedTuple):
    tp: int
    pp: int
    dp: int
    cp: int = 0


class ExpertCoords(NamedTuple):
    ep: int  # which 1/ep of each MoE layer's experts the rank holds
    edp: int  # which replica of that shard (expert data parallel)


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """Tensor (tp), pipeline (pp), data (dp), virtual-pipeline (vpp), context (cp) and expert (ep) parallel sizes."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int | None = None
    cp: int = 1  # context parallelism: each sequence split over cp ranks
    ep: int = 1  # expert parallelism: MoE experts split over ep of a stage's tp*cp*dp ranks

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"ParallelLayout.{name} must be a positive integer, found {value!r}.")
        if self.vpp is not None:
            if not isinstance(self.vpp, int) or self.vpp < 1:
                raise LayoutError(f"ParallelLayout.vpp must be None or a positive integer, found {self.vpp!r}.")
            if self.vpp > 1 and self.pp == 1:
                raise LayoutError(
                    f"virtual pipeline parallelism (vpp={self.vpp}) needs pp > 1, found pp=1; "
                    "set vpp to None or raise pp."
                )
        stage = self.tp * self.cp * self.dp
        if stage % self.ep:
            raise LayoutError(
                f"ep={self.ep} must divide tp*cp*dp = {self.tp}*{self.cp}*{self.dp} = {stage}: expert parallelism "
                f"splits the experts over the ranks of one pipeline stage; choose ep from {_divisors(stage)} or raise "
                "dp."
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp

    @property
    def vpp_size(self) -> int:
        return self.vpp or 1

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert shard (megatron-core's expert data parallel size)."""
        return self.tp * self.cp * self.dp // self.ep

    @classmethod
    def for_world(cls, world_size: int, tp: int = 1, pp: int = 1, vpp: int | None = None,
                  ep: int = 1, cp: int = 1) -> ParallelLayout:
        """The layout with the given tp/pp/cp/ep whose dp fills ``world_size``."""
        if world_size % (tp * pp * cp):
            raise LayoutError(
                f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {tp * pp * cp}; "
                "choose tp, pp and cp whose product divides the number of processes."
            )
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp * cp), vpp=vpp, cp=cp, ep=ep)

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            cp = f" x cp={self.cp}" if self.cp > 1 else ""
            raise LayoutError(
                f"layout tp={self.tp}{cp} x pp={self.pp} x dp={self.dp} needs {self.world_size} processes, "
                f"but the world has {world_size}; change dp (or tp/pp/cp) so that their product is {world_size}."
            )

    def check_model(self, *, num_layers: int, num_attention_heads: int, num_query_groups: int,
                    num_experts: int | None = None) -> None:
        """Raise LayoutError if this layout cannot split a model of these dimensions (``num_experts``: None for a
        dense model, which ``ep`` does not concern: a dense reward model may share an expert-parallel pool)."""
        if num_experts is not None and num_experts % self.ep:
            raise LayoutError(
                f"ep={self.ep} must divide the number of experts ({num_experts}); choose ep from "
                f"{[d for d in _divisors(num_experts) if (self.tp * self.cp * self.dp) % d == 0]}."
            )
        if num_attention_heads % self.tp:
            raise LayoutError(
                f"tp={self.tp} must divide the number of attention heads ({num_attention_heads}); "
                f"choose tp from {_divisors(num_attention_heads)}."
            )
        if num_query_groups % self.tp:
            raise LayoutError(
                f"tp={self.tp} must divide the number of key/value heads (query groups, {num_query_groups}); "
                f"choose tp from {_divisors(num_query_groups)}."
            )
        stages = self.pp * self.vpp_size
        if num_layers % stages:
            raise LayoutError(
                f"pp*vpp = {self.pp}*{self.vpp_size} = {stages} must divide the number of layers ({num_layers}); "
                f"choose pp*vpp from {_divisors(num_layers)}."
            )

    def coords(self, rank: int) -> RankCoords:
        """Coordinates of a global rank in megatron-core's default order (tp innermost, then cp, dp, pp outermost)."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside a world of {self.world_size}.")
        return RankCoords(tp=rank % self.tp, cp=(rank // self.tp) % self.cp,
                          dp=(rank // (self.tp * self.cp)) % self.dp, pp=rank // (self.tp * self.cp * self.dp))

    def expert_coords(self, rank: int) -> ExpertCoords:
        """Expert shard and replica of a global rank (megatron-core's expert rank order: ep inside expert dp)."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside a world of {self.world_size}.")
        local = rank % (self.tp * self.cp * self.dp)
        return ExpertCoords(ep=local % self.ep, edp=local // self.ep)

    def experts_of(self, num_experts: int, ep_rank: int) -> range:
        """Global indices of the experts expert-parallel rank ``ep_rank`` holds (contiguous, equal shares)."""
        per_rank = num_experts // self.ep
        return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)

    def rank_of(self, tp: int, pp: int, dp: int, cp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def layers_of_stage(self, num_layers: int, pp_rank: int, vp_stage: int = 0) -> range:
        """Global indices of the layers held by one pipeline stage (and virtual stage), even split."""
        per_chunk = num_layers // (self.pp * self.vpp_size)
        start = vp_stage * (num_layers // self.vpp_size) + pp_rank * per_chunk
        return range(start, start + per_chunk)

    def __str__(self) -> str:
        vpp = f"xVPP{self.vpp}" if self.vpp else ""
        ep = f"xEP{self.ep}" if self.ep > 1 else ""
        cp = f"xCP{self.cp}" if self.cp > 1 else ""
        return f"TP{self.tp}{cp}xPP{self.pp}xDP{self.dp}{vpp}{ep}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
