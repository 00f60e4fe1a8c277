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
- after 20 updates every base weight is bit-identical to the checkpoint's, and the optimizer holds the adapters
  only.
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
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _rows():
    g = torch.Generator().manual_seed(5)
    lengths = [9, 6, 12, 7, 5, 10, 11, 8]
    ids = torch.zeros(8, 12, dtype=torch.long)
    attn = (torch.arange(12) < torch.tensor(lengths)[:, None]).float()
    ids[attn.bool()] = torch.randint(5, 300, (int(attn.sum()),), generator=g)
    resp = attn.clone()
    resp[:, :3] = 0
    return ids, attn, resp


def _b(name: str, shape) -> torch.Tensor:
    """The test's ``lora_B`` of the adapted weight ``name`` (global Megatron name), drawn whole from the name."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(*shape, generator=gen) * 0.05


def _adapted_maps(spec):
    from megarl.models import mapping

    return [m for m in mapping.tensor_maps(spec)
            if m.mcore.endswith(("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight"))]


def _peft_reference(hf_dir, a_factors):
    """peft's log-probs, base log-probs and factor gradients (mapped to megarl's global fused layout)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from megarl.models import mapping
    from megarl.models.spec import load_hf_config, spec_from_hf_config

    spec = spec_from_hf_config(load_hf_config(hf_dir))
    ids, attn, resp = _rows()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=PEFT_TARGETS, lora_dropout=0.0))
    modules = dict(model.named_modules())

    def lora_of(hf_name):
        return modules["base_model.model." + hf_name.removesuffix(".weight")]

    with torch.no_grad():
        for m in _adapted_maps(spec):
            a = torch.tensor(a_factors[m.mcore])
            b = _b(m.mcore, (mapping.mcore_shape(m, spec, 0)[0], RANK))
            for hf_name, b_part in zip(m.hf, mapping.unpack_rows(m, spec, b), strict=True):
                layer = lora_of(hf_name)
                layer.lora_A["default"].weight.copy_(a)
                layer.lora_B["default"].weight.copy_(b_part)

    def log_probs():
        logits = model(ids, attention_mask=attn.long()).logits.float()
        lp = torch.zeros_like(attn)
        lp[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return lp * attn

    with torch.no_grad(), model.disable_adapter():
        base = log_probs()
    lp = log_probs()
    loss = -(lp * resp).sum() / resp.sum()  # SFT: token-mean NLL of the response tokens
    loss.backward()
    grads = {}
    for m in _adapted_maps(spec):
        layers = [lora_of(n) for n in m.hf]
        grads[m.mcore.removesuffix("weight") + "lora_A"] = sum(x.lora_A["default"].weight.grad for x in layers)
        grads[m.mcore.removesuffix("weight") + "lora_B"] = mapping.pack_rows(
            m, spec, [x.lora_B["default"].weight.grad for x in layers])
    return lp.detach(), base, loss.item(), grads


def _world(rank, world_size, ckpt):
    from megarl.algos.config import AlgorithmConfig
    from megarl.algos.offline import SFTObjective
    from megarl.controller.role import WorkerContext
    from megarl.data.batch import Batch
    from megarl.engine.config import EngineConfig, LoRAConfig, MicroBatchConfig, OptimConfig, OptimizerName
    from megarl.models import adapters, mapping
    from megarl.models.provider import global_named_parameters
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.policy import PolicyRole
    from megarl.testing.dist import from_collect_rank

    ids, attn, resp = _rows()
    out = []
    for kw in LAYOUTS:
        kw = dict(kw)
        sp = kw.pop("sp", False)
        layout = ParallelLayout.for_world(world_size, **kw)
        init_distributed(layout)
        coords = layout.coords(rank)
        ctx = WorkerContext(rank, world_size, layout, coords, "127.0.0.1", "local", 0, "cpu")
        engine = EngineConfig(optim=OptimConfig(optimizer=OptimizerName.SGD, lr=1e-3, clip_grad=0.0,
                                                use_distributed_optimizer=False),
                              micro_batch=MicroBatchConfig(max_tokens=24, max_size=2), sequence_parallel=sp,
                              lora=LoRAConfig(rank=RANK, alpha=ALPHA))
        policy = PolicyRole(ctx, checkpoint_dir=ckpt, engine=engine, algorithm=AlgorithmConfig(), temperature=1.0)
        spec = policy.spec
        maps = {m.mcore: m for m in mapping.tensor_maps(spec)}
        chunk_params = {n: p for c in policy.engine.chunks for n, p in global_named_parameters(c)}
        with torch.no_grad():
            for n, p in chunk_params.items():
                if n.endswith(".lora_B"):
                    m = maps[adapters.base_name(n)]
                    full = _b(m.mcore, (mapping.mcore_shape(m, spec, 0)[0], RANK))
                    column = m.tp_dim == 0
                    p.copy_(mapping.tp_shard(m, full, layout.tp, coords.tp) if column else full)
        base0 = {n: p.detach().clone() for n, p in chunk_params.items() if not adapters.is_adapter(n)}
        a0 = {n: p.detach().tolist() for n, p in chunk_params.items() if n.endswith(".lora_A")}
        rows = Batch.from_dict({"input_ids": ids, "attention_mask": attn, "response_mask": resp})
        lp = policy.compute_log_probs(rows, temperature=1.0)
        lp = from_collect_rank(None if lp is None else lp["log_probs"].tolist(), layout)
        base_lp = policy.compute_log_probs(rows, temperature=1.0, adapters=False)
        base_lp = from_collect_rank(None if base_lp is None else base_lp["log_probs"].tolist(), layout)
        shard = rows.chunk(layout.dp)[coords.dp]
        result = policy.train(shard, SFTObjective())
        grads = {n: p.main_grad.tolist() for n, p in chunk_params.items() if adapters.is_adapter(n)}
        trained = sorted(n for n, p in chunk_params.items() if p.requires_grad)
        optimized = sum(p.numel() for g in policy.engine.optimizer.param_groups for p in g["params"])
        for _ in range(19):
            policy.train(shard, SFTObjective())
        same = all(torch.equal(base0[n], p) for n, p in chunk_params.items() if not adapters.is_adapter(n))
        out.append({"layout": kw | {"sp": sp}, "tp": coords.tp, "lp": lp, "base_lp": base_lp,
                    "loss": result.loss, "grads": grads, "a0": a0, "trained": trained, "optimized": optimized,
                    "adapter_numel": sum(p.numel() for n, p in chunk_params.items() if adapters.is_adapter(n)),
                    "base_same": same})
        del policy
    return out


@pytest.fixture(scope="module")
def setup(tiny_hf, tmp_path_factory):
    hf = tiny_hf("qwen2_untied")
    root = tmp_path_factory.mktemp("lora")
    convert_hf_to_megatron(hf, root / "lm")
    world = run_world(_world, 4, str(root / "lm"), timeout_s=900)
    a_factors = {}  # global A of each adapted weight, from TP rank 0 / 1 of the TP1 layout (A is layout-independent)
    for name, a in world[0][0]["a0"].items():
        a_factors[name.removesuffix("lora_A") + "weight"] = a
    return hf, world, _peft_reference(hf, a_factors)


def _rel(got, expected):
    got, expected = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    return ((got - expected).norm() / expected.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("layout", range(len(LAYOUTS)), ids=["tp1", "tp2", "tp2_sp", "pp2"])
def test_logits_and_gradients_equal_peft(setup, layout):
    from megarl.models import adapters, mapping
    from megarl.models.spec import load_hf_config, spec_from_hf_config

    hf, world, (lp, base_lp, loss, grads) = setup
    spec = spec_from_hf_config(load_hf_config(hf))
    maps = {m.mcore: m for m in mapping.tensor_maps(spec)}
    results = [r[layout] for r in world]
    r0 = results[0]
    assert _rel(r0["lp"], lp) < 1e-5
    assert _rel(r0["base_lp"], base_lp) < 1e-5
    assert _rel(r0["base_lp"], lp) > 1e-3  # the adapters do change the model
    assert abs(r0["loss"] - loss) <= 1e-5 * abs(loss)
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for r in results:
        for n, g in r["grads"].items():
            shards.setdefault(n, {})[r["tp"]] = torch.tensor(g)
    assert set(shards) == set(grads)
    for n, by_tp in shards.items():
        m = maps[adapters.base_name(n)]
        split = (m.tp_dim == 0) == n.endswith("lora_B")  # B of a column-parallel base, A of a row-parallel one
        full = mapping.tp_gather(m, [by_tp[t] for t in sorted(by_tp)]) if split else by_tp[0]
        assert _rel(full, grads[n]) < 1e-5, (n, _rel(full, grads[n]))
    for r in results:
        assert r["base_same"], "a base weight changed in 20 updates"
        assert r["trained"] and all(adapters.is_adapter(n) for n in r["trained"])
        assert r["optimized"] == r["adapter_numel"]

