"""HF <-> Megatron tensor rules against hand-built layouts (written independently of mapping.py)."""

import pytest
import torch

from megarl.models import mapping
from megarl.models.mapping import Kind
from megarl.models.spec import spec_from_hf_config
from megarl.testing.tiny import tiny_config


def _spec(family="llama", **kw):
    return spec_from_hf_config(tiny_config(family, **kw).to_dict())


def _map(spec, suffix, layer=0):
    return next(m for m in mapping.tensor_maps(spec) if m.mcore == f"decoder.layers.{layer}.{suffix}")


def test_qkv_interleaving_hand_worked():
    # 4 query heads, 2 kv groups (r=2), head_dim 16; label every row by (tensor, head)
    spec = _spec(hidden_size=64, num_heads=4, num_kv_heads=2)
    d, h = spec.head_dim, spec.hidden_size
    q = torch.arange(4).repeat_interleave(d).float()[:, None].expand(4 * d, h) + 100
    k = torch.arange(2).repeat_interleave(d).float()[:, None].expand(2 * d, h) + 200
    v = torch.arange(2).repeat_interleave(d).float()[:, None].expand(2 * d, h) + 300
    m = _map(spec, "self_attention.linear_qkv.weight")
    out = mapping.to_mcore(m, spec, [q, k, v], padded_vocab=384)
    heads = out[::d, 0].tolist()  # one label per head block
    assert heads == [100, 101, 200, 300, 102, 103, 201, 301]  # [q0 q1 k0 v0 | q2 q3 k1 v1]
    back = mapping.to_hf(m, spec, out)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v), strict=True))


def test_gate_up_and_tp_sharding_hand_worked():
    spec = _spec(intermediate_size=96)
    m = _map(spec, "mlp.linear_fc1.weight")
    gate = torch.full((96, 64), 1.0)
    gate[48:] = 2.0
    up = torch.full((96, 64), 3.0)
    up[48:] = 4.0
    full = mapping.to_mcore(m, spec, [gate, up], padded_vocab=384)
    assert torch.equal(full, torch.cat([gate, up]))
    shard1 = mapping.tp_shard(m, full, tp=2, rank=1)  # [gate_1; up_1]
    assert shard1[:48].unique().tolist() == [2.0] and shard1[48:].unique().tolist() == [4.0]
    assert torch.equal(mapping.tp_gather(m, [mapping.tp_shard(m, full, 2, r) for r in range(2)]), full)


@pytest.mark.parametrize("suffix, dim", [("self_attention.linear_proj.weight", 1), ("mlp.linear_fc2.weight", 1),
                                         ("self_attention.linear_qkv.weight", 0), ("input_layernorm.weight", None)])
def test_tp_shard_gather_roundtrip(suffix, dim):
    spec = _spec()
    m = _map(spec, suffix)
    assert m.tp_dim == dim
    full = torch.randn(mapping.mcore_shape(m, spec, 384))
    shards = [mapping.tp_shard(m, full, 2, r) for r in range(2)]
    if dim is not None:
        assert shards[0].shape[dim] == full.shape[dim] // 2
    assert torch.equal(mapping.tp_gather(m, shards), full)


def test_vocab_padding_and_trim():
    spec = _spec(vocab_size=300)
    m = mapping.tensor_maps(spec)[0]
    assert m.kind is Kind.VOCAB
    emb = torch.randn(300, 64)
    padded = mapping.to_mcore(m, spec, [emb], padded_vocab=spec.padded_vocab_size(2))
    assert padded.shape == (512, 64) and padded[300:].abs().sum() == 0
    (back,) = mapping.to_hf(m, spec, padded)
    assert torch.equal(back, emb)


def test_maps_cover_exactly_the_hf_state_dict():
    from transformers import AutoModelForCausalLM

    for family, tied in [("llama", False), ("qwen2", True), ("qwen3", False), ("qwen3_moe", False)]:
        cfg = tiny_config(family, tied=tied)
        spec = spec_from_hf_config(cfg.to_dict())
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        hf_shapes = _checkpoint_shapes({n: tuple(p.shape) for n, p in model.named_parameters()})
        maps = mapping.tensor_maps(spec)
        ours = {n: s for m in maps for n, s in zip(m.hf, mapping.hf_shapes(m, spec), strict=True)}
        assert ours == hf_shapes


def _checkpoint_shapes(shapes: dict) -> dict:
    """transformers 5 fuses an MoE layer's experts in memory (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``);
    its checkpoints (and hub files) hold one tensor per expert and projection: split the shapes by hand."""
    out = {}
    for name, shape in shapes.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            e, two_i, h = shape
            for i in range(e):
                for proj in ("gate", "up"):
                    out[name.replace("gate_up_proj", f"{i}.{proj}_proj.weight")] = (two_i // 2, h)
        elif name.endswith("mlp.experts.down_proj"):
            for i in range(shape[0]):
                out[name.replace("down_proj", f"{i}.down_proj.weight")] = shape[1:]
        else:
            out[name] = shape
    return out


def test_names_te_and_checkpoint_keys():
    name = "decoder.layers.7.input_layernorm.weight"
    assert mapping.te_name(name) == "decoder.layers.7.self_attention.linear_qkv.layer_norm_weight"
    assert mapping.local_name(mapping.te_name(name)) == name
    assert mapping.checkpoint_key(name) == "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    assert mapping.checkpoint_key("output_layer.weight") == "output_layer.weight"
    assert mapping.with_layer("decoder.layers.1.mlp.linear_fc2.weight", 5) == "decoder.layers.5.mlp.linear_fc2.weight"


def test_shape_mismatch_is_a_clear_error():
    from megarl.errors import CheckpointError

    spec = _spec()
    m = _map(spec, "mlp.linear_fc2.weight")
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.down_proj.weight has shape \[64, 95\], expected"):
        mapping.to_mcore(m, spec, [torch.zeros(64, 95)], padded_vocab=384)


def test_moe_names_checkpoint_keys_and_expert_shapes():
    spec = _spec("qwen3_moe", num_experts=4, moe_intermediate_size=24)
    maps = {m.mcore: m for m in mapping.tensor_maps(spec)}
    fc1 = maps["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert fc1.hf == ("model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight")
    assert (fc1.kind, fc1.tp_dim, fc1.layer, fc1.expert) == (Kind.GATE_UP, None, 1, 3)
    assert (fc1.ckpt_key, fc1.ckpt_index) == ("decoder.layers.mlp.experts.experts.linear_fc1.weight", (1, 3))
    assert mapping.mcore_shape(fc1, spec, 0) == (48, 64)
    fc2 = maps["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"]
    assert mapping.hf_shapes(fc2, spec) == ((64, 24),)
    router = maps["decoder.layers.0.mlp.router.weight"]
    assert router.hf == ("model.layers.0.mlp.gate.weight",) and mapping.hf_shapes(router, spec) == ((4, 64),)
    # an MoE layer's pre-MLP norm keeps its own checkpoint key (TE's MoE layer does not fuse it into fc1)
    assert maps["decoder.layers.0.pre_mlp_layernorm.weight"].ckpt_key == "decoder.layers.pre_mlp_layernorm.weight"
    assert not any(n.endswith("mlp.linear_fc1.weight") and ".experts." not in n for n in maps)
    assert mapping.with_expert(fc1.mcore, 0) == "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"


def test_an_adapter_in_peft_layout_for_adapter_sync():
    """What adapter-only sync hands vLLM: every factor of every adapted weight under peft's names, B split into q, k
    and v rows and A repeated on each projection, back to the fused factors exactly; a missing or misshapen factor is
    named. (That vLLM generates with it as the training model does: tests/distributed/test_vllm_lora.py.)"""
    from megarl.models import adapters

    spec = _spec("qwen2", num_heads=4, num_kv_heads=2)
    shapes = adapters.factor_shapes(spec, ["qkv", "proj"], 4)
    assert len(shapes) == 4 * spec.num_layers
    g = torch.Generator().manual_seed(0)
    factors = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    peft = adapters.peft_adapter(spec, ["qkv", "proj"], factors)
    q, k = spec.num_attention_heads * spec.head_dim, spec.num_query_groups * spec.head_dim
    prefix = "base_model.model.model.layers.0.self_attn."
    assert peft[prefix + "q_proj.lora_B.weight"].shape == (q, 4)
    assert peft[prefix + "k_proj.lora_B.weight"].shape == (k, 4)
    assert torch.equal(peft[prefix + "q_proj.lora_A.weight"], peft[prefix + "v_proj.lora_A.weight"])
    assert len(peft) == 2 * spec.num_layers * (3 + 1)  # A and B of q, k, v and o per layer
    for m in adapters.adapted_maps(spec, ["qkv", "proj"]):
        a, b = _from_peft(m, spec, peft)
        assert torch.equal(a, factors[adapters.factor_name(m.mcore, "lora_A")])
        assert torch.equal(b, factors[adapters.factor_name(m.mcore, "lora_B")])
    name = next(iter(shapes))
    with pytest.raises(ValueError, match="missing"):
        adapters.peft_adapter(spec, ["qkv", "proj"], {n: t for n, t in factors.items() if n != name})
    with pytest.raises(ValueError, match="must have the global shape"):
        adapters.peft_adapter(spec, ["qkv", "proj"], factors | {name: factors[name][:, :-1]})


def _from_peft(m, spec, tensors):
    """The fused (A, B) of one weight back from peft's tensors (the inverse of adapters.to_peft): every projection's
    A must be the one fused A."""
    from megarl.models import adapters, mapping

    modules = [adapters.PEFT_PREFIX + n.removesuffix(".weight") for n in m.hf]
    a_parts = [tensors[f"{mod}.lora_A.weight"] for mod in modules]
    assert all(torch.equal(a_parts[0], a) for a in a_parts[1:])
    return a_parts[0], mapping.pack_rows(m, spec, [tensors[f"{mod}.lora_B.weight"] for mod in modules])
