"""LoRA on megatron-core (issue #45) against HF peft on transformers, in one spawned gloo world of 4 at TP1 x DP4,
TP2 x DP2, TP2 x DP2 with sequence parallelism and PP2 x DP2 (megatron-core re-initialised between layouts).

Each layout builds a policy with rank-4 adapters on qkv, proj, fc1 and fc2, sets every ``lora_B`` to a random
matrix drawn from its global name (so the adapters change the logits and ``A`` has a gradient), then:

- its token log-probs at temperature 1 must equal peft's on the same factors (1e-5 relative),
- with adapters disabled, transformers' base model's (the reference policy of a LoRA run),
- one SFT update's gradients of every factor (the DDP buffers, reduced over DP) must equal peft's autograd mapped
  onto megatron-core's fused layout: ``A`` of qkv is shared by q, k and v (its gradient is the sum of peft's three),
  ``B`` of qkv is peft's three stacked in megatron's per-group order; ``A`` of fc1 the sum of gate's and up's,
  ``B`` ``[gate; up]`` (1e-5 relative),
- a GRPO update with the KL loss against the base (``compute_log_probs(adapters=False)``: the reference of a LoRA
  run) reports the k3 KL that peft's and transformers' log-probs give by hand (1e-5),
- after 20 updates every base weight is bit-identical to the checkpoint's, and the optimizer holds the adapters
  only.

The tiny Qwen3-MoE model runs the same checks at EP2 and at TP2 x EP2 (sequence parallelism, which megatron-core
needs to train MoE at TP > 1) with every expert's fc1 / fc2 adapted; peft cannot adapt transformers 5's fused
expert tensors one expert at a time, so its reference is transformers' forward with each adapted weight replaced by
``W + scale * B A`` (``torch.func.functional_call``), the factors leaves of torch's autograd.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from megarl.checkpoint.convert import convert_hf_to_megatron
from megarl.testing.dist import run_world

pytestmark = pytest.mark.dist

RANK, ALPHA = 4, 8.0
LAYOUTS = [dict(tp=1), dict(tp=2), dict(tp=2, sp=True), dict(pp=2)]
MOE_LAYOUTS = [dict(ep=2), dict(tp=2, ep=2)]  # MoE training at TP > 1 runs with sequence parallelism
KL_COEF = 0.1
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _rows():
    g = torch.Generator().manual_seed(5)
    lengths = [9, 6, 12, 7, 5, 10, 11, 8]
    ids = torch.zeros(8, 12, dtype=torch.long)
    attn = (torch.arange(12) < torch.tensor(lengths)[:, None]).float()
    ids[attn.bool()] = torch.randint(5, 300, (int(attn.sum()),), generator=g)
    resp = attn.clone()
    resp[:, :3] = 0
    adv = torch.randn(8, 1, generator=g).expand(8, 12) * resp
    return ids, attn, resp, adv


def _b(name: str, shape) -> torch.Tensor:
    """The test's ``lora_B`` of the adapted weight ``name`` (global Megatron name), drawn whole from the name."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(*shape, generator=gen) * 0.05


def _adapted_maps(spec):
    from megarl.engine.config import LORA_TARGETS
    from megarl.models import adapters

    return adapters.adapted_maps(spec, LORA_TARGETS)


def _log_probs(logits, ids, attn):
    lp = torch.zeros_like(attn)
    lp[:, 1:] = torch.log_softmax(logits.float()[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return lp * attn


def _k3(lp, ref, resp):
    """k3 of KL(policy || reference) per response token, token mean (the KL loss's estimator, clamps inactive)."""
    d = ref - lp
    return float(((torch.exp(d) - d - 1) * resp).sum() / resp.sum())


def _peft_reference(hf_dir, a_factors):
    """peft's log-probs, base log-probs and factor gradients (mapped to megarl's global fused layout)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from megarl.models import adapters, mapping
    from megarl.models.spec import load_hf_config, spec_from_hf_config

    spec = spec_from_hf_config(load_hf_config(hf_dir))
    ids, attn, resp, adv = _rows()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=PEFT_TARGETS, lora_dropout=0.0))
    modules = dict(model.named_modules())

    def lora_of(hf_name):
        return modules["base_model.model." + hf_name.removesuffix(".weight")]

    with torch.no_grad():
        for m in _adapted_maps(spec):
            a = torch.as_tensor(a_factors[m.mcore])
            b = _b(m.mcore, (mapping.mcore_shape(m, spec, 0)[0], RANK))
            for hf_name, b_part in zip(m.hf, mapping.unpack_rows(m, spec, b), strict=True):
                layer = lora_of(hf_name)
                layer.lora_A["default"].weight.copy_(a)
                layer.lora_B["default"].weight.copy_(b_part)

    def log_probs():
        return _log_probs(model(ids, attention_mask=attn.long()).logits, ids, attn)

    with torch.no_grad(), model.disable_adapter():
        base = log_probs()
    lp = log_probs()
    loss = -(lp * resp).sum() / resp.sum()  # SFT: token-mean NLL of the response tokens
    loss.backward()
    grads = {}
    for m in _adapted_maps(spec):
        layers = [lora_of(n) for n in m.hf]
        grads[adapters.factor_name(m.mcore, "lora_A")] = sum(x.lora_A["default"].weight.grad for x in layers)
        grads[adapters.factor_name(m.mcore, "lora_B")] = mapping.pack_rows(
            m, spec, [x.lora_B["default"].weight.grad for x in layers])
    return lp.detach(), base, loss.item(), grads


def _merged_reference(hf_dir, a_factors, critic=False):
    """The same outputs without peft: transformers' forward on ``W + scale * B A`` for every adapted weight (MoE
    experts sliced into transformers 5's fused ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``), the factors
    leaves of autograd (megarl's fused layout: qkv's and fc1's A shared by their projections by construction)."""
    from torch.func import functional_call
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from megarl.models import adapters, mapping
    from megarl.models.spec import load_hf_config, spec_from_hf_config

    cfg = load_hf_config(hf_dir)
    spec = spec_from_hf_config(cfg)
    ids, attn, resp, adv = _rows()
    model = (AutoModelForSequenceClassification if critic else AutoModelForCausalLM).from_pretrained(
        hf_dir, dtype=torch.float32)
    params = {n: p.detach() for n, p in model.named_parameters()}
    leaves, deltas = {}, {}
    if critic:  # the value head trains whole
        params["score.weight"] = leaves["output_layer.weight"] = params["score.weight"].clone().requires_grad_(True)
    for m in _adapted_maps(spec):
        a = torch.as_tensor(a_factors[m.mcore]).clone().requires_grad_(True)
        b = _b(m.mcore, (mapping.mcore_shape(m, spec, 0)[0], RANK)).requires_grad_(True)
        leaves[adapters.factor_name(m.mcore, "lora_A")], leaves[adapters.factor_name(m.mcore, "lora_B")] = a, b
        for hf_name, d in zip(m.hf, mapping.unpack_rows(m, spec, (ALPHA / RANK) * b @ a), strict=True):
            deltas[hf_name] = d

    def merged():
        out = dict(params)
        for name, w in params.items():
            if name + ".weight" in deltas or name in deltas:
                out[name] = w + deltas[name]
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, ...], per expert
                prefix, kind = name.rsplit(".", 1)
                parts = []
                for e in range(w.shape[0]):
                    names = ((f"{prefix}.{e}.down_proj.weight",) if kind == "down_proj"
                             else (f"{prefix}.{e}.gate_proj.weight", f"{prefix}.{e}.up_proj.weight"))
                    parts.append(torch.cat([deltas[n] for n in names]))
                out[name] = w + torch.stack(parts)
        return out

    logits = functional_call(model, merged(), (ids,), {"attention_mask": attn.long()}).logits
    if critic:  # Bradley-Terry on pairs (chosen, rejected) of the rows' scores at their last real token
        scores = logits.squeeze(-1)
        loss = -torch.nn.functional.logsigmoid(scores[0::2] - scores[1::2]).mean()
        loss.backward()
        return scores.detach(), None, loss.item(), {n: t.grad for n, t in leaves.items()}
    with torch.no_grad():
        base = _log_probs(model(ids, attention_mask=attn.long()).logits, ids, attn)
    lp = _log_probs(logits, ids, attn)
    loss = -(lp * resp).sum() / resp.sum()
    loss.backward()
    return lp.detach(), base, loss.item(), {n: t.grad for n, t in leaves.items()}


def _set_b(params, spec, layout, coords):
    """Every ``lora_B`` of this rank set to the test's matrix (:func:`_b`), sliced as the rank holds it."""
    from megarl.models import adapters, mapping

    maps = {m.mcore: m for m in mapping.tensor_maps(spec)}
    with torch.no_grad():
        for n, p in params.items():
            if n.endswith(".lora_B"):
                m = maps[adapters.base_name(n)]
                full = _b(m.mcore, adapters.factor_shape(m, spec, "lora_B", RANK))
                p.copy_(mapping.tp_shard(m, full, layout.tp, coords.tp) if adapters.split_factor(m, "lora_B")
                        else full)


def _critic(rank, world_size, rm_ckpt):
    """A LoRA reward model (the scalar head trains whole) at TP2 x DP2 with sequence parallelism: one
    Bradley-Terry step; the factors' and the head's gradients, the trained parameters."""
    from megarl.algos.offline import BradleyTerryObjective
    from megarl.controller.role import WorkerContext
    from megarl.data.batch import Batch
    from megarl.engine.config import EngineConfig, LoRAConfig, MicroBatchConfig, OptimConfig, OptimizerName
    from megarl.models import adapters
    from megarl.models.provider import global_named_parameters
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.critic import CriticRole

    ids, attn, _, _ = _rows()
    layout = ParallelLayout.for_world(world_size, tp=2)
    init_distributed(layout)
    coords = layout.coords(rank)
    ctx = WorkerContext(rank, world_size, layout, coords, "127.0.0.1", "local", 0, "cpu")
    engine = EngineConfig(optim=OptimConfig(optimizer=OptimizerName.SGD, lr=1e-3, clip_grad=0.0,
                                            use_distributed_optimizer=False),
                          micro_batch=MicroBatchConfig(max_tokens=24, max_size=2), sequence_parallel=True,
                          lora=LoRAConfig(rank=RANK, alpha=ALPHA))
    critic = CriticRole(ctx, checkpoint_dir=rm_ckpt, engine=engine, value_clip=None)
    params = {n: p for c in critic.engine.chunks for n, p in global_named_parameters(c)}
    _set_b(params, critic.engine.spec, layout, coords)
    a0 = {n: p.detach().tolist() for n, p in params.items() if n.endswith(".lora_A")}  # before the step moves it
    rows = Batch.from_dict({"input_ids": ids, "attention_mask": attn, "response_mask": attn})
    result = critic.train(rows.chunk(layout.dp)[coords.dp], BradleyTerryObjective())
    trained = sorted(n for n, p in params.items() if p.requires_grad)
    return {"tp": coords.tp, "loss": result.loss, "trained": trained, "a0": a0,
            "grads": {n: p.main_grad.tolist() for n, p in params.items() if p.requires_grad},
            "adapters_only": all(adapters.is_adapter(n) or n == "output_layer.weight" for n in trained)}


def _world(rank, world_size, ckpt, moe_ckpt, rm_ckpt):
    from megarl.algos.config import AlgorithmConfig
    from megarl.algos.offline import SFTObjective
    from megarl.controller.role import WorkerContext
    from megarl.data.batch import Batch
    from megarl.engine.config import EngineConfig, LoRAConfig, MicroBatchConfig, OptimConfig, OptimizerName
    from megarl.models import adapters
    from megarl.models.provider import global_named_parameters
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.policy import PolicyRole
    from megarl.testing.dist import from_collect_rank

    ids, attn, resp, adv = _rows()
    out = []
    for kw, path in [(kw, ckpt) for kw in LAYOUTS] + [(kw, moe_ckpt) for kw in MOE_LAYOUTS]:
        kw = dict(kw)
        sp = kw.pop("sp", False)
        layout = ParallelLayout.for_world(world_size, **kw)
        init_distributed(layout)
        coords = layout.coords(rank)
        ctx = WorkerContext(rank, world_size, layout, coords, "127.0.0.1", "local", 0, "cpu")
        engine = EngineConfig(optim=OptimConfig(optimizer=OptimizerName.SGD, lr=1e-3, clip_grad=0.0,
                                                use_distributed_optimizer=False),
                              micro_batch=MicroBatchConfig(max_tokens=24, max_size=2), sequence_parallel=sp or None,
                              lora=LoRAConfig(rank=RANK, alpha=ALPHA))
        algorithm = AlgorithmConfig(kl_loss_coef=KL_COEF, kl_clamp=False)
        policy = PolicyRole(ctx, checkpoint_dir=path, engine=engine, algorithm=algorithm, temperature=1.0)
        chunk_params = {n: p for c in policy.engine.chunks for n, p in global_named_parameters(c)}
        _set_b(chunk_params, policy.spec, layout, coords)
        base0 = {n: p.detach().clone() for n, p in chunk_params.items() if not adapters.is_adapter(n)}
        a0 = {n: p.detach().tolist() for n, p in chunk_params.items() if n.endswith(".lora_A")}
        rows = Batch.from_dict({"input_ids": ids, "attention_mask": attn, "response_mask": resp})
        lp = policy.compute_log_probs(rows, temperature=1.0)
        lp = from_collect_rank(None if lp is None else lp["log_probs"].tolist(), layout)
        base_lp = policy.compute_log_probs(rows, temperature=1.0, adapters=False)
        base_lp = from_collect_rank(None if base_lp is None else base_lp["log_probs"].tolist(), layout)
        # GRPO with the KL loss to the base model (the reference of a LoRA run), at the factors set above; then
        # the factors are put back (SGD keeps no state) for the SFT update
        start = {n: p.detach().clone() for n, p in chunk_params.items() if adapters.is_adapter(n)}
        grpo = rows.update(Batch.from_dict({"advantages": adv, "old_log_probs": torch.tensor(lp),
                                            "ref_log_probs": torch.tensor(base_lp)}))
        kl = policy.update(grpo.chunk(layout.dp)[coords.dp]).terms["kl"]
        with torch.no_grad():
            for n, t in start.items():
                chunk_params[n].copy_(t)
        shard = rows.chunk(layout.dp)[coords.dp]
        result = policy.train(shard, SFTObjective())
        grads = {n: p.main_grad.tolist() for n, p in chunk_params.items() if adapters.is_adapter(n)}
        trained = sorted(n for n, p in chunk_params.items() if p.requires_grad)
        optimized = sum(p.numel() for g in policy.engine.optimizer.param_groups for p in g["params"])
        for _ in range(19):
            policy.train(shard, SFTObjective())
        same = all(torch.equal(base0[n], p) for n, p in chunk_params.items() if not adapters.is_adapter(n))
        out.append({"layout": kw | {"sp": sp}, "tp": coords.tp, "lp": lp, "base_lp": base_lp,
                    "loss": result.loss, "kl": kl, "grads": grads, "a0": a0, "trained": trained, "optimized": optimized,
                    "adapter_numel": sum(p.numel() for n, p in chunk_params.items() if adapters.is_adapter(n)),
                    "base_same": same})
        del policy
    return {"policy": out, "critic": _critic(rank, world_size, rm_ckpt)}


@pytest.fixture(scope="module")
def setup(tiny_hf, tmp_path_factory):
    from megarl.models import mapping
    from megarl.models.spec import load_hf_config, spec_from_hf_config

    hf, moe_hf, rm_hf = tiny_hf("qwen2_untied"), tiny_hf("qwen3_moe"), tiny_hf("qwen2_rm")
    root = tmp_path_factory.mktemp("lora")
    convert_hf_to_megatron(hf, root / "lm")
    convert_hf_to_megatron(moe_hf, root / "moe", ep=2)
    convert_hf_to_megatron(rm_hf, root / "rm")
    out = run_world(_world, 4, str(root / "lm"), str(root / "moe"), str(root / "rm"), timeout_s=900)
    world = [r["policy"] for r in out]
    critic = [r["critic"] for r in out]

    def a_factors(results):
        """Every A of the model by its weight's name (EP: each rank holds its experts'; TP: shards gathered)."""
        from megarl.models import adapters

        by_name: dict[str, dict[int, torch.Tensor]] = {}
        for r in results:
            for n, a in r["a0"].items():
                by_name.setdefault(adapters.base_name(n), {})[r.get("tp", 0)] = torch.tensor(a)
        out = {}
        for name, shards in by_name.items():
            out[name] = (mapping.tp_gather(maps[name], [shards[t] for t in sorted(shards)]) if len(shards) > 1
                         and adapters.split_factor(maps[name], "lora_A") else next(iter(shards.values())))
        return out

    maps = {m.mcore: m for path in (hf, moe_hf, rm_hf)
            for m in mapping.tensor_maps(spec_from_hf_config(load_hf_config(path)))}  # shared names, same kinds
    dense, moe = a_factors([r[0] for r in world]), a_factors([r[len(LAYOUTS)] for r in world])
    return {"dense": (hf, world, _peft_reference(hf, dense), _merged_reference(hf, dense)),
            "moe": (moe_hf, world, _merged_reference(moe_hf, moe)),
            "critic": (rm_hf, critic, _merged_reference(rm_hf, a_factors(critic), critic=True))}


def _rel(got, expected):
    got, expected = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    return ((got - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def _check(hf, results, reference):
    """One layout's results against a reference (log-probs, base log-probs, loss, factor gradients)."""
    from megarl.models import adapters, mapping
    from megarl.models.spec import load_hf_config, spec_from_hf_config

    lp, base_lp, loss, grads = reference
    _, _, resp, _ = _rows()
    spec = spec_from_hf_config(load_hf_config(hf))
    maps = {m.mcore: m for m in mapping.tensor_maps(spec)}
    r0 = results[0]
    assert _rel(r0["lp"], lp) < 1e-5
    assert _rel(r0["base_lp"], base_lp) < 1e-5
    assert _rel(r0["base_lp"], lp) > 1e-3  # the adapters do change the model
    assert abs(r0["loss"] - loss) <= 1e-5 * abs(loss)
    kl = _k3(lp, base_lp, resp)
    assert kl > 1e-3 and all(abs(r["kl"] - kl) <= 1e-5 * kl for r in results), (kl, [r["kl"] for r in results])
    _check_grads(maps, results, grads)
    for r in results:
        assert r["base_same"], "a base weight changed in 20 updates"
        assert r["trained"] and all(adapters.is_adapter(n) for n in r["trained"])
        assert r["optimized"] == r["adapter_numel"]


def _check_grads(maps, results, grads):
    """Each rank's gradients (TP shards gathered, every DP replica's alike) against the reference's, 1e-5."""
    from megarl.models import adapters, mapping

    shards: dict[str, dict[int, torch.Tensor]] = {}
    for r in results:
        for n, g in r["grads"].items():
            shards.setdefault(n, {})[r["tp"]] = torch.tensor(g)
    assert set(shards) == set(grads)
    for n, by_tp in shards.items():
        split = adapters.is_adapter(n) and adapters.split_factor(maps[adapters.base_name(n)], n.rsplit(".", 1)[-1])
        full = (mapping.tp_gather(maps[adapters.base_name(n)], [by_tp[t] for t in sorted(by_tp)]) if split
                else next(iter(by_tp.values())))
        assert _rel(full, grads[n]) < 1e-5, (n, _rel(full, grads[n]))
        assert float(grads[n].norm()) > 0, n


def test_lora_reward_model_trains_adapters_and_head_at_tp2_sp(setup):
    """A LoRA critic / reward model: the adapters and the whole value head train (peft's modules_to_save keeps a
    sequence classifier's score), gradients equal transformers' on merged weights, Bradley-Terry loss alike."""
    from megarl.models import mapping
    from megarl.models.spec import load_hf_config, spec_from_hf_config

    hf, results, (_, _, loss, grads) = setup["critic"]
    spec = spec_from_hf_config(load_hf_config(hf))  # a sequence classifier: the scalar head
    maps = {m.mcore: m for m in mapping.tensor_maps(spec)}
    assert all(abs(r["loss"] - loss) <= 1e-5 * abs(loss) for r in results), ([r["loss"] for r in results], loss)
    assert all(r["adapters_only"] and "output_layer.weight" in r["trained"] for r in results)
    _check_grads(maps, results, grads)


def test_merged_reference_equals_peft(setup):
    """The reference of the MoE layouts (transformers on merged weights) equals peft where peft applies."""
    _, _, peft, merged = setup["dense"]
    for got, expected in zip(merged[:3], peft[:3], strict=True):
        assert _rel(got, expected) < 1e-6
    assert all(_rel(merged[3][n], peft[3][n]) < 1e-5 for n in peft[3])


@pytest.mark.parametrize("layout", range(len(LAYOUTS)), ids=["tp1", "tp2", "tp2_sp", "pp2"])
def test_logits_and_gradients_equal_peft(setup, layout):
    hf, world, peft, _ = setup["dense"]
    _check(hf, [r[layout] for r in world], peft)


@pytest.mark.parametrize("layout", range(len(MOE_LAYOUTS)), ids=["ep2", "tp2_ep2_sp"])
def test_moe_experts_logits_and_gradients_equal_transformers(setup, layout):
    hf, world, reference = setup["moe"]
    _check(hf, [r[len(LAYOUTS) + layout] for r in world], reference)
