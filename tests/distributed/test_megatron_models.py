"""Megatron models built from converted checkpoints, on a real 4-process gloo world.

One spawned world runs every case (process start-up dominates on 2 cores): for each checkpoint and
layout it builds the model, loads the dist checkpoint, runs the pipeline schedule forward and
compares logits with `transformers` on the original HF directory; it also checks that every
rank's parameter shards equal the HF tensors sliced by hand for that rank.
"""

from __future__ import annotations

import os

import pytest
import torch

from megarl.checkpoint.convert import convert_hf_to_megatron
from megarl.testing.dist import run_world

pytestmark = pytest.mark.dist

WORLD = 4
SEQ = 12
# (case, model, converted at (tp, pp), loaded at (tp, pp[, vpp]))
CASES = [
    ("llama_tp2pp2", "llama_gqa", (2, 2), (2, 2)),
    ("llama_tp1pp1", "llama_gqa", (2, 2), (1, 1)),
    ("llama_tp2pp1_to_tp1pp2", "llama_gqa", (2, 1), (1, 2)),
    ("llama_tp2pp1_to_tp2pp1", "llama_gqa", (2, 1), (2, 1)),
    ("qwen2_untied_tp2pp2", "qwen2_untied", (2, 2), (2, 2)),
    ("qwen2_tied_tp2pp2", "qwen2_tied", (2, 2), (2, 2)),
    ("qwen2_tied_tp1pp1", "qwen2_tied", (1, 1), (1, 1)),
    ("qwen3_tp2pp2", "qwen3", (2, 2), (2, 2)),
    ("llama_rope_scaling_tp2pp2", "llama_rope_scaling", (1, 1), (2, 2)),
    ("qwen2_untied_tp1pp2vpp2", "qwen2_untied", (2, 2), (1, 2, 2)),
    ("qwen2_tied_tp2pp2vpp2", "qwen2_tied", (1, 1), (2, 2, 2)),
]


def _hand_sliced(spec, hf_dir, name, tp, tp_rank, padded_vocab):
    """The slice of an HF tensor a TP rank must hold, built without megarl's mapping code."""
    from safetensors import safe_open

    def get(n):
        with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as f:
            return f.get_tensor(n)

    layer = name.split(".")[2] if name.startswith("decoder.layers.") else None
    p = f"model.layers.{layer}." if layer is not None else ""
    d, g, r = spec.head_dim, spec.num_query_groups, spec.heads_per_group
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        kind = name.rsplit(".", 1)[1]
        q, k, v = (get(f"{p}self_attn.{x}_proj.{kind}") for x in "qkv")
        blocks = []
        for group in range(g):  # per group: its r query heads, then its key head, then its value head
            blocks += [q[(group * r + i) * d:(group * r + i + 1) * d] for i in range(r)]
            blocks += [k[group * d:(group + 1) * d], v[group * d:(group + 1) * d]]
        per_rank = len(blocks) // tp
        return torch.cat(blocks[tp_rank * per_rank:(tp_rank + 1) * per_rank])
    if name.endswith("linear_fc1.weight"):
        gate, up = get(f"{p}mlp.gate_proj.weight"), get(f"{p}mlp.up_proj.weight")
        n = gate.shape[0] // tp
        return torch.cat([gate[tp_rank * n:(tp_rank + 1) * n], up[tp_rank * n:(tp_rank + 1) * n]])
    simple = {
        "input_layernorm.weight": ("input_layernorm.weight", None),
        "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", None),
        "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight", None),
        "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight", None),
        "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", 1),
        "mlp.linear_fc2.weight": ("mlp.down_proj.weight", 1),
    }
    if layer is not None:
        hf_name, dim = simple[name.split(".", 3)[3]]
        t = get(p + hf_name)
        return t if dim is None else t.chunk(tp, dim=dim)[tp_rank]
    if name == "decoder.final_layernorm.weight":
        return get("model.norm.weight")
    t = get("model.embed_tokens.weight" if name.startswith("embedding") else "lm_head.weight")
    padded = torch.zeros(padded_vocab, t.shape[1], dtype=t.dtype)
    padded[: t.shape[0]] = t
    return padded.chunk(tp, dim=0)[tp_rank]


def _world(rank, world_size, cases):
    from pathlib import Path

    from megarl.checkpoint import mcore_io
    from megarl.checkpoint.format import read_meta
    from megarl.models.forward import forward_logits
    from megarl.models.provider import BuildOptions, build_model, global_named_parameters, padded_vocab_size
    from megarl.models.spec import spec_from_hf_config
    from megarl.parallel.init import destroy_distributed, init_distributed
    from megarl.parallel.layout import ParallelLayout

    results = {}
    for case, ckpt, hf_dir, (tp, pp, *vpp), ids in cases:
        layout = ParallelLayout.for_world(world_size, tp=tp, pp=pp, vpp=vpp[0] if vpp else None)
        init_distributed(layout)
        threads = len(os.listdir("/proc/self/task"))  # OS threads, once megatron-core's groups exist
        spec = spec_from_hf_config(read_meta(ckpt).hf_config)
        opts = BuildOptions(init_weights=False)
        chunks = build_model(spec, layout, opts)
        mcore_io.load_model(chunks, ckpt)
        coords = layout.coords(rank)
        param_diff = max(
            (p.detach() - _hand_sliced(spec, Path(hf_dir), name, tp, coords.tp, padded_vocab_size(spec, layout, opts)))
            .abs().max().item()
            for chunk in chunks for name, p in global_named_parameters(chunk)
        )
        logits = forward_logits(chunks, torch.tensor(ids), spec.vocab_size, micro_batch_size=1)
        results[case] = {
            "coords": list(coords),
            "threads": threads,
            "param_max_abs_diff": param_diff,
            "logits": logits.tolist() if logits is not None else None,
        }
        del chunks  # its modules hold the layout's process groups, which keep their threads until collected
    destroy_distributed()
    return results


@pytest.fixture(scope="module")
def world_results(tiny_hf, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("mcore")
    ids = torch.randint(0, 300, (2, SEQ), generator=torch.Generator().manual_seed(7))
    cases, refs = [], {}
    for case, model, conv, load in CASES:
        ckpt = root / f"{model}_tp{conv[0]}pp{conv[1]}"
        if not ckpt.exists():
            convert_hf_to_megatron(tiny_hf(model), ckpt, tp=conv[0], pp=conv[1])
        cases.append((case, str(ckpt), str(tiny_hf(model)), load, ids.tolist()))
        with torch.no_grad():
            refs[case] = AutoModelForCausalLM.from_pretrained(tiny_hf(model)).eval()(ids).logits
    return run_world(_world, WORLD, cases, timeout_s=900), refs


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_logits_match_transformers(world_results, case):
    per_rank, refs = world_results
    reported = [r[case] for r in per_rank if r[case]["logits"] is not None]
    load_pp = next(c[3][1] for c in CASES if c[0] == case)
    assert len(reported) == WORLD // load_pp  # every rank of the last stage returns logits
    for r in reported:
        diff = (torch.tensor(r["logits"]) - refs[case]).abs().max().item()
        assert diff < 1e-4, f"{case} rank coords {r['coords']}: max |logits - HF| = {diff:.2e}"


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_every_rank_holds_its_hand_sliced_shard(world_results, case):
    per_rank, _ = world_results
    for r in per_rank:
        assert r[case]["param_max_abs_diff"] == 0.0, f"{case} at {r[case]['coords']}"


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux /proc")
def test_reinitialising_megatron_releases_the_previous_groups(world_results):
    """Each gloo group holds three threads (one polling every 10 ms): re-initialising for another layout and back
    must leave the process with as many threads as the first time it held that layout, not one set per init."""
    per_rank, _ = world_results
    loads = [c[3] for c in CASES]
    for rank, result in enumerate(per_rank):
        first = {}
        for case, load in zip((c[0] for c in CASES), loads, strict=True):
            first.setdefault(load, result[case]["threads"])
            assert result[case]["threads"] == first[load], (
                f"rank {rank}, {case}: {result[case]['threads']} threads after initialising layout {load}, "
                f"{first[load]} the first time")


def _first_logits(per_rank, case):
    return next(torch.tensor(r[case]["logits"]) for r in per_rank if r[case]["logits"] is not None)


def test_cross_layout_load_gives_same_logits(world_results):
    """Written at TP2xPP1, loaded at TP1xPP2 and at TP2xPP1: the same model up to fp32 reduction order."""
    per_rank, _ = world_results
    a = _first_logits(per_rank, "llama_tp2pp1_to_tp1pp2")
    b = _first_logits(per_rank, "llama_tp2pp1_to_tp2pp1")
    # TP2 sums the row-parallel partial products in another order than TP1: ~1e-6 relative in fp32
    assert (a - b).abs().max().item() < 1e-4
