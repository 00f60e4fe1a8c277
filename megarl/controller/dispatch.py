"""Which ranks receive which part of a call and whose results come back (pure, no Ray).

Data-parallel dispatch sends shard ``d`` of a batch to every rank of DP rank ``d`` (all its TP, CP and
PP members need the same inputs) and keeps the result of one owner per DP rank: the last pipeline
stage (which holds the outputs) at tensor- and context-parallel rank 0 (their ranks hold identical results).
"""

from __future__ import annotations

from megarl.parallel.layout import ParallelLayout


def dp_members(layout: ParallelLayout) -> list[list[int]]:
    """Global ranks of each data-parallel rank, indexed by DP rank."""
    return [
        [layout.rank_of(tp=t, pp=p, dp=d, cp=c) for p in range(layout.pp) for c in range(layout.cp)
         for t in range(layout.tp)]
        for d in range(layout.dp)
    ]


def collect_ranks(layout: ParallelLayout) -> list[int]:
    """The owner rank of each DP rank's result (last PP stage, TP and CP rank 0), indexed by DP rank."""
    return [layout.rank_of(tp=0, pp=layout.pp - 1, dp=d) for d in range(layout.dp)]
