"""Qwen3-MoE models at expert parallelism, on a real 4-process gloo world.

One spawned world runs every layout (process start-up dominates on 2 cores): for each it builds the
model, loads the checkpoint converted from HF, checks that every rank holds exactly its experts (and
every other tensor's TP shard) as hand-sliced HF tensors, compares the pipeline schedule's logits with
`transformers`, and saves the model from that layout; the test process converts each save back to HF
and compares every tensor with the original, bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from megarl.checkpoint.convert import convert_hf_to_megatron, convert_megatron_to_hf
from megarl.checkpoint.format import HF_SUBDIR, read_meta, write_meta
from megarl.testing.dist import run_world

pytestmark = pytest.mark.dist

WORLD = 4
SEQ = 12
# (case, model, loaded at (tp, pp, ep)); every layout the acceptance names, plus TP2xPP2xEP2
CASES = [
    ("ep1", "qwen3_moe", (1, 1, 1)),
    ("ep2", "qwen3_moe", (1, 1, 2)),
    ("tp2ep2", "qwen3_moe", (2, 1, 2)),
    ("pp2ep2", "qwen3_moe", (1, 2, 2)),
    ("tp2pp2ep2", "qwen3_moe", (2, 2, 2)),
    ("ep4_softmax_topk", "qwen3_moe_topk_unnormalised", (1, 1, 4)),
]


def _hand_sliced(hf: dict, name: str, tp: int, tp_rank: int, padded_vocab: int, cfg: dict):
    """The tensor a rank must hold under a global Megatron name, sliced from HF's per-expert tensors by hand."""
    parts = name.split(".")
    if name.startswith("decoder.layers.") and parts[3:6] == ["mlp", "experts", "local_experts"]:
        p, e = f"model.layers.{parts[2]}.mlp.experts.{parts[6]}.", parts[7]
        if e == "linear_fc1":  # experts are whole on their rank (expert TP 1): [gate; up]
            return torch.cat([hf[p + "gate_proj.weight"], hf[p + "up_proj.weight"]])
        return hf[p + "down_proj.weight"]
    if name.startswith("decoder.layers.") and parts[3:5] == ["mlp", "router"]:
        return hf[f"model.layers.{parts[2]}.mlp.gate.weight"]
    if name.startswith("decoder.layers."):
        p, suffix = f"model.layers.{parts[2]}.", ".".join(parts[3:])
        d, g = cfg["head_dim"], cfg["num_key_value_heads"]
        r = cfg["num_attention_heads"] // g
        if suffix == "self_attention.linear_qkv.weight":
            q, k, v = (hf[f"{p}self_attn.{x}_proj.weight"] for x in "qkv")
            blocks = []
            for group in range(g):
                blocks += [q[(group * r + i) * d:(group * r + i + 1) * d] for i in range(r)]
                blocks += [k[group * d:(group + 1) * d], v[group * d:(group + 1) * d]]
            per_rank = len(blocks) // tp
            return torch.cat(blocks[tp_rank * per_rank:(tp_rank + 1) * per_rank])
        simple = {
            "input_layernorm.weight": ("input_layernorm.weight", None),
            "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", None),
            "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight", None),
            "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight", None),
            "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", 1),
        }
        hf_name, dim = simple[suffix]
        return hf[p + hf_name] if dim is None else hf[p + hf_name].chunk(tp, dim=dim)[tp_rank]
    if name == "decoder.final_layernorm.weight":
        return hf["model.norm.weight"]
    t = hf["model.embed_tokens.weight" if name.startswith("embedding") else "lm_head.weight"]
    padded = torch.zeros(padded_vocab, t.shape[1], dtype=t.dtype)
    padded[: t.shape[0]] = t
    return padded.chunk(tp, dim=0)[tp_rank]


def _world(rank, world_size, cases, out_root):
    from safetensors.torch import load_file

    from megarl.checkpoint import mcore_io
    from megarl.checkpoint.format import WEIGHTS_SUBDIR, read_meta
    from megarl.models.forward import forward_logits
    from megarl.models.provider import BuildOptions, build_model, global_named_parameters, padded_vocab_size
    from megarl.models.spec import spec_from_hf_config
    from megarl.parallel.init import destroy_distributed, init_distributed
    from megarl.parallel.layout import ParallelLayout

    results = {}
    for case, ckpt, hf_dir, (tp, pp, ep), ids in cases:
        layout = ParallelLayout.for_world(world_size, tp=tp, pp=pp, ep=ep)
        init_distributed(layout)
        meta = read_meta(ckpt)
        spec = spec_from_hf_config(meta.hf_config)
        opts = BuildOptions(init_weights=False)
        chunks = build_model(spec, layout, opts)
        mcore_io.load_model(chunks, ckpt)
        hf = load_file(str(Path(hf_dir) / "model.safetensors"))
        cfg = json.loads((Path(hf_dir) / "config.json").read_text())
        # by hand, megatron-core's expert rank order: within a pipeline stage (tp*dp ranks), ep innermost
        tp_rank, stage_rank = rank % tp, rank % (world_size // pp)
        ep_rank, per_rank = stage_rank % ep, spec.moe.num_experts // ep
        params = {n: p for chunk in chunks for n, p in global_named_parameters(chunk)}
        experts = sorted({int(n.split(".")[6]) for n in params if ".local_experts." in n})
        diffs = {n: (p.detach() - _hand_sliced(hf, n, tp, tp_rank, padded_vocab_size(spec, layout, opts), cfg))
                 .abs().max().item() for n, p in params.items()}
        logits = forward_logits(chunks, torch.tensor(ids), spec.vocab_size, micro_batch_size=1)
        save_dir = Path(out_root) / case
        mcore_io.save_model(chunks, save_dir / WEIGHTS_SUBDIR)
        results[case] = {
            "experts": experts,
            "expected_experts": list(range(ep_rank * per_rank, (ep_rank + 1) * per_rank)),
            "param_max_abs_diff": max(diffs.values()),
            "worst_param": max(diffs, key=diffs.get),
            "logits": logits.tolist() if logits is not None else None,
            "padded_vocab": padded_vocab_size(spec, layout, opts),
        }
        del chunks
    destroy_distributed()
    return results


@pytest.fixture(scope="module")
def moe_world(tiny_hf, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("moe")
    ids = torch.randint(0, 300, (2, SEQ), generator=torch.Generator().manual_seed(11))
    cases, refs, ckpts = [], {}, {}
    for case, model, load in CASES:
        if model not in ckpts:
            ckpts[model] = root / f"{model}_mcore"
            convert_hf_to_megatron(tiny_hf(model), ckpts[model], ep=2)
        cases.append((case, str(ckpts[model]), str(tiny_hf(model)), load, ids.tolist()))
        with torch.no_grad():
            refs[case] = AutoModelForCausalLM.from_pretrained(tiny_hf(model)).eval()(ids).logits
    saves = root / "saved"
    per_rank = run_world(_world, WORLD, cases, str(saves), timeout_s=900)
    for case, model, _ in CASES:  # a saved layout is a checkpoint: the source's HF files, its own vocab padding
        shutil.copytree(ckpts[model] / HF_SUBDIR, saves / case / HF_SUBDIR)
        meta = read_meta(ckpts[model])
        write_meta(saves / case, dataclasses.replace(meta, padded_vocab_size=per_rank[0][case]["padded_vocab"]))
    return per_rank, refs, saves


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_every_rank_holds_its_experts_and_shards(moe_world, case):
    per_rank, _, _ = moe_world
    for rank, r in enumerate(per_rank):
        assert r[case]["experts"] == r[case]["expected_experts"], f"{case} rank {rank}"
        assert r[case]["param_max_abs_diff"] == 0.0, f"{case} rank {rank}: {r[case]['worst_param']}"


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_logits_match_transformers(moe_world, case):
    per_rank, refs, _ = moe_world
    reported = [r[case]["logits"] for r in per_rank if r[case]["logits"] is not None]
    pp = next(c[2][1] for c in CASES if c[0] == case)
    assert len(reported) == WORLD // pp
    for logits in reported:
        diff = (torch.tensor(logits) - refs[case]).abs().max().item()
        assert diff < 1e-4, f"{case}: max |logits - HF| = {diff:.2e}"


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_round_trip_from_each_layout_is_bit_exact(moe_world, tiny_hf, tmp_path, case):
    """HF -> Megatron -> loaded and saved at (TP, PP, EP) -> HF: every tensor equal to the original."""
    from safetensors.torch import load_file

    _, _, saves = moe_world
    model = next(c[1] for c in CASES if c[0] == case)
    convert_megatron_to_hf(saves / case, tmp_path / "hf")
    original = load_file(str(tiny_hf(model) / "model.safetensors"))
    back = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        back.update(load_file(str(f)))
    assert sorted(back) == sorted(original)
    for name, t in original.items():
        assert torch.equal(back[name], t), name
