"""Named model presets for the planner: the published HF ``config.json`` of each model, written out.

Pure module (no torch, no megatron-core). A preset is exactly the dict the model's ``config.json``
holds on the Hugging Face hub (the fields :func:`megarl.models.spec.spec_from_hf_config` reads,
plus the identifying ones), so a plan made from a preset equals a plan made from the downloaded
file. Sources, as published on huggingface.co:

* ``llama3-8b``   meta-llama/Meta-Llama-3-8B/config.json   (transformers 4.40.0.dev0)
* ``llama3-70b``  meta-llama/Meta-Llama-3-70B/config.json  (transformers 4.40.0.dev0); the
  numbers docs/resharding.md §1.6 and §3.4 use (80 x 8192, 64/8 heads, FFN 28672, V 128256: 70.55 B)
* ``qwen2.5-0.5b`` Qwen/Qwen2.5-0.5B/config.json (transformers 4.40.1): 24 x 896, 14/2 heads of 64, FFN 4864,
  vocabulary 151936 tied to the embedding; 0.49 B parameters (the examples' ppo_gsm8k_qwen2.5_0.5b)
* ``qwen2.5-7b``  Qwen/Qwen2.5-7B/config.json  (transformers 4.43.1)
* ``qwen2.5-72b`` Qwen/Qwen2.5-72B/config.json (transformers 4.43.1). The -Instruct variants differ
  only in fields that do not change memory (rms_norm_eps 1e-6, max_position_embeddings 32768,
  eos_token_id 151645, max_window_layers).

* ``qwen3-30b-a3b`` Qwen/Qwen3-30B-A3B/config.json (transformers 4.51.0): Mixture-of-Experts, 48 layers of
  128 experts (FFN 768, top 8, norm_topk_prob) under 32/4 heads of 128, hidden 2048; 30.53 B parameters,
  3.35 B active per token. ``intermediate_size`` (6144) is unused: every layer is MoE.

Llama-3.1 models differ from these only in ``rope_scaling`` (llama3, factor 8) and the context
length; pass their ``config.json`` with ``--hf-config`` instead.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from megarl.errors import ConfigError
from megarl.models.spec import ModelSpec, load_hf_config, spec_from_hf_config

_LLAMA3_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}

_QWEN25_COMMON: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "model_type": "qwen2",
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_mrope": False,
    "use_sliding_window": False,
    "vocab_size": 152064,
}

PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": _QWEN25_COMMON | {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "max_position_embeddings": 32768,
        "max_window_layers": 24,
        "num_attention_heads": 14,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "transformers_version": "4.40.1",
        "vocab_size": 151936,
    },
    "llama3-8b": _LLAMA3_COMMON | {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
    },
    "llama3-70b": _LLAMA3_COMMON | {
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_hidden_layers": 80,
    },
    "qwen2.5-7b": _QWEN25_COMMON | {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "max_window_layers": 28,
        "num_attention_heads": 28,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
    },
    "qwen2.5-72b": _QWEN25_COMMON | {
        "hidden_size": 8192,
        "intermediate_size": 29568,
        "max_window_layers": 80,
        "num_attention_heads": 64,
        "num_hidden_layers": 80,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
    },
}

PRESETS["qwen3-30b-a3b"] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# Display names for reports.
TITLES = {
    "llama3-8b": "Llama-3-8B",
    "llama3-70b": "Llama-3-70B",
    "qwen2.5-0.5b": "Qwen2.5-0.5B",
    "qwen2.5-7b": "Qwen2.5-7B",
    "qwen2.5-72b": "Qwen2.5-72B",
    "qwen3-30b-a3b": "Qwen3-30B-A3B",
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def preset_config(name: str) -> dict[str, Any]:
    """A copy of the preset's HF config dict; unknown names raise and list the valid ones."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {preset_names()}, or pass an HF "
                          "config.json (or the directory holding it) instead.")
    return copy.deepcopy(PRESETS[name])


def preset_spec(name: str) -> ModelSpec:
    return spec_from_hf_config(preset_config(name))


def load_model(preset: str | None = None, hf_config: str | Path | None = None) -> tuple[ModelSpec, str]:
    """(spec, display name) from exactly one of a preset name or an HF config path (file or directory)."""
    if (preset is None) == (hf_config is None):
        raise ConfigError("give exactly one model: a preset name or a path to an HF config.json (or its directory).")
    if preset is not None:
        return preset_spec(preset), TITLES[preset]
    path = Path(hf_config)
    cfg = _read_json(path) if path.is_file() else load_hf_config(path)
    name = path.parent.name if path.is_file() else path.name
    return spec_from_hf_config(cfg), name or str(path)


def _read_json(path: Path) -> dict[str, Any]:
    """An HF config given as a file (``load_hf_config`` takes the model directory)."""
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not a readable JSON HF config ({e}); pass the model's config.json.") from e
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} holds {type(cfg).__name__}, not an HF config object; pass the model's config.json.")
    return cfg
