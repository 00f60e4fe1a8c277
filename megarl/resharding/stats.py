"""One weight sync's traffic on one rank (pure: the driver reads it without torch.distributed)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class TransferStats:
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_kept: int = 0  # copied locally (the rank already held them)
    buckets: int = 0
    adapter_bytes: int = 0  # adapter-only LoRA sync: the adapter's bytes each engine loads (megarl.roles.adapter_sync)

    def metrics(self) -> dict[str, float]:
        out = {f"reshard/{k}": float(v) for k, v in dataclasses.asdict(self).items() if k != "seconds"}
        return out | {"timing/reshard_s": self.seconds}
