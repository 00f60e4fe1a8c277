"""Work a training layout does beside holding memory: model FLOPs per token and the expert-parallel
all-to-all traffic of Mixture-of-Experts layers (docs/planner.md §10).

Pure module: no torch.distributed, no megatron-core, no Ray; plain arithmetic on a
:class:`~megarl.models.spec.ModelSpec` and a :class:`~megarl.parallel.layout.ParallelLayout`.

* FLOPs (Megatron/PaLM style, as ``megarl.bench.report.step_flops``): a forward costs ``2 N_a`` per token
  for the weights it uses plus ``2 L n_h d s`` for causal attention over a mean context of ``s/2``; a
  backward twice the forward. ``N_a`` is :meth:`ModelSpec.num_active_parameters`: an MoE token runs
  through its top-k experts and the router, not through all experts.
* Expert-parallel all-to-all (megatron-core's ``alltoall`` token dispatcher): with balanced routing each
  rank sends ``tokens * k * h * bytes * (ep-1)/ep`` (its dispatched copies bound for the other ``ep-1``
  ranks of its expert-parallel group) and receives as much, per all-to-all. An MoE layer runs four per
  micro-batch: dispatch and combine in the forward, and their gradients in the backward. The ``tokens``
  are those a rank routes: its micro-batch, or ``1/tp`` of it with sequence parallelism (megarl's default for
  MoE at tp > 1, :func:`megarl.planner.memory.sequence_parallel`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from megarl.models.spec import ModelSpec
from megarl.parallel.layout import ParallelLayout

ALLTOALLS_PER_LAYER = 4  # dispatch + combine, forward + backward


def forward_flops_per_token(spec: ModelSpec, seq_len: int) -> int:
    """Forward FLOPs of one token in a sequence of ``seq_len``: ``2 N_active + 2 L n_h d s``."""
    attention = 2 * spec.num_layers * spec.num_attention_heads * spec.head_dim * seq_len
    return 2 * spec.num_active_parameters() + attention


def training_flops_per_token(spec: ModelSpec, seq_len: int) -> int:
    """Forward and backward FLOPs of one trained token: three forwards."""
    return 3 * forward_flops_per_token(spec, seq_len)


def alltoall_bytes(spec: ModelSpec, ep: int, tokens: int, itemsize: int) -> int:
    """Bytes one rank sends (and receives) in one all-to-all of an MoE layer: ``tokens * k * h * bytes *
    (ep-1)/ep`` (0 for a dense model or ep 1)."""
    if spec.moe is None:
        return 0
    return tokens * spec.moe.top_k * spec.hidden_size * itemsize * (ep - 1) // ep


@dataclasses.dataclass(frozen=True)
class ExpertTraffic:
    """Expert-parallel all-to-all of one micro-batch (forward and backward) on a rank of the fullest stage."""

    ep: int
    tokens: int  # the micro-batch each rank routes
    alltoall: int  # bytes a rank sends (and receives) in one all-to-all
    layers: int  # MoE layers on one pipeline stage
    slowest_intra: int  # bytes per micro-batch the slowest rank sends to peers on its node
    slowest_inter: int  # ... and to peers on other nodes
    seconds: float  # lower bound per micro-batch: slowest_intra / NVLink + slowest_inter / InfiniBand

    @property
    def per_layer(self) -> int:
        return ALLTOALLS_PER_LAYER * self.alltoall

    @property
    def per_micro_batch(self) -> int:
        return self.per_layer * self.layers


def expert_traffic(spec: ModelSpec, layout: ParallelLayout, *, tokens: int, itemsize: int,
                   node_of: Callable[[int], int], intra_bps: float, inter_bps: float) -> ExpertTraffic:
    """The all-to-all bytes of every MoE layer on a stage for one micro-batch of ``tokens`` per rank, and the
    lower bound on their time: a rank sends ``alltoall / (ep-1)`` to each peer of its expert-parallel group
    (the ranks of its stage in its expert-data-parallel replica), over NVLink to peers on its node and over
    InfiniBand to the others; the slowest rank's (pipeline stages hold equal layer counts)."""
    one = alltoall_bytes(spec, layout.ep, tokens, itemsize)
    layers = spec.num_layers // layout.pp if spec.moe is not None else 0
    worst = (0, 0)
    if one:
        per_peer = one // (layout.ep - 1)
        stage_ranks = layout.tp * layout.cp * layout.dp
        for rank in range(layout.world_size):
            base, mine = rank - rank % stage_ranks, layout.expert_coords(rank).edp
            peers = [r for r in range(base, base + stage_ranks)
                     if r != rank and layout.expert_coords(r).edp == mine]
            inter = sum(node_of(r) != node_of(rank) for r in peers)
            side = (per_peer * (len(peers) - inter), per_peer * inter)
            if side[0] / intra_bps + side[1] / inter_bps > worst[0] / intra_bps + worst[1] / inter_bps:
                worst = side
    scale = ALLTOALLS_PER_LAYER * layers
    intra, inter = worst[0] * scale, worst[1] * scale
    return ExpertTraffic(ep=layout.ep, tokens=tokens, alltoall=one, layers=layers, slowest_intra=intra,
                         slowest_inter=inter, seconds=intra / intra_bps + inter / inter_bps)
