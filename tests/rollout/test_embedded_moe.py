"""EmbeddedEngine with a Mixture-of-Experts model (transformers 5 fuses each layer's experts into 3-D parameters):
the per-expert checkpoint tensors that ``save_pretrained`` writes (and the weight sync sends) load into the fused
parameters in place, the engine then equals the source model (logits and greedy tokens of transformers'
``generate``), and a missing expert piece is an incomplete sync."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megarl.rollout import EmbeddedEngine, SamplingParams, WeightUpdateError
from megarl.testing.tiny import randomize_, tiny_config

PAD = 0
E, FE = 4, 32  # experts, expert width (tiny_config's moe_intermediate_size)
PROMPTS = [[5, 17, 42, 9], [77], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2]]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(config, model, on-disk tensors by name) of a random 2-layer Qwen3-MoE written with save_pretrained."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("qwen3_moe", num_heads=4, num_kv_heads=2, num_experts=E, top_k=2, num_layers=2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed=3)
    model.eval()
    out = tmp_path_factory.mktemp("qwen3_moe")
    model.save_pretrained(out)
    return config, model, load_file(str(out / "model.safetensors"))


def _load(engine: EmbeddedEngine, tensors: dict[str, torch.Tensor], skip: str | None = None) -> None:
    items = [(n, t) for n, t in tensors.items() if n != skip]
    for b in range(3):
        engine.update_weights(items[b::3])


def test_disk_names_are_per_expert_and_fill_the_fused_parameters(source):
    config, model, disk = source
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in disk
    assert "model.layers.1.mlp.experts.gate_up_proj" not in disk
    engine = EmbeddedEngine(config, pad_token_id=PAD)
    assert sorted(engine.parameter_names) == sorted(disk)  # a full sync loads exactly the checkpoint's tensors
    fused = engine.model.get_parameter("model.layers.1.mlp.experts.gate_up_proj")
    storage = fused.untyped_storage().data_ptr()
    _load(engine, disk)
    engine.finish_weight_update()
    assert fused.untyped_storage().data_ptr() == storage  # copied into views of the fused parameter, in place
    ref = dict(model.named_parameters())
    for name, param in engine.model.named_parameters():
        assert torch.equal(param, ref[name]), name
    # by hand: expert 2 of layer 0 -> gate rows [:FE], up rows [FE:], down_proj[2]
    experts = engine.model.model.layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj[2, :FE], disk["model.layers.0.mlp.experts.2.gate_proj.weight"])
    assert torch.equal(experts.gate_up_proj[2, FE:], disk["model.layers.0.mlp.experts.2.up_proj.weight"])
    assert torch.equal(experts.down_proj[2], disk["model.layers.0.mlp.experts.2.down_proj.weight"])


def test_logits_and_greedy_tokens_equal_the_source_model(source):
    config, model, disk = source
    engine = EmbeddedEngine(config, pad_token_id=PAD)
    _load(engine, disk)
    engine.finish_weight_update()
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        assert torch.equal(engine.model(ids).logits, model(ids).logits)
    max_new = 10
    model.generation_config.eos_token_id = None
    expected = [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new, pad_token_id=PAD)[0, len(p):]
                .tolist() for p in PROMPTS]
    out = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=max_new))
    assert out.token_lists() == expected


def test_missing_expert_piece_is_an_incomplete_sync(source):
    config, model, disk = source
    engine = EmbeddedEngine(config, pad_token_id=PAD)
    missing = "model.layers.1.mlp.experts.3.up_proj.weight"
    _load(engine, disk, skip=missing)
    with pytest.raises(WeightUpdateError, match=rf"1 of {len(disk)} parameters.*experts\.3\.up_proj"):
        engine.finish_weight_update()
    with pytest.raises(WeightUpdateError, match=r"3\.up_proj\.weight.*expected shape \(32, 64\), found \(64, 32\)"):
        engine.update_weights([(missing, disk[missing].t())])
    with pytest.raises(WeightUpdateError, match=r"'model\.layers\.1\.mlp\.experts\.4\.up_proj\.weight'.*nearest"):
        engine.update_weights([(missing.replace(".3.", ".4."), disk[missing])])  # only experts 0-3 exist
    engine.update_weights([(missing, disk[missing])])
    engine.finish_weight_update()
    with torch.no_grad():
        assert torch.equal(engine.model(torch.tensor([PROMPTS[0]])).logits, model(torch.tensor([PROMPTS[0]])).logits)


def test_fused_names_load_whole(source):
    """transformers' in-memory names (``mlp.experts.gate_up_proj``) still load, and count as all their pieces."""
    config, model, _ = source
    engine = EmbeddedEngine(config, pad_token_id=PAD)
    state = model.state_dict()
    engine.update_weights((n, t) for n, t in state.items() if n != "model.layers.0.mlp.experts.down_proj")
    with pytest.raises(WeightUpdateError, match=rf"{E} of \d+ parameters.*layers\.0\.mlp\.experts\.0\.down_proj"):
        engine.finish_weight_update()
    engine.update_weights([("model.layers.0.mlp.experts.down_proj", state["model.layers.0.mlp.experts.down_proj"])])
    engine.finish_weight_update()


def test_generation_records_every_fed_tokens_experts(source):
    """Each row's routed_experts at every token the engine fed (prompt tokens, then each response token but the
    last) equal the top-k experts transformers' router picks in a plain forward over the row's whole sequence;
    positions never fed hold experts 0..k-1. Sampled (joins and early stops exercise the batch bookkeeping); then a
    second turn continuing every row, whose prompts' leading experts come from the KV the engine kept."""
    config, model, disk = source
    engine = EmbeddedEngine(config, pad_token_id=PAD, max_batch_size=4, prefix_cache_bytes=8 << 20)
    _load(engine, disk)
    engine.finish_weight_update()
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=5, seed=7, stop_token_ids=(11, 12, 13))
    out = engine.generate(PROMPTS, params)
    _check_routing(config, model, [PROMPTS[i] for i in out.prompt_index.tolist()], out)
    nxt = [PROMPTS[i] + row + [20 + i] * (1 + i) for i, row in zip(out.prompt_index.tolist(), out.token_lists(),
                                                                    strict=True)]
    again = engine.generate(nxt, SamplingParams(temperature=1.0, max_new_tokens=5, seed=8, stop_token_ids=(11, 12)))
    assert again.cached_tokens.tolist() == [len(PROMPTS[i]) + n - 1 for i, n in
                                            zip(out.prompt_index.tolist(), out.response_lengths.tolist(), strict=True)]
    _check_routing(config, model, nxt, again)


def _check_routing(config, model, prompts, out) -> None:
    routed = out.routed_experts
    k, layers = config.num_experts_per_tok, config.num_hidden_layers
    assert routed.dtype == torch.int16 and routed.shape[2:] == (layers, k)
    for row, (p, n) in enumerate(zip(prompts, out.response_lengths.tolist(), strict=True)):
        seq = p + out.responses[row, :n].tolist()
        with torch.no_grad():
            logits = model(torch.tensor([seq]), output_router_logits=True).router_logits  # per layer [len, E]
        fed = len(seq) - 1
        for layer in range(layers):
            expected = logits[layer].topk(k, dim=-1).indices.sort(-1).values[:fed]
            assert torch.equal(routed[row, :fed, layer].long().sort(-1).values, expected), (row, layer)
        assert torch.equal(routed[row, fed:].long(), torch.arange(k).expand(routed.shape[1] - fed, layers, k))
