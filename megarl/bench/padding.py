"""The padding fraction of a measured step's policy passes, from its batch's sequence lengths.

The engine reports ``last_padding_fraction`` per rank and pass, but the workers do not return it to the driver; the
benchmark recomputes it where the batch is, with the engine's own rules: the rows each data-parallel rank receives
(``Batch.shard`` for the log-prob forward, ``Batch.chunk`` per mini-batch for the updates), the engine's micro-batch
plan and alignment (:mod:`megarl.planner.packing`), padded or packed as the policy's ``packing`` says. A pass's
fraction is ``1 - real tokens / tokens computed`` over every data-parallel rank's micro-batches (the tensor- and
context-parallel ranks of a data-parallel rank run the same ones). Not counted: expert parallelism's extra and idle
micro-batches, and rows a program drops between the log-prob forward and the update.

Pure: lengths in, fractions out; torch only through the micro-batch plan.
"""

from __future__ import annotations

import dataclasses

from megarl.algos.config import AlgorithmConfig
from megarl.engine.config import EngineConfig, MicroBatchConfig
from megarl.parallel.layout import ParallelLayout
from megarl.planner.packing import Alignment, PassTokens, pass_tokens


@dataclasses.dataclass(frozen=True)
class StepPadding:
    """Padding fractions of one step's policy passes (the log-prob forward runs only where it is recomputed)."""

    log_probs: float
    update: float

    def metrics(self) -> dict[str, float]:
        return {"bench/padding_log_probs": self.log_probs, "bench/padding_update": self.update}


def shards(lengths: list[int], n: int) -> list[list[int]]:
    """``Batch.shard``: ``n`` consecutive shards of ``ceil(len / n)`` rows, short ones filled with the first rows."""
    size = -(-len(lengths) // n)
    out = []
    for d in range(n):
        part = lengths[d * size:(d + 1) * size]
        out.append(part + [lengths[i % len(lengths)] for i in range(size - len(part))])
    return out


def chunks(lengths: list[int], n: int) -> list[list[int]]:
    """``Batch.chunk``: ``n`` equal consecutive parts."""
    if len(lengths) % n:
        raise ValueError(f"cannot split {len(lengths)} rows into {n} equal parts")
    size = len(lengths) // n
    return [lengths[i * size:(i + 1) * size] for i in range(n)]


def _pass(parts: list[list[int]], batching: MicroBatchConfig, alignment: Alignment) -> PassTokens:
    return sum((pass_tokens(p, batching.max_tokens, batching.max_size, alignment) for p in parts[1:]),
               pass_tokens(parts[0], batching.max_tokens, batching.max_size, alignment))


def step_padding(lengths: list[int], engine: EngineConfig, algorithm: AlgorithmConfig, layout: ParallelLayout,
                 moe: bool = False) -> StepPadding:
    """The log-prob forward over the batch's DP shards and the updates over each mini-batch's DP chunks."""
    sp = engine.uses_sequence_parallel(moe, layout.tp)
    alignment = Alignment.of(layout.tp, layout.cp, sp)
    forward = _pass(shards(lengths, layout.dp), engine.forward_batching, alignment)
    parts = [c for m in chunks(lengths, algorithm.mini_batches) for c in chunks(m, layout.dp)]
    update = _pass(parts, engine.micro_batch, alignment)
    return StepPadding(forward.fraction(engine.packing), update.fraction(engine.packing))
