"""A rehearsal's model and layout from a recipe (megarl.bench.rehearse; docs/rehearsal.md), by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.bench import rehearse
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
    """The larger of 2 x the largest local shard and the merged fc1 of every layer (docs/rehearsal.md §3)."""
    q7 = rehearse.Rehearsal("q7", rehearse.cut_layers(PRESETS["qwen2.5-7b"], 1), 2, 2, 1, 1,
                            rehearse.RolloutBackend.EMBEDDED, 1, "float32", False, True, ((5, 6),), 8)
    assert rehearse.load_transient_bytes(q7) == 2 * (152064 // 2) * 3584 * 4  # the vocabulary, full shape
    q05 = rehearse.Rehearsal("q05", PRESETS["qwen2.5-0.5b"], 2, 2, 1, 1, rehearse.RolloutBackend.EMBEDDED, 1,
                             "float32", False, True, ((5, 6),), 8)
    merged = 24 * 2 * (4864 // 2) * 896 * 4  # 24 merged fc1 shards: 418 MB, under the tied vocabulary in full shape
    assert merged < rehearse.load_transient_bytes(q05) == 2 * (152064 // 2) * 896 * 4
