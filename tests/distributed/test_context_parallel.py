"""Context parallelism (``cp``) in the engine, in one spawned gloo world of 4 (megatron-core re-initialised between
layouts): every sequence split over the CP ranks (megatron-core's load-balanced chunks), attention over the
all-gathered keys and values (megarl/models/context_parallel.py), per-token outputs gathered before the loss.

At TP1 x CP2 x DP2 against TP1 x DP4, and at TP2 x CP2 against TP2 x DP2 (sequence parallelism on at both), a
policy's log-probs and entropies and one GRPO update's loss and gradients of every parameter (each rank's shard,
reduced over DP x CP) equal the layout without CP within 1e-5 relative; so do a LoRA policy's (rank 2, B drawn
at random so that A has a gradient; the adapters' gradients), a Qwen3-MoE policy's at EP2 (the experts split over
the CP x DP ranks), a critic's values and one value-loss update at CP2. The layouts without CP are checked
against transformers in test_policy.py, test_sequence_parallel.py and (packed) test_packing.py.
"""

from __future__ import annotations

import pytest
import torch

from megarl.checkpoint.convert import convert_hf_to_megatron
from megarl.testing.dist import run_world

pytestmark = pytest.mark.dist

LENGTHS = [13, 4, 9, 11, 3, 7, 12, 5]


def _rows():
    g = torch.Generator().manual_seed(3)
    s = max(LENGTHS)
    attn = (torch.arange(s) < torch.tensor(LENGTHS)[:, None]).float()
    ids = torch.randint(5, 300, (len(LENGTHS), s), generator=g) * attn.long()
    resp = attn.clone()
    resp[:, :2] = 0
    adv = torch.randn(len(LENGTHS), 1, generator=g).expand(-1, s) * resp
    noise = 0.05 * resp * torch.randn(resp.shape, generator=g)
    returns = torch.randn(len(LENGTHS), s, generator=g) * resp
    return ids, attn, resp, adv, noise, returns


def _engine_config(sp: bool, lora: bool = False):
    from megarl.engine.config import EngineConfig, LoRAConfig, MicroBatchConfig, OptimConfig, OptimizerName

    return EngineConfig(optim=OptimConfig(optimizer=OptimizerName.SGD, lr=1e-12, clip_grad=0.0,
                                          use_distributed_optimizer=False),
                        micro_batch=MicroBatchConfig(max_tokens=24, max_size=3), sequence_parallel=sp,
                        lora=LoRAConfig(rank=2, alpha=4.0) if lora else None)


def _context(rank, world_size, **kw):
    from megarl.controller.role import WorkerContext
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    layout = ParallelLayout.for_world(world_size, **kw)
    init_distributed(layout)
    return WorkerContext(rank, world_size, layout, layout.coords(rank), "127.0.0.1", "local", 0, "cpu")


def _grads(engine) -> dict[str, list]:
    from megarl.models.provider import global_named_parameters

    return {n: p.main_grad.tolist() for c in engine.chunks for n, p in global_named_parameters(c)
            if p.requires_grad}


def _policy(rank, world_size, ckpt, layout_kw, lora=False):
    from megarl.algos.config import AlgorithmConfig
    from megarl.data.batch import Batch
    from megarl.roles.policy import PolicyRole
    from megarl.testing.dist import from_collect_rank

    ctx = _context(rank, world_size, **layout_kw)
    ids, attn, resp, adv, noise, _ = _rows()
    rows = Batch.from_dict({"input_ids": ids, "attention_mask": attn})
    policy = PolicyRole(ctx, checkpoint_dir=ckpt, engine=_engine_config(ctx.layout.tp > 1, lora),
                        algorithm=AlgorithmConfig(recompute_old_log_probs=True), temperature=0.7)
    if lora:  # B = 0 would leave A without a gradient: a B drawn from the parameter's name, the same at any layout
        from megarl.models.provider import global_named_parameters

        with torch.no_grad():
            for c in policy.engine.chunks:
                for n, p in global_named_parameters(c):
                    if n.endswith("lora_B"):
                        g = torch.Generator().manual_seed(len(n))
                        p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    lp = policy.compute_log_probs(rows)
    lp = from_collect_rank(None if lp is None else {k: lp[k].tolist() for k in ("log_probs", "entropy")}, ctx.layout)
    batch = rows.update(Batch.from_dict({"response_mask": resp, "advantages": adv,
                                         "old_log_probs": torch.tensor(lp["log_probs"]) + noise}))
    step = policy.update(batch.chunk(ctx.layout.dp)[ctx.coords.dp])
    return {"layout": str(ctx.layout), "tp": ctx.coords.tp, "lp": lp, "loss": step.loss, "grads": _grads(policy.engine)}


def _critic(rank, world_size, ckpt, layout_kw):
    from megarl.data.batch import Batch
    from megarl.roles.critic import CriticRole
    from megarl.testing.dist import from_collect_rank

    ctx = _context(rank, world_size, **layout_kw)
    ids, attn, resp, _, _, returns = _rows()
    rows = Batch.from_dict({"input_ids": ids, "attention_mask": attn})
    critic = CriticRole(ctx, checkpoint_dir=ckpt, engine=_engine_config(False), value_clip=0.2)
    values = critic.compute_values(rows)
    values = from_collect_rank(None if values is None else values["values"], ctx.layout)
    batch = rows.update(Batch.from_dict({"response_mask": resp, "old_values": values + 0.1 * resp,
                                         "returns": returns}))
    step = critic.update(batch.chunk(ctx.layout.dp)[ctx.coords.dp])
    return {"values": values.tolist(), "loss": step.loss, "grads": _grads(critic.engine)}


def _world(rank, world_size, lm, rm, moe):
    cases = (("cp2", lm, dict(cp=2), False), ("cp1", lm, {}, False), ("tp2cp2", lm, dict(tp=2, cp=2), False),
             ("tp2", lm, dict(tp=2), False), ("lora_cp2", lm, dict(cp=2), True), ("lora_cp1", lm, {}, True),
             ("moe_cp2", moe, dict(cp=2, ep=2), False), ("moe_cp1", moe, dict(ep=2), False))
    return {"policy": {name: _policy(rank, world_size, ckpt, kw, lora) for name, ckpt, kw, lora in cases},
            "critic": {name: _critic(rank, world_size, rm, kw) for name, kw in (("cp2", dict(cp=2)), ("cp1", {}))}}


@pytest.fixture(scope="module")
def world(tiny_hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    convert_hf_to_megatron(tiny_hf("qwen2_untied"), root / "lm")
    convert_hf_to_megatron(tiny_hf("qwen2_rm"), root / "rm")
    convert_hf_to_megatron(tiny_hf("qwen3_moe"), root / "moe", ep=2)
    return run_world(_world, 4, str(root / "lm"), str(root / "rm"), str(root / "moe"))


def _relative(a, b) -> float:
    a, b = torch.tensor(a), torch.tensor(b)
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.mark.parametrize("pair", [("cp2", "cp1"), ("tp2cp2", "tp2"), ("lora_cp2", "lora_cp1"),
                                  ("moe_cp2", "moe_cp1")])
def test_policy_with_cp_equals_without(world, pair):
    with_cp, without = pair
    for r in world:
        a, b = r["policy"][with_cp], r["policy"][without]
        assert a["tp"] == b["tp"]
        assert _relative(a["lp"]["log_probs"], b["lp"]["log_probs"]) < 1e-5
        assert _relative(a["lp"]["entropy"], b["lp"]["entropy"]) < 1e-5
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        worst = max((_relative(g, b["grads"][n]), n) for n, g in a["grads"].items())
        assert worst[0] < 1e-5, (a["layout"], worst)


def test_critic_with_cp_equals_without(world):
    for r in world:
        a, b = r["critic"]["cp2"], r["critic"]["cp1"]
        assert _relative(a["values"], b["values"]) < 1e-5
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert max(_relative(g, b["grads"][n]) for n, g in a["grads"].items()) < 1e-5
