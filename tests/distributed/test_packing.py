"""Packed micro-batches (``EngineConfig.packing``, the default) against right-padded ones, in one spawned gloo world
of 4 (megatron-core re-initialised between layouts).

Packing changes which tokens the model computes (only the real ones, sequences end to end with ``cu_seqlens``) and
how rows group into micro-batches (the budget counts real tokens), never a number beyond rounding: at TP2 x DP2
with sequence parallelism and at PP2 x DP2 a policy's log-probs and entropies, and one GRPO update's loss, metrics
and gradient (the whole model's; each parameter's within 1e-4) equal the padded engine's within 1e-5 relative; so
do a critic's values and one value-loss update's gradients at TP2 with sequence parallelism, and a Qwen3-MoE
policy's at EP2 with router replay
(random forced routing, every token; the padded path is checked against transformers under replay in
test_moe_training.py). The padded path is itself checked against transformers in test_policy.py and
test_sequence_parallel.py; every other distributed test now runs packed against its own reference. The engine's
``last_padding_fraction`` is checked against the rows' lengths by hand.
"""

from __future__ import annotations

import pytest
import torch

from megarl.checkpoint.convert import convert_hf_to_megatron
from megarl.testing.dist import run_world

pytestmark = pytest.mark.dist

LENGTHS = [13, 4, 9, 11, 3, 7, 12, 5]  # per DP rank (2 of them): rows 0-3 and 4-7
PROMPT = 2


def _rows():
    g = torch.Generator().manual_seed(3)
    s = max(LENGTHS)
    attn = (torch.arange(s) < torch.tensor(LENGTHS)[:, None]).float()
    ids = torch.randint(5, 300, (len(LENGTHS), s), generator=g) * attn.long()
    resp = attn.clone()
    resp[:, :PROMPT] = 0
    adv = torch.randn(len(LENGTHS), 1, generator=g).expand(-1, s) * resp
    returns = torch.randn(len(LENGTHS), s, generator=g) * resp
    return ids, attn, resp, adv, returns


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _engine_config(packing: bool, **kw):
    from megarl.engine.config import EngineConfig, MicroBatchConfig, OptimConfig, OptimizerName

    return EngineConfig(optim=OptimConfig(optimizer=OptimizerName.SGD, lr=1e-12, clip_grad=0.0,
                                          use_distributed_optimizer=False),
                        micro_batch=MicroBatchConfig(max_tokens=24, max_size=3), packing=packing, **kw)


def _grads(engine) -> dict[str, torch.Tensor]:
    from megarl.models.provider import global_named_parameters

    return {n: p.main_grad.clone() for c in engine.chunks for n, p in global_named_parameters(c)}


def _policy_case(rank, world_size, ckpt, layout_kw, engine_kw, routed):
    from megarl.algos.config import AlgorithmConfig
    from megarl.algos.losses import PolicyLossConfig
    from megarl.algos.ops import LossAggregation
    from megarl.controller.role import WorkerContext
    from megarl.data.batch import Batch
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.policy import PolicyRole
    from megarl.testing.dist import from_collect_rank

    layout = ParallelLayout.for_world(world_size, **layout_kw)
    init_distributed(layout)
    coords = layout.coords(rank)
    ctx = WorkerContext(rank, world_size, layout, coords, "127.0.0.1", "local", 0, "cpu")
    ids, attn, resp, adv, _ = _rows()
    extra = {} if routed is None else {"routed_experts": routed}
    rows = Batch.from_dict({"input_ids": ids, "attention_mask": attn, **extra})
    # per-sequence aggregation: each row's own token mean, so a row split wrongly would show
    algorithm = AlgorithmConfig(policy_loss=PolicyLossConfig(aggregation=LossAggregation.SEQ_MEAN_TOKEN_MEAN),
                                recompute_old_log_probs=True)
    out = {}
    for packing in (True, False):
        policy = PolicyRole(ctx, checkpoint_dir=ckpt, engine=_engine_config(packing, **engine_kw),
                            algorithm=algorithm, temperature=0.7)
        lp = policy.compute_log_probs(rows)
        lp = from_collect_rank(None if lp is None else {k: lp[k] for k in ('log_probs', 'entropy')}, layout)
        old = lp["log_probs"] + 0.05 * resp * torch.randn(resp.shape, generator=torch.Generator().manual_seed(1))
        batch = rows.update(Batch.from_dict({"response_mask": resp, "advantages": adv, "old_log_probs": old}))
        shard = batch.chunk(layout.dp)[coords.dp]
        step = policy.update(shard)
        fraction = policy.engine.last_padding_fraction
        out[packing] = dict(lp=lp, step=step, grads=_grads(policy.engine), fraction=fraction)
        del policy
    p, q = out[True], out[False]
    return {"case": str(layout), "tp": coords.tp, "pp": coords.pp, "dp": coords.dp,
            "lp": _relative(p["lp"]["log_probs"], q["lp"]["log_probs"]),
            "entropy": _relative(p["lp"]["entropy"], q["lp"]["entropy"]),
            "loss": abs(p["step"].loss - q["step"].loss) / abs(q["step"].loss),
            "terms": {k: (v, q["step"].terms[k]) for k, v in p["step"].terms.items()},
            "grads": _relative(torch.cat([g.flatten() for g in p["grads"].values()]),
                               torch.cat([q["grads"][n].flatten() for n in p["grads"]])),
            "grads_each": max(_relative(g, q["grads"][n]) for n, g in p["grads"].items() if q["grads"][n].norm() > 0),
            "fractions": (p["fraction"], q["fraction"])}


def _critic_case(rank, world_size, ckpt):
    from megarl.controller.role import WorkerContext
    from megarl.data.batch import Batch
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.critic import CriticRole
    from megarl.testing.dist import from_collect_rank

    layout = ParallelLayout.for_world(world_size, tp=2)
    init_distributed(layout)
    coords = layout.coords(rank)
    ctx = WorkerContext(rank, world_size, layout, coords, "127.0.0.1", "local", 0, "cpu")
    ids, attn, resp, _, returns = _rows()
    rows = Batch.from_dict({"input_ids": ids, "attention_mask": attn})
    out = {}
    for packing in (True, False):
        critic = CriticRole(ctx, checkpoint_dir=ckpt, engine=_engine_config(packing, sequence_parallel=True),
                            value_clip=0.2)
        values = critic.compute_values(rows)
        values = from_collect_rank(None if values is None else values["values"], layout)
        batch = rows.update(Batch.from_dict({"response_mask": resp, "old_values": values + 0.1 * resp,
                                             "returns": returns}))
        step = critic.update(batch.chunk(layout.dp)[coords.dp])
        out[packing] = dict(values=values, loss=step.loss, grads=_grads(critic.engine))
        del critic
    p, q = out[True], out[False]
    return {"values": _relative(p["values"], q["values"]), "loss": abs(p["loss"] - q["loss"]) / abs(q["loss"]),
            "grads": max(_relative(g, q["grads"][n]) for n, g in p["grads"].items() if q["grads"][n].norm() > 0)}


def _world(rank, world_size, lm, moe, rm, routed):
    cases = [_policy_case(rank, world_size, lm, dict(tp=2), dict(sequence_parallel=True), None),
             _policy_case(rank, world_size, lm, dict(pp=2), {}, None),
             _policy_case(rank, world_size, moe, dict(ep=2), dict(router_replay=True), torch.tensor(routed))]
    return {"policy": cases, "critic": _critic_case(rank, world_size, rm)}


@pytest.fixture(scope="module")
def world(tiny_hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("packing")
    convert_hf_to_megatron(tiny_hf("qwen2_untied"), root / "lm")
    convert_hf_to_megatron(tiny_hf("qwen3_moe"), root / "moe", ep=2)
    convert_hf_to_megatron(tiny_hf("qwen2_rm"), root / "rm")
    # a random top-k of the experts for every (token, layer): replay forces it on every router
    from megarl.models.spec import load_hf_config, spec_from_hf_config

    moe = spec_from_hf_config(load_hf_config(tiny_hf("qwen3_moe"))).moe
    g = torch.Generator().manual_seed(11)
    layers = load_hf_config(tiny_hf("qwen3_moe"))["num_hidden_layers"]
    routed = torch.rand(len(LENGTHS), max(LENGTHS), layers, moe.num_experts, generator=g).argsort(-1)[..., :moe.top_k]
    return run_world(_world, 4, str(root / "lm"), str(root / "moe"), str(root / "rm"), routed.tolist())


@pytest.mark.parametrize("case", [0, 1, 2], ids=["tp2_sp", "pp2", "moe_ep2_replay"])
def test_packed_policy_equals_padded(world, case):
    for r in world:
        c = r["policy"][case]
        assert c["lp"] < 1e-5 and c["entropy"] < 1e-5, c
        assert c["loss"] < 1e-5, c
        # metrics that are means of log-prob differences (approx_kl ~ 2e-3 of log-probs ~ 5): 1e-6 absolute is
        # float32 rounding of the log-probs they cancel
        for name, (packed, padded) in c["terms"].items():
            assert packed == pytest.approx(padded, rel=1e-5, abs=1e-6), (name, c)
        # the whole gradient within 1e-5; each parameter's within 1e-4 (a rarely routed expert's gradient is small:
        # measured 1.1e-5 relative, float32 rounding of a different summation order)
        assert c["grads"] < 1e-5 and c["grads_each"] < 1e-4, c


def test_packed_critic_equals_padded(world):
    for r in world:
        c = r["critic"]
        assert c["values"] < 1e-5 and c["loss"] < 1e-5 and c["grads"] < 1e-5, c


def test_padding_fraction_by_hand(world):
    """The update's micro-batches (budget 24 tokens, at most 3 rows) of DP rank 0's rows 13, 4, 9, 11 at TP2 with
    sequence parallelism. Padded (greedy, longest first, rows x longest <= 24): [13], [11, 9] and [4], cut to their
    longest rows and padded to even widths: 14 + 2 x 12 + 4 = 42 tokens for 37 real ones. Packed (first fit, longest
    first): [13, 11] (24 tokens) and [9, 4] (13, padded to 14): 38."""
    c = next(r["policy"][0] for r in world if r["policy"][0]["dp"] == 0)
    packed, padded = c["fractions"]
    assert padded == pytest.approx(1 - 37 / 42)
    assert packed == pytest.approx(1 - 37 / 38)
