"""What the policy's weight sync reports back to the driver (pure: the driver imports it without megatron-core)."""

from __future__ import annotations

import dataclasses

from megarl.resharding.stats import TransferStats
from megarl.rollout.parity import PushParity


@dataclasses.dataclass(frozen=True)
class WeightSync:
    """One train -> rollout transition on one rank: the resharding traffic and how long the whole took; with a
    rollout pool, the driver adds the push's parity probe (:mod:`megarl.rollout.parity`)."""

    transfer: TransferStats
    seconds: float  # offload (GPU) + wake-up + streaming + load into the rollout engine
    sleep_frees_memory: bool  # whether the rollout engine's sleep releases its weights and KV cache here
    parity: PushParity | None = None  # rollout pool: every replica's log-prob gap right after the push

    def metrics(self) -> dict[str, float]:
        return (self.transfer.metrics() | {"timing/to_rollout_s": self.seconds,
                                           "rollout/sleep_frees_memory": float(self.sleep_frees_memory)}
                | (self.parity.metrics() if self.parity is not None else {}))

    @staticmethod
    def slowest(syncs: list[WeightSync]) -> WeightSync:
        """The transition of many ranks as one: the slowest rank's seconds, and each traffic count's largest value
        over the ranks (the busiest rank's bytes: which rank is slowest changes from run to run, and the byte
        counts must not change with it, or a resumed run's metrics differ from its uninterrupted twin's)."""
        slowest = max(syncs, key=lambda w: w.seconds)
        counts = {f.name: max(getattr(w.transfer, f.name) for w in syncs)
                  for f in dataclasses.fields(TransferStats) if f.name != "seconds"}
        return dataclasses.replace(slowest, transfer=dataclasses.replace(slowest.transfer, **counts))
