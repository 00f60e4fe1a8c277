"""HF config -> ModelSpec: registry, config-key variants, parameter count vs transformers."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from megarl.errors import ConfigError, UnsupportedModelError
from megarl.models.spec import spec_from_hf_config
from megarl.testing.tiny import tiny_config


@pytest.mark.parametrize("family, tied, scalar", [("llama", False, False), ("qwen2", True, False),
                                                 ("qwen2", False, False), ("qwen3", False, False),
                                                 ("llama", False, True), ("qwen2", True, True)])
def test_num_parameters_matches_transformers(family, tied, scalar):
    from transformers import AutoModelForSequenceClassification

    cfg = tiny_config(family, tied=tied, scalar_head=scalar)
    spec = spec_from_hf_config(cfg.to_dict())
    with torch.device("meta"):
        model = (AutoModelForSequenceClassification if scalar else AutoModelForCausalLM).from_config(cfg)
    assert spec.num_parameters() == sum(p.numel() for p in model.parameters())
    assert spec.qkv_bias == (family == "qwen2")
    assert spec.qk_layernorm == (family == "qwen3")
    assert spec.tie_word_embeddings == (tied and not scalar)


def test_multi_label_classifier_is_rejected():
    cfg = tiny_config("llama", scalar_head=True).to_dict() | {"id2label": {0: "a", 1: "b"}}
    with pytest.raises(UnsupportedModelError, match="2 labels is not supported"):
        spec_from_hf_config(cfg)


def test_unknown_architecture_lists_supported():
    cfg = tiny_config("llama").to_dict() | {"architectures": ["GPT2LMHeadModel"]}
    with pytest.raises(UnsupportedModelError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        spec_from_hf_config(cfg)


def test_transformers_4_and_5_rope_keys_agree():
    v5 = tiny_config("llama").to_dict()  # rope_parameters
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"} | {"rope_theta": 50000.0}
    assert spec_from_hf_config(v4) == spec_from_hf_config(v5)
    assert spec_from_hf_config(v5).rope_theta == 50000.0


def test_llama3_rope_scaling_and_unsupported_variants():
    cfg = tiny_config("llama", rope_scaling=True).to_dict()
    assert spec_from_hf_config(cfg).rope_scaling_factor == 8.0
    bad = dict(cfg, rope_parameters=dict(cfg["rope_parameters"], high_freq_factor=2.0))
    with pytest.raises(UnsupportedModelError, match="high_freq_factor=2.0.*megatron-core fixes"):
        spec_from_hf_config(bad)
    yarn = dict(cfg, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(UnsupportedModelError, match="rope type 'yarn'"):
        spec_from_hf_config(yarn)


def test_unsupported_features_raise():
    cfg = tiny_config("llama").to_dict()
    with pytest.raises(UnsupportedModelError, match="hidden_act='gelu'"):
        spec_from_hf_config(dict(cfg, hidden_act="gelu"))
    with pytest.raises(UnsupportedModelError, match="mlp_bias"):
        spec_from_hf_config(dict(cfg, mlp_bias=True))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("pad", [None, 0, 7, -1])
def test_embedding_padding_idx_is_transformers(family, pad):
    """The row transformers' input embedding treats as padding (its own nn.Embedding, built from the config)."""
    cfg = tiny_config(family)
    cfg.pad_token_id = pad
    with torch.device("meta"):
        expected = AutoModelForCausalLM.from_config(cfg).get_input_embeddings().padding_idx
    assert spec_from_hf_config(cfg.to_dict()).embedding_padding_idx == expected


def test_pad_token_outside_the_vocabulary_is_rejected():
    cfg = tiny_config("llama").to_dict()
    for pad in (300, -301):
        with pytest.raises(UnsupportedModelError, match=f"pad_token_id={pad} and vocab_size=300"):
            spec_from_hf_config(dict(cfg, pad_token_id=pad))


def test_padded_vocab_matches_megatron_lm_rule():
    spec = spec_from_hf_config(tiny_config("llama", vocab_size=128256).to_dict())
    # docs/resharding.md §1.4 worked numbers: Llama-3 V=128256, TP=8, D=128 -> 129024
    assert spec.padded_vocab_size(8) == 129024
    assert spec.padded_vocab_size(1) == 128256


def test_hf_dir_without_config(tmp_path):
    from megarl.models.spec import load_hf_config

    with pytest.raises(ConfigError, match="no config.json"):
        load_hf_config(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_hf_config(tmp_path / "nope")


def test_qwen3_moe_spec_and_parameter_counts_match_transformers():
    from megarl.models.spec import Family

    cfg = tiny_config("qwen3_moe", num_experts=8, top_k=3, moe_intermediate_size=24, norm_topk_prob=False)
    spec = spec_from_hf_config(cfg.to_dict())  # to_dict() writes num_local_experts
    assert spec.family is Family.QWEN3_MOE and spec.qk_layernorm
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.ffn_hidden_size, spec.moe.norm_topk_prob) == (8, 3, 24,
                                                                                                         False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert spec.num_parameters() == sum(p.numel() for p in model.parameters())
    # active: per layer, 5 of the 8 experts' 3 x 24 x 64 weights are not used by a token
    assert spec.num_parameters() - spec.num_active_parameters() == cfg.num_hidden_layers * 5 * 3 * 24 * 64
    hub = cfg.to_dict()
    hub["num_experts"] = hub.pop("num_local_experts")  # the hub's key
    assert spec_from_hf_config(hub).moe == spec.moe


def test_moe_with_dense_layers_is_refused():
    for extra in ({"decoder_sparse_step": 2}, {"mlp_only_layers": [0]}):
        with pytest.raises(UnsupportedModelError, match="dense layers among the MoE layers"):
            spec_from_hf_config(tiny_config("qwen3_moe").to_dict() | extra)
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=9 of 4"):
        spec_from_hf_config(tiny_config("qwen3_moe").to_dict() | {"num_experts_per_tok": 9})
