"""RoleHandle's dispatch over the GroupLike protocol, with an in-process group of several ranks (no
process group, no Ray): shards, owners, and filler rows dropped in proportion to the rows a method
returns per input row (k responses per prompt). References are hand-worked row lists."""

from __future__ import annotations

from typing import Any

import torch

from megarl.controller.handles import GroupLike, RoleHandle
from megarl.controller.role import Role, WorkerContext
from megarl.controller.spec import GroupOptions
from megarl.data.batch import Batch
from megarl.parallel.layout import ParallelLayout


class Repeat(Role):
    """Each input row ``k`` times (grouped by row), tagged with the rank that produced it; only a DP
    rank's owner answers, as the real roles do."""

    def __init__(self, ctx: WorkerContext, *, k: int) -> None:
        super().__init__(ctx)
        self.k = k

    def run(self, batch: Batch, tag: int) -> Batch | None:
        if not self.ctx.is_collect_rank:
            return None
        uid = batch["uid"].repeat_interleave(self.k)
        return Batch.from_dict({"uid": uid, "rank": torch.full_like(uid, self.ctx.rank),
                                "tag": torch.full_like(uid, tag)})


class InProcessGroup:
    """GroupLike with every rank in this process: submit runs the call at once."""

    def __init__(self, layout: ParallelLayout) -> None:
        self.layout, self.options = layout, GroupOptions()
        self.roles: dict[str, list[Role]] = {}

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def add(self, name: str, make) -> None:
        self.roles[name] = [make(WorkerContext(r, self.world_size, self.layout, self.layout.coords(r), "127.0.0.1",
                                               "local", 0, "cpu")) for r in range(self.world_size)]

    def put(self, obj: Any) -> Any:
        return obj

    def submit(self, role: str, rank: int, method, *args: Any, **kwargs: Any) -> Any:
        return method(self.roles[role][rank], *args, **kwargs)

    def gather(self, role: str, futures: dict[int, Any], timeout_s: float | None) -> dict[int, Any]:
        return futures

    def finished(self, futures: dict[int, Any]) -> list[int]:
        return list(futures)


def test_dp_drops_filler_in_proportion_to_rows_per_input():
    group = InProcessGroup(ParallelLayout(tp=2, dp=2))  # ranks 0,1: DP 0; 2,3: DP 1; owners 0 and 2
    assert isinstance(group, GroupLike)
    group.add("rep", lambda ctx: Repeat(ctx, k=3))
    handle = RoleHandle(group, "rep", Repeat)
    out = handle.dp(Repeat.run, Batch.from_dict({"uid": torch.arange(5)}), 7)
    # 5 prompts over 2 DP ranks: shards of 3 (the second gets one filler copy of prompt 0), 3 rows each
    assert out["uid"].tolist() == [i for i in range(5) for _ in range(3)]
    assert out["rank"].tolist() == [0] * 9 + [2] * 6 and set(out["tag"].tolist()) == {7}
    one = handle.dp(Repeat.run, Batch.from_dict({"uid": torch.arange(4)}), 0)  # no filler
    assert one["uid"].tolist() == [i for i in range(4) for _ in range(3)]
