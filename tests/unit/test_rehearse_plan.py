"""A rehearsal's model and layout from a recipe (megarl.bench.rehearse; docs/rehearsal.md), by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.bench import rehearse, rehearse_memory
from megarl.config.train import load_config
from megarl.errors import ConfigError
from megarl.models.spec import spec_from_hf_config
from megarl.planner.presets import PRESETS

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_cut_keeps_every_width_and_cuts_the_per_layer_lists():
    q30 = rehearse.cut_layers(PRESETS["qwen3-30b-a3b"] | {"mlp_only_layers": [0, 3]}, 2)
    assert q30["num_hidden_layers"] == 2 and q30["mlp_only_layers"] == [0] and q30["max_window_layers"] == 2
    full = PRESETS["qwen3-30b-a3b"]
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "num_experts",
                "num_experts_per_tok", "moe_intermediate_size", "rope_theta"):
        assert q30[key] == full[key]
    assert PRESETS["qwen3-30b-a3b"]["num_hidden_layers"] == 48  # the preset itself is not changed
    with pytest.raises(ConfigError, match=r"1\.\.80 layers"):
        rehearse.cut_layers(PRESETS["llama3-70b"], 81)


@pytest.mark.parametrize(("recipe", "preset", "world", "expected"), [
    ("grpo_gsm8k_qwen2.5_7b", "qwen2.5-7b", 2, (2, 1, 1, 2)),  # the recipe's TP2 fits, its vLLM TP2 too
    ("grpo_gsm8k_qwen2.5_7b", "qwen2.5-7b", 4, (2, 1, 1, 2)),  # TP2 again (DP2), not 4: the recipe's
    ("ppo_llama3_70b", "llama3-70b", 4, (4, 1, 1, 4)),  # TP8 capped at the world; 64 heads and 8 KV heads divide
    ("grpo_gsm8k_qwen3_30b_a3b", "qwen3-30b-a3b", 2, (2, 1, 2, 2)),  # TP4, EP8 capped at 2
    ("ppo_gsm8k_qwen2.5_0.5b", "qwen2.5-0.5b", 2, (1, 1, 1, 1)),  # the recipe's TP1
])
def test_layout_derived_from_the_recipe(recipe, preset, world, expected):
    """(tp, pp, ep, the recipe's vLLM TP within the tp); the rehearsal itself runs the embedded engine (TP1)."""
    cfg = load_config(EXAMPLES / recipe / "config.yaml", [])
    spec = spec_from_hf_config(rehearse.cut_layers(PRESETS[preset], 1))
    assert rehearse.derive_layout(cfg, spec, world) == expected


def test_heads_bound_the_tp():
    cfg = load_config(EXAMPLES / "ppo_llama3_70b" / "config.yaml", [])
    spec = spec_from_hf_config(PRESETS["qwen2.5-7b"] | {"num_hidden_layers": 1})  # 28 heads, 4 KV heads
    assert rehearse.derive_layout(cfg, spec, 8)[0] == 4  # 8 divides neither 28 nor 4: the largest that does


def test_load_transient_by_hand():
    """The larger of the largest tensor in full shape and the merged fc1 of every layer (docs/rehearsal.md §3)."""
    q7 = rehearse.Rehearsal("q7", rehearse.cut_layers(PRESETS["qwen2.5-7b"], 1), 2, 2, 1, 1,
                            rehearse.RolloutBackend.EMBEDDED, 1, "float32", False, True, ((5, 6),), 8)
    assert rehearse_memory.load_transient_bytes(q7) == 2 * (152064 // 2) * 3584 * 4  # the vocabulary, full shape
    q05 = rehearse.Rehearsal("q05", PRESETS["qwen2.5-0.5b"], 2, 2, 1, 1, rehearse.RolloutBackend.EMBEDDED, 1,
                             "float32", False, True, ((5, 6),), 8)
    merged = 24 * 2 * (4864 // 2) * 896 * 4  # 24 merged fc1 shards: 418 MB, under the tied vocabulary in full shape
    assert merged < rehearse_memory.load_transient_bytes(q05) == 2 * (152064 // 2) * 896 * 4


def test_a_bfloat16_training_copy_by_hand():
    """The 70B cut to 1 layer at a world of one with a bfloat16 training copy (what lets its sync run on 24 GB):
    every training-side term in 2 bytes, the float32 replica in 4, the sync's transient one 64 MiB bucket."""
    cut = rehearse.cut_layers(PRESETS["llama3-70b"], 1)
    V, H, F, KV = 128256, 8192, 28672, 8 * 128
    n = 2 * V * H + H + (2 * H * H + 2 * H * KV + 3 * H * F + 2 * H)  # untied; 1 layer: q, o, k, v, the MLP, 2 norms
    assert n == 2_957_008_896  # the 2.96 B of benchmarks/results/rehearsal-2026-12-05.md
    r = rehearse.Rehearsal("l70", cut, 1, 1, 1, 1, rehearse.RolloutBackend.EMBEDDED, 1, "float32", False, True,
                           ((5, 6),), 8, train_dtype="bfloat16")
    t = rehearse_memory.memory_terms(r)
    assert (t.params, t.rollout, t.receive) == (2 * n, 4 * n, 64 * 2**20)
    assert (t.load_read, t.load_merged) == (2 * V * H, 2 * 2 * F * H)  # the vocabulary, the merged fc1, in bfloat16
    planned = rehearse_memory.predicted_phase_bytes(r, 56, 17, 4)
    assert planned["load"] == 2 * n + 2 * V * H and planned["sync"] == 4 * n + 64 * 2**20
    # resident: the bfloat16 copy and the replica, 17.8 GB, with the runtime under 24 GB; float32 would be 23.7 GB
    assert rehearse_memory.world_bytes(r) == 2 * n + 4 * n + 64 * 2**20 + rehearse_memory.RUNTIME_BYTES


def test_training_dtype_choices_and_tolerance(tmp_path):
    recipe = EXAMPLES / "ppo_llama3_70b" / "config.yaml"
    with pytest.raises(ConfigError, match="unknown training dtype 'float16'"):
        rehearse.from_recipe(recipe, layers=1, preset="llama3-70b", train_dtype="float16")
    with pytest.raises(ConfigError, match="leave --update out"):
        rehearse.from_recipe(recipe, layers=1, preset="llama3-70b", train_dtype="bfloat16", update=True)
    report = {"convert": {"round_trip_unequal": []}, "log_prob_max_diff": 0.069, "memory_checks": []}
    assert rehearse.failures(report | {"train_dtype": "bfloat16"}) == []  # bfloat16's rounding (the 7B measured)
    assert rehearse.failures(report | {"train_dtype": "float32"}) == [
        "log-probs differ from transformers' by 6.90e-02 (> 0.0001)"]
