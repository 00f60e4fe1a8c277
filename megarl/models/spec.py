"""ModelSpec: the architecture-independent description of a decoder, read from an HF config.

Pure module (no megatron-core, no torch.distributed). The registry is keyed by the exact HF
``architectures`` string; every family listed here shares the Llama-style decoder (RMSNorm,
rotary embeddings, GQA attention, SwiGLU MLP) and differs only in the flags carried by the spec
(qkv bias, qk-norm, tied embeddings) and, for Mixture-of-Experts families, in the MLP: a top-k
softmax router over SwiGLU experts in every layer (:class:`MoESpec`). A config feature megarl cannot
reproduce exactly raises :class:`UnsupportedModelError` rather than being silently ignored.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from pathlib import Path
from typing import Any

from megarl.errors import ConfigError, UnsupportedModelError
from megarl.parallel.layout import ParallelLayout

# Megatron-core implements Llama-3 rope scaling with these constants fixed
# (megatron/core/models/common/embeddings/rotary_pos_embedding.py `_apply_scaling`).
_MCORE_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class Family(enum.Enum):
    LLAMA = "llama"
    QWEN2 = "qwen2"
    QWEN3 = "qwen3"
    QWEN3_MOE = "qwen3_moe"


class Head(enum.Enum):
    LM = "lm"  # vocabulary logits (causal LM)
    SCALAR = "scalar"  # one value per token (critic, reward model: HF *ForSequenceClassification, num_labels=1)


ARCHITECTURES: dict[str, tuple[Family, Head]] = {
    "LlamaForCausalLM": (Family.LLAMA, Head.LM),
    "Qwen2ForCausalLM": (Family.QWEN2, Head.LM),
    "Qwen3ForCausalLM": (Family.QWEN3, Head.LM),
    "LlamaForSequenceClassification": (Family.LLAMA, Head.SCALAR),
    "Qwen2ForSequenceClassification": (Family.QWEN2, Head.SCALAR),
    "Qwen3ForSequenceClassification": (Family.QWEN3, Head.SCALAR),
    "Qwen3MoeForCausalLM": (Family.QWEN3_MOE, Head.LM),
    "Qwen3MoeForSequenceClassification": (Family.QWEN3_MOE, Head.SCALAR),
}
_MOE_FAMILIES = (Family.QWEN3_MOE,)


def as_head(hf_config: dict[str, Any], head: Head) -> dict[str, Any]:
    """``hf_config`` as its family's model with ``head`` (a causal LM's config as the sequence classifier with one
    label that a trained scalar head makes of it, and back); unchanged when it already has that head."""
    arch = next(a for a in hf_config.get("architectures") or [] if a in ARCHITECTURES)
    family, current = ARCHITECTURES[arch]
    if current is head:
        return hf_config
    name = next(a for a, (f, h) in ARCHITECTURES.items() if f is family and h is head)
    out = dict(hf_config, architectures=[name])
    if head is Head.SCALAR:
        out |= {"num_labels": 1, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
    return out
_QK_NORM_FAMILIES = (Family.QWEN3, Family.QWEN3_MOE)


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """The Mixture-of-Experts MLP of every decoder layer: ``top_k`` of ``num_experts`` SwiGLU experts
    (each of width ``ffn_hidden_size``) chosen per token by a softmax router, their outputs weighted by
    the router's probabilities (renormalised over the chosen k when ``norm_topk_prob``)."""

    num_experts: int
    top_k: int
    ffn_hidden_size: int
    norm_topk_prob: bool
    aux_loss_coef: float  # the checkpoint's load-balancing loss coefficient (a training default)

    def expert_parameters(self, hidden_size: int) -> int:
        """Parameters of all experts of one layer (the router excluded)."""
        return self.num_experts * 3 * self.ffn_hidden_size * hidden_size


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    architecture: str
    family: Family
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    rope_scaling_factor: float | None  # Llama-3 style scaling, None when absent
    max_position_embeddings: int
    qkv_bias: bool
    qk_layernorm: bool
    tie_word_embeddings: bool  # always False for a scalar head (there is no LM head to tie)
    dtype: str  # "float32" | "bfloat16" | "float16": the checkpoint's dtype
    head: Head = Head.LM
    pad_token_id: int | None = None  # scalar heads score the last token that is not padding
    moe: MoESpec | None = None  # None: a dense SwiGLU MLP of width ffn_hidden_size in every layer

    def check_layout(self, layout: ParallelLayout) -> None:
        """Raise LayoutError unless ``layout`` can split this model (heads, groups, layers, experts)."""
        layout.check_model(num_layers=self.num_layers, num_attention_heads=self.num_attention_heads,
                           num_query_groups=self.num_query_groups,
                           num_experts=self.moe.num_experts if self.moe else None)

    @property
    def embedding_padding_idx(self) -> int | None:
        """The input embedding's row that transformers builds as ``nn.Embedding(..., padding_idx=pad_token_id)``
        (every supported family): looked up like any row, but the lookup adds nothing to its gradient. None when
        the config has no pad token. A negative id counts from the end, as in ``nn.Embedding``."""
        return None if self.pad_token_id is None else self.pad_token_id % self.vocab_size

    def with_head(self, head: Head) -> ModelSpec:
        """The same decoder with another head (a critic built from a causal LM)."""
        return dataclasses.replace(self, head=head, tie_word_embeddings=self.tie_word_embeddings and head is Head.LM)

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def qkv_rows(self) -> int:
        return (self.num_attention_heads + 2 * self.num_query_groups) * self.head_dim

    def padded_vocab_size(self, tp: int, divisible_by: int = 128) -> int:
        """Megatron's padded vocabulary: a multiple of ``divisible_by * tp`` (Megatron-LM's rule)."""
        multiple = divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def num_parameters(self) -> int:
        """Parameters of the HF model (unpadded vocabulary)."""
        h, v = self.hidden_size, self.vocab_size
        attn = self.qkv_rows * h + self.num_attention_heads * self.head_dim * h
        attn += self.qkv_rows if self.qkv_bias else 0
        attn += 2 * self.head_dim if self.qk_layernorm else 0
        layer = attn + self._mlp_parameters() + 2 * h
        head = h if self.head is Head.SCALAR else (0 if self.tie_word_embeddings else v * h)
        return self.num_layers * layer + h + v * h + head

    def num_active_parameters(self) -> int:
        """Parameters one token's forward uses: an MoE layer's top-k experts and its router, not all experts."""
        if self.moe is None:
            return self.num_parameters()
        m, h = self.moe, self.hidden_size
        unused = m.expert_parameters(h) - m.top_k * 3 * m.ffn_hidden_size * h
        return self.num_parameters() - self.num_layers * unused

    def _mlp_parameters(self) -> int:
        h = self.hidden_size
        if self.moe is None:
            return 3 * self.ffn_hidden_size * h
        return self.moe.expert_parameters(h) + self.moe.num_experts * h  # experts + router


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def load_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        raise ConfigError(f"HF model directory {hf_dir} does not exist; pass the folder that holds config.json.")
    if not path.is_file():
        raise ConfigError(
            f"{hf_dir} has no config.json, so it is not a HuggingFace model directory; pass the folder "
            "written by `save_pretrained` (config.json + *.safetensors + tokenizer files)."
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); restore it from the original model.") from e


def spec_from_hf_config(cfg: dict[str, Any]) -> ModelSpec:
    """Validate an HF config dict (``config.json`` / ``PretrainedConfig.to_dict()``) and build a spec."""
    archs = cfg.get("architectures") or []
    known = [a for a in archs if a in ARCHITECTURES]
    if not known:
        raise UnsupportedModelError(
            f"unsupported architecture {archs or '(none given)'} in config.json; megarl supports "
            f"{supported_architectures()}. Convert a model of a supported family, or add a family to "
            "megarl.models.spec.ARCHITECTURES with its name mapping."
        )
    arch = known[0]
    family, head = ARCHITECTURES[arch]
    if head is Head.SCALAR and int(cfg.get("num_labels", len(cfg.get("id2label") or {0: 0}))) != 1:
        raise UnsupportedModelError(
            f"{arch} with {cfg.get('num_labels', len(cfg.get('id2label') or {}))} labels is not supported: reward "
            "models and critics have one output; set num_labels=1."
        )
    _require(cfg, "hidden_act", "silu", arch)
    _require(cfg, "mlp_bias", False, arch)
    if cfg.get("use_sliding_window"):
        raise UnsupportedModelError(f"{arch} with use_sliding_window=true is not supported; set it to false.")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    qkv_bias = True if family is Family.QWEN2 else bool(cfg.get("attention_bias", False))
    moe = _moe(cfg, arch) if family in _MOE_FAMILIES else None
    theta, factor = _rope(cfg, arch)
    _check_pad_token(cfg, arch)
    return ModelSpec(
        architecture=arch,
        family=family,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        ffn_hidden_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_query_groups=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=theta,
        rope_scaling_factor=factor,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        qkv_bias=qkv_bias,
        qk_layernorm=family in _QK_NORM_FAMILIES,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)) and head is Head.LM,
        dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        head=head,
        pad_token_id=cfg.get("pad_token_id"),
        moe=moe,
    )


def _moe(cfg: dict[str, Any], arch: str) -> MoESpec:
    """The MoE MLP of a Qwen3-MoE config; every layer must be sparse (megarl builds one layer kind)."""
    # transformers' config.to_dict() writes num_local_experts (its attribute map); hub configs say num_experts
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if not experts:
        raise UnsupportedModelError(f"{arch} config has no num_experts (or num_local_experts); it is not an MoE model.")
    if int(cfg.get("decoder_sparse_step", 1)) != 1 or cfg.get("mlp_only_layers"):
        raise UnsupportedModelError(
            f"{arch} with dense layers among the MoE layers (decoder_sparse_step="
            f"{cfg.get('decoder_sparse_step', 1)}, mlp_only_layers={cfg.get('mlp_only_layers')}) is not supported; "
            "megarl supports models whose every layer is MoE (decoder_sparse_step=1, mlp_only_layers=[]).")
    top_k = int(cfg["num_experts_per_tok"])
    if not 1 <= top_k <= int(experts):
        raise UnsupportedModelError(f"{arch} routes each token to num_experts_per_tok={top_k} of {experts} experts; "
                                    "it must be between 1 and num_experts.")
    return MoESpec(num_experts=int(experts), top_k=top_k, ffn_hidden_size=int(cfg["moe_intermediate_size"]),
                   norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                   aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)))


def _check_pad_token(cfg: dict[str, Any], arch: str) -> None:
    """transformers uses ``pad_token_id`` as the input embedding's ``padding_idx``, which must be a row of it."""
    pad, vocab = cfg.get("pad_token_id"), int(cfg["vocab_size"])
    if pad is not None and not (isinstance(pad, int) and -vocab <= pad < vocab):
        raise UnsupportedModelError(
            f"{arch} with pad_token_id={pad!r} and vocab_size={vocab} is not supported: transformers builds the input "
            "embedding with padding_idx=pad_token_id, which must be a row of it (nor can transformers load this "
            "config); set pad_token_id to a token id below vocab_size, or remove it.")


def _require(cfg: dict[str, Any], key: str, expected: Any, arch: str) -> None:
    found = cfg.get(key, expected)
    if found != expected:
        raise UnsupportedModelError(f"{arch} with {key}={found!r} is not supported; megarl needs {key}={expected!r}.")


def _rope(cfg: dict[str, Any], arch: str) -> tuple[float, float | None]:
    """(rope_theta, llama3 scaling factor) from either the transformers 4.x or 5.x config keys."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise UnsupportedModelError(
            f"{arch} with rope type {rope_type!r} is not supported; megarl supports 'default' and 'llama3'."
        )
    for key, value in _MCORE_LLAMA3_ROPE.items():
        if float(params.get(key, value)) != value:
            raise UnsupportedModelError(
                f"llama3 rope scaling with {key}={params[key]} is not supported: megatron-core fixes {key}={value}."
            )
    return theta, float(params["factor"])
