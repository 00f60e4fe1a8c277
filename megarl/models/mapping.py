"""HF <-> Megatron-core name and layout rules for the Llama-style decoder family, dense and MoE.

One list of :class:`TensorMap` per model says, for every Megatron parameter (global name, i.e.
global layer index, local-spec module names), which HF tensors it is made of, how they are packed
and along which dimension tensor parallelism splits it. The same rules serve the offline
conversion tools, online resharding and the tests. Pure module: torch only, no megatron-core.

Layouts (see docs/resharding.md §1-2):

* ``linear_qkv``: per query group ``[q_0..q_{r-1}, k, v]`` blocks (GQA interleaving); a TP shard
  is a contiguous slice of whole groups.
* ``linear_fc1``: ``[gate; up]``; TP rank t holds ``[gate_t; up_t]``, not a slice of the full tensor.
* vocabulary tensors: padded with zero rows to Megatron's padded size; trimmed to V on export.
* tied embeddings: only ``embedding.word_embeddings.weight`` exists (HF has no ``lm_head``).
* MoE layers (:class:`~megarl.models.spec.MoESpec`): ``mlp.router.weight`` is HF's ``mlp.gate.weight``;
  expert ``e`` is ``mlp.experts.local_experts.{e}.linear_fc1/fc2`` under its *global* index (on a rank
  of expert-parallel rank ``r`` megatron numbers its experts from 0; :func:`megarl.models.provider.
  global_named_parameters` renumbers them) and HF's per-expert ``mlp.experts.{e}.gate_proj/up_proj/
  down_proj`` (the layout of hub checkpoints and of what transformers 5 saves; in memory transformers 5
  fuses them into ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``). Experts are never split by
  tensor parallelism (expert TP is 1); expert parallelism places whole experts.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Sequence

import torch

from megarl.errors import CheckpointError
from megarl.models.spec import Head, ModelSpec


class Kind(enum.Enum):
    COPY = "copy"  # one HF tensor, same layout
    QKV = "qkv"  # q, k, v -> per-group interleaved
    GATE_UP = "gate_up"  # gate, up -> [gate; up]
    VOCAB = "vocab"  # rows padded in Megatron, trimmed in HF


@dataclasses.dataclass(frozen=True)
class TensorMap:
    mcore: str  # global Megatron name, local-spec modules
    hf: tuple[str, ...]
    kind: Kind
    tp_dim: int | None  # dimension split by tensor parallelism; None = replicated over TP
    layer: int | None  # global layer index, None for embedding / final norm / output layer
    expert: int | None = None  # global expert index of an MoE expert's tensor (placed by expert parallelism)
    ckpt_key: str = ""  # the dist-checkpoint key: one tensor per kind, stacked over layers (and experts)

    @property
    def ckpt_index(self) -> tuple[int, ...]:
        """This tensor's index into its stacked checkpoint tensor: (), (layer,) or (layer, expert)."""
        return tuple(i for i in (self.layer, self.expert) if i is not None)


_LAYER_RULES: tuple[tuple[str, tuple[str, ...], Kind, int | None], ...] = (
    ("input_layernorm.weight", ("input_layernorm.weight",), Kind.COPY, None),
    (
        "self_attention.linear_qkv.weight",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        Kind.QKV,
        0,
    ),
    (
        "self_attention.linear_qkv.bias",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        Kind.QKV,
        0,
    ),
    ("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), Kind.COPY, None),
    ("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), Kind.COPY, None),
    ("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), Kind.COPY, 1),
    ("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), Kind.COPY, None),
)
_DENSE_MLP_RULES: tuple[tuple[str, tuple[str, ...], Kind, int | None], ...] = (
    ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), Kind.GATE_UP, 0),
    ("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), Kind.COPY, 1),
)
_ROUTER = ("mlp.router.weight", ("mlp.gate.weight",), Kind.COPY, None)
_EXPERT_RULES: tuple[tuple[str, tuple[str, ...], Kind, int | None], ...] = (  # {e}: the global expert index
    ("linear_fc1.weight", ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"), Kind.GATE_UP, None),
    ("linear_fc2.weight", ("mlp.experts.{e}.down_proj.weight",), Kind.COPY, None),
)
_EXPERT_PREFIX = "mlp.experts.local_experts."
_EXPERT_NAME = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")

# Transformer Engine fuses the pre-attention / pre-MLP norms into the following linear layer.
# megatron-core's local spec maps its names to these in checkpoints (sharded_state_dict_keys_map),
# so dist checkpoints always use the TE names. An MoE layer's pre-MLP norm stays a norm of its own in
# TE's spec (the router and experts follow it), so its checkpoint key keeps the local name (megarl's
# MoE layer spec drops that entry of the local spec's key map to match).
_TE_RENAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def tensor_maps(spec: ModelSpec) -> list[TensorMap]:
    """Every Megatron parameter of the model, in a global order all ranks and tools agree on."""
    maps = [_map("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), Kind.VOCAB, 0)]
    moe = spec.moe is not None
    rules = _LAYER_RULES + (() if moe else _DENSE_MLP_RULES)
    for i in range(spec.num_layers):
        for suffix, hf_suffixes, kind, tp_dim in rules + ((_ROUTER,) if moe else ()):
            if suffix.endswith("linear_qkv.bias") and not spec.qkv_bias:
                continue
            if suffix.startswith("self_attention.") and "_layernorm" in suffix and not spec.qk_layernorm:
                continue
            hf = tuple(f"model.layers.{i}.{s}" for s in hf_suffixes)
            maps.append(_map(f"decoder.layers.{i}.{suffix}", hf, kind, tp_dim, i, moe=moe))
        for e in range(spec.moe.num_experts if moe else 0):
            for suffix, hf_suffixes, kind, tp_dim in _EXPERT_RULES:
                hf = tuple(f"model.layers.{i}.{s.format(e=e)}" for s in hf_suffixes)
                maps.append(_map(f"decoder.layers.{i}.{_EXPERT_PREFIX}{e}.{suffix}", hf, kind, tp_dim, i, e))
    maps.append(_map("decoder.final_layernorm.weight", ("model.norm.weight",), Kind.COPY, None))
    if spec.head is Head.SCALAR:  # replicated over TP: [1, hidden]
        maps.append(_map("output_layer.weight", ("score.weight",), Kind.COPY, None))
    elif not spec.tie_word_embeddings:
        maps.append(_map("output_layer.weight", ("lm_head.weight",), Kind.VOCAB, 0))
    return maps


def _map(mcore: str, hf: tuple[str, ...], kind: Kind, tp_dim: int | None, layer: int | None = None,
         expert: int | None = None, *, moe: bool = False) -> TensorMap:
    return TensorMap(mcore, hf, kind, tp_dim, layer, expert, checkpoint_key(mcore, moe=moe))


def split_expert_name(suffix: str) -> tuple[int | None, str]:
    """``mlp.experts.local_experts.5.linear_fc1.weight`` -> (5, ``linear_fc1.weight``); others -> (None, suffix)."""
    m = _EXPERT_NAME.match(suffix)
    return (int(m.group(1)), m.group(2)) if m else (None, suffix)


def with_expert(name: str, expert: int) -> str:
    """Replace the expert index of an expert parameter's name (local <-> global numbering)."""
    layer, suffix = split_layer_name(name)
    _, rest = split_expert_name(suffix)
    return f"decoder.layers.{layer}.{_EXPERT_PREFIX}{expert}.{rest}"


def split_layer_name(name: str) -> tuple[int | None, str]:
    """``decoder.layers.3.mlp.linear_fc1.weight`` -> (3, ``mlp.linear_fc1.weight``); others -> (None, name)."""
    m = _LAYER_NAME.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def with_layer(name: str, layer: int) -> str:
    """Replace the layer index of a decoder-layer name (stage-local <-> global)."""
    _, suffix = split_layer_name(name)
    return f"decoder.layers.{layer}.{suffix}"


def te_name(name: str, *, moe: bool = False) -> str:
    """Local-spec parameter name -> Transformer Engine spec name (``moe``: the name is in an MoE layer)."""
    layer, suffix = split_layer_name(name)
    if layer is None or suffix not in _TE_RENAMES or (moe and suffix == "pre_mlp_layernorm.weight"):
        return name
    return f"decoder.layers.{layer}.{_TE_RENAMES[suffix]}"


def local_name(name: str) -> str:
    """Transformer Engine spec name -> local-spec parameter name (identity for local names)."""
    layer, suffix = split_layer_name(name)
    for local, te in _TE_RENAMES.items():
        if layer is not None and suffix == te:
            return f"decoder.layers.{layer}.{local}"
    return name


def checkpoint_key(name: str, *, moe: bool = False) -> str:
    """The dist-checkpoint key of a global local-spec name (``moe``: the name is in an MoE layer).

    megatron-core saves decoder layers as one tensor per parameter kind with a leading layer axis
    (``decoder.layers.self_attention.linear_qkv.weight`` of shape [L, ...]) under TE names, and an MoE
    layer's experts with a second, expert axis (``decoder.layers.mlp.experts.experts.linear_fc1.weight`` of
    shape [L, E, ...]); :attr:`TensorMap.ckpt_index` is the index into that tensor.
    """
    layer, suffix = split_layer_name(te_name(name, moe=moe))
    if layer is None:
        return name
    expert, rest = split_expert_name(suffix)
    return f"decoder.layers.mlp.experts.experts.{rest}" if expert is not None else f"decoder.layers.{suffix}"


# ---------------------------------------------------------------------------------------- shapes


def hf_shapes(m: TensorMap, spec: ModelSpec) -> tuple[tuple[int, ...], ...]:
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_query_groups * d
    if m.kind is Kind.QKV:
        if m.mcore.endswith("bias"):
            return ((q,), (kv,), (kv,))
        return ((q, h), (kv, h), (kv, h))
    ffn = spec.moe.ffn_hidden_size if m.expert is not None else spec.ffn_hidden_size
    if m.kind is Kind.GATE_UP:
        return ((ffn, h),) * 2
    if m.kind is Kind.VOCAB:
        return ((spec.vocab_size, h),)
    suffix = split_layer_name(m.mcore)[1]
    if suffix == "self_attention.linear_proj.weight":
        return ((h, q),)
    if suffix == "mlp.linear_fc2.weight" or m.expert is not None:  # fc2 (the only COPY expert tensor)
        return ((h, ffn),)
    if suffix == "mlp.router.weight":
        return ((spec.moe.num_experts, h),)
    if suffix == "output_layer.weight":  # scalar head
        return ((1, h),)
    if "q_layernorm" in suffix or "k_layernorm" in suffix:
        return ((d,),)
    return ((h,),)  # norms


def mcore_shape(m: TensorMap, spec: ModelSpec, padded_vocab: int) -> tuple[int, ...]:
    shapes = hf_shapes(m, spec)
    if m.kind is Kind.VOCAB:
        return (padded_vocab, spec.hidden_size)
    if m.kind in (Kind.QKV, Kind.GATE_UP):
        return (sum(s[0] for s in shapes),) + shapes[0][1:]
    return shapes[0]


# ------------------------------------------------------------------------------------ conversion


def to_mcore(m: TensorMap, spec: ModelSpec, hf: Sequence[torch.Tensor], padded_vocab: int) -> torch.Tensor:
    """HF tensors of one map -> the full (TP=1) Megatron tensor. Shapes are asserted."""
    for name, t, shape in zip(m.hf, hf, hf_shapes(m, spec), strict=True):
        _check_shape(name, tuple(t.shape), shape, "HF checkpoint")
    if m.kind is Kind.VOCAB:
        (t,) = hf
        if padded_vocab == t.shape[0]:
            return t
        out = t.new_zeros((padded_vocab, t.shape[1]))
        out[: t.shape[0]] = t
        return out
    return pack_rows(m, spec, hf)


def pack_rows(m: TensorMap, spec: ModelSpec, hf: Sequence[torch.Tensor]) -> torch.Tensor:
    """HF tensors of one map -> Megatron's row layout (q/k/v interleaved per group, [gate; up]), whatever their
    trailing dimensions (a weight's input features, a LoRA factor's rank)."""
    if m.kind is Kind.QKV:
        g, r, d = spec.num_query_groups, spec.heads_per_group, spec.head_dim
        q, k, v = (t.reshape(g, n * d, *t.shape[1:]) for t, n in zip(hf, (r, 1, 1), strict=True))
        return torch.cat((q, k, v), dim=1).reshape(spec.qkv_rows, *hf[0].shape[1:])
    if m.kind is Kind.GATE_UP:
        return torch.cat(tuple(hf), dim=0)
    (t,) = hf
    return t


def to_hf(m: TensorMap, spec: ModelSpec, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The full Megatron tensor of one map -> its HF tensors (vocab padding trimmed). Shapes asserted."""
    if m.kind is Kind.VOCAB:
        if t.shape[0] < spec.vocab_size:
            raise CheckpointError(
                f"{m.mcore} has {t.shape[0]} rows but the model's vocabulary has {spec.vocab_size}; "
                "the checkpoint does not belong to this model config."
            )
        t = t[: spec.vocab_size]
    _check_shape(m.mcore, tuple(t.shape), mcore_shape(m, spec, t.shape[0]), "Megatron checkpoint")
    return unpack_rows(m, spec, t)


def unpack_rows(m: TensorMap, spec: ModelSpec, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Inverse of :func:`pack_rows`: Megatron's rows -> the map's HF tensors (contiguous)."""
    if m.kind is Kind.QKV:
        g, r, d = spec.num_query_groups, spec.heads_per_group, spec.head_dim
        x = t.reshape(g, r + 2, d, *t.shape[1:])
        rest = tuple(t.shape[1:])
        return (
            x[:, :r].reshape(g * r * d, *rest).contiguous(),
            x[:, r].reshape(g * d, *rest).contiguous(),
            x[:, r + 1].reshape(g * d, *rest).contiguous(),
        )
    if m.kind is Kind.GATE_UP:
        return tuple(c.contiguous() for c in t.chunk(2, dim=0))
    return (t.contiguous(),)


# ---------------------------------------------------------------------------- tensor parallelism


def tp_shard(m: TensorMap, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """The slice of a full Megatron tensor that tensor-parallel rank ``rank`` of ``tp`` holds."""
    if m.tp_dim is None or tp == 1:
        return full
    if m.kind is Kind.GATE_UP:
        gate, up = full.chunk(2, dim=0)
        return torch.cat((gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]), dim=0)
    if full.shape[m.tp_dim] % tp:
        raise ValueError(f"{m.mcore}: dim {m.tp_dim} of {tuple(full.shape)} is not divisible by tp={tp}")
    return full.chunk(tp, dim=m.tp_dim)[rank]


def tp_gather(m: TensorMap, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`tp_shard`: the full tensor from all TP ranks' shards, in rank order."""
    if m.tp_dim is None or len(shards) == 1:
        return shards[0]
    if m.kind is Kind.GATE_UP:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(tuple(shards), dim=m.tp_dim)


def _check_shape(name: str, found: tuple[int, ...], expected: tuple[int, ...], where: str) -> None:
    if found != expected:
        raise CheckpointError(
            f"{where} tensor {name} has shape {list(found)}, expected {list(expected)} from the model "
            "config; the weights and config.json do not belong to the same model."
        )
