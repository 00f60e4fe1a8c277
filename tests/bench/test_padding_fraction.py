"""The benchmark's padding fraction (megarl/bench/padding.py: from the batch's lengths, the DP split and the engine's
micro-batch rules, without asking the workers) equals the engine's own ``last_padding_fraction``, in one spawned
gloo world of 2 (megatron-core re-initialised between layouts): padded and packed at DP2 and at TP2 with sequence
parallelism, packed at CP2; the log-prob forward (the batch's DP shards, forward batching) and one update (its DP
chunks, the training micro-batches).
"""

from __future__ import annotations

import pytest
import torch

from megarl.checkpoint.convert import convert_hf_to_megatron
from megarl.testing.dist import run_world

pytestmark = pytest.mark.dist

LENGTHS = [13, 4, 9, 11, 3, 7, 12, 5, 6, 14]
CASES = {"dp2": (dict(), (False, True)), "tp2-sp": (dict(tp=2), (False, True)), "cp2": (dict(cp=2), (True,))}


def _engine_config(packing: bool, sp: bool):
    from megarl.engine.config import EngineConfig, MicroBatchConfig, OptimConfig, OptimizerName

    return EngineConfig(optim=OptimConfig(optimizer=OptimizerName.SGD, lr=1e-12, use_distributed_optimizer=False),
                        micro_batch=MicroBatchConfig(max_tokens=24, max_size=3), packing=packing,
                        sequence_parallel=sp)


def _batch():
    from megarl.data.batch import Batch

    s = max(LENGTHS)
    attn = (torch.arange(s) < torch.tensor(LENGTHS)[:, None]).float()
    ids = torch.randint(5, 300, (len(LENGTHS), s), generator=torch.Generator().manual_seed(0)) * attn.long()
    resp = attn.clone()
    resp[:, :2] = 0
    return Batch.from_dict({"input_ids": ids, "attention_mask": attn, "response_mask": resp,
                            "advantages": resp * 0.5})


def _world(rank, world_size, ckpt):
    from megarl.algos.config import AlgorithmConfig
    from megarl.controller.role import WorkerContext
    from megarl.data.batch import Batch
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.policy import PolicyRole

    out = {}
    for name, (layout_kw, modes) in CASES.items():
        layout = ParallelLayout.for_world(world_size, **layout_kw)
        init_distributed(layout)
        ctx = WorkerContext(rank, world_size, layout, layout.coords(rank), "127.0.0.1", "local", 0, "cpu")
        batch = _batch()
        for packing in modes:
            policy = PolicyRole(ctx, checkpoint_dir=ckpt, engine=_engine_config(packing, layout.tp > 1),
                                algorithm=AlgorithmConfig(recompute_old_log_probs=True), temperature=1.0)
            shard = batch.shard(layout.dp)[0][ctx.coords.dp]  # what the controller sends this DP rank
            policy.compute_log_probs(shard)
            forward = policy.engine.last_padding_fraction
            chunk = batch.update(Batch.from_dict({"old_log_probs": torch.zeros(batch["input_ids"].shape)}))
            chunk = chunk.chunk(layout.dp)[ctx.coords.dp]  # one mini-batch's DP chunk
            policy.update(chunk)
            out[f"{name}/{packing}"] = {"dp": ctx.coords.dp, "forward": forward,
                                        "forward_real": float(shard["attention_mask"].sum()),
                                        "update": policy.engine.last_padding_fraction,
                                        "update_real": float(chunk["attention_mask"].sum())}
    return out


@pytest.fixture(scope="module")
def world(tiny_hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("padding")
    convert_hf_to_megatron(tiny_hf("qwen2_untied"), root / "lm")
    return run_world(_world, 2, str(root / "lm"))


def _overall(ranks: list[dict], key: str) -> float:
    """1 - real / computed over the DP ranks (each counted once), from each rank's fraction and real tokens."""
    by_dp = {r["dp"]: r for r in ranks}
    real = sum(r[f"{key}_real"] for r in by_dp.values())
    computed = sum(r[f"{key}_real"] / (1 - r[key]) for r in by_dp.values())
    return 1 - real / computed


@pytest.mark.parametrize("case", [f"{n}/{p}" for n, (_, modes) in CASES.items() for p in modes])
def test_bench_padding_equals_the_engine(world, case):
    from megarl.algos.config import AlgorithmConfig
    from megarl.bench.padding import step_padding
    from megarl.parallel.layout import ParallelLayout

    name, packing = case.split("/")
    layout = ParallelLayout.for_world(2, **CASES[name][0])
    got = step_padding(LENGTHS, _engine_config(packing == "True", layout.tp > 1), AlgorithmConfig(), layout)
    ranks = [r[case] for r in world]
    assert got.log_probs == pytest.approx(_overall(ranks, "forward"), abs=1e-9)
    assert got.update == pytest.approx(_overall(ranks, "update"), abs=1e-9)
    if packing == "False":
        assert got.update > 0.05  # the padded micro-batches do pad these lengths
