"""LoRA factors' names and layouts: Megatron's fused factors <-> HF peft's per-projection ones (pure: torch only).

megarl adapts megatron-core's fused linears (megarl/models/lora.py): ``linear_qkv`` has one ``A`` [r, hidden] for
q, k and v and one ``B`` [q+k+v rows, r] in megatron's per-group row order; ``linear_fc1`` one ``A`` for gate and
up and ``B`` = ``[gate; up]``. peft adapts each HF projection on its own. The fused adapter is exactly peft's with
``A`` repeated on each projection and ``B`` split like the base weight's rows (``mapping.unpack_rows``): the same
``W + scale * B_part A`` per projection, so an export is exact (a peft adapter with *different* A per projection has
no fused equivalent).

Names: a factor is its base weight's global Megatron name with ``weight`` replaced by ``lora_A`` / ``lora_B``; its
checkpoint key likewise (:func:`factor_key`). peft's keys are ``base_model.model.<HF module>.lora_A.weight``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from megarl.models import mapping
from megarl.models.spec import ModelSpec

LORA_A, LORA_B = "lora_A", "lora_B"
FACTORS = (LORA_A, LORA_B)
PEFT_PREFIX = "base_model.model."

# megarl target -> the megatron-core module suffix it adapts (dense layers; MoE experts' fc1/fc2 too)
MODULES = {"qkv": "self_attention.linear_qkv", "proj": "self_attention.linear_proj", "fc1": "linear_fc1",
           "fc2": "linear_fc2"}
# megarl target -> HF module names (peft's target_modules)
HF_MODULES = {"qkv": ("q_proj", "k_proj", "v_proj"), "proj": ("o_proj",), "fc1": ("gate_proj", "up_proj"),
              "fc2": ("down_proj",)}


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA factor's (``...linear_qkv.lora_A``)."""
    return name.rsplit(".", 1)[-1] in FACTORS


def base_name(name: str) -> str:
    """The base weight a factor belongs to: ``...linear_qkv.lora_A`` -> ``...linear_qkv.weight``."""
    return name.rsplit(".", 1)[0] + ".weight"


def factor_name(weight: str, factor: str) -> str:
    """``...linear_qkv.weight`` -> ``...linear_qkv.lora_A`` (``factor``: :data:`LORA_A` or :data:`LORA_B`)."""
    return weight.removesuffix("weight") + factor


def factor_key(m: mapping.TensorMap, factor: str) -> str:
    """The dist-checkpoint key of map ``m``'s factor (stacked over layers and experts like the weight's)."""
    return m.ckpt_key.removesuffix("weight") + factor


def is_target(m: mapping.TensorMap, targets: list[str] | tuple[str, ...]) -> bool:
    """Whether the weight of map ``m`` is adapted for ``targets`` (``LoRAConfig.targets``)."""
    if not m.mcore.endswith(".weight") or m.layer is None:
        return False
    suffix = mapping.split_layer_name(m.mcore)[1].removesuffix(".weight")
    return any(suffix.endswith(MODULES[t]) for t in targets)


def adapted_maps(spec: ModelSpec, targets: list[str] | tuple[str, ...]) -> list[mapping.TensorMap]:
    """The maps of the adapted weights, in :func:`megarl.models.mapping.tensor_maps` order."""
    return [m for m in mapping.tensor_maps(spec) if is_target(m, targets)]


def split_factor(m: mapping.TensorMap, factor: str) -> bool:
    """Whether tensor parallelism splits this factor (``B`` of a column-parallel base, ``A`` of a row-parallel one;
    the other is replicated). Its split dimension is then the weight's (``m.tp_dim``)."""
    return m.tp_dim is not None and (m.tp_dim == 0) == (factor == LORA_B)


def factor_shape(m: mapping.TensorMap, spec: ModelSpec, factor: str, rank: int) -> tuple[int, int]:
    """The global shape of map ``m``'s factor: ``A`` [rank, in], ``B`` [out, rank]."""
    out, in_ = mapping.mcore_shape(m, spec, 0)
    return (rank, in_) if factor == LORA_A else (out, rank)


def to_peft(m: mapping.TensorMap, spec: ModelSpec, a: torch.Tensor,
            b: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """peft's (key, tensor) pairs of one fused adapter (global ``a`` [r, in], ``b`` [out, r]): ``A`` on every HF
    projection of the weight, ``B`` split like its rows."""
    for hf_name, b_part in zip(m.hf, mapping.unpack_rows(m, spec, b), strict=True):
        module = PEFT_PREFIX + hf_name.removesuffix(".weight")
        yield f"{module}.{LORA_A}.weight", a.contiguous()
        yield f"{module}.{LORA_B}.weight", b_part.contiguous()


def hf_modules(targets: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The HF projections ``targets`` adapt (peft's ``target_modules``), sorted."""
    return tuple(sorted(n for t in targets for n in HF_MODULES[t]))


def factor_shapes(spec: ModelSpec, targets: list[str] | tuple[str, ...],
                  rank: int) -> dict[str, tuple[int, int]]:
    """Global name -> global shape of every factor of an adapter (``A`` then ``B`` of each adapted weight, in
    :func:`adapted_maps` order): what an adapter-only sync carries."""
    return {factor_name(m.mcore, f): factor_shape(m, spec, f, rank)
            for m in adapted_maps(spec, targets) for f in FACTORS}


def peft_adapter(spec: ModelSpec, targets: list[str] | tuple[str, ...],
                 factors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """peft's tensors of a whole adapter from its global fused ``factors`` (global factor name -> tensor, every
    factor of :func:`factor_shapes`); raises naming a missing, extra or misshapen factor."""
    rank = next(iter(factors.values())).shape[0] if factors else 0
    shapes = factor_shapes(spec, targets, rank)
    missing, extra = sorted(shapes.keys() - factors.keys()), sorted(factors.keys() - shapes.keys())
    if missing or extra:
        raise ValueError(f"an adapter of targets {list(targets)} has {len(shapes)} factors; found {len(factors)}, "
                         f"missing {missing[:4]}, unexpected {extra[:4]}")
    out = {}
    for m in adapted_maps(spec, targets):
        a, b = (factors[factor_name(m.mcore, f)] for f in FACTORS)
        for name, t in ((factor_name(m.mcore, LORA_A), a), (factor_name(m.mcore, LORA_B), b)):
            if tuple(t.shape) != shapes[name]:
                raise ValueError(f"factor {name} must have the global shape {shapes[name]}, found {tuple(t.shape)}")
        out.update(to_peft(m, spec, a, b))
    return out


def peft_config(rank: int, alpha: float, dropout: float, targets: list[str] | tuple[str, ...],
                base_model: str | None = None, *, causal_lm: bool = True) -> dict:
    """peft's ``adapter_config.json`` of a megarl adapter."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM" if causal_lm else "SEQ_CLS", "r": rank, "lora_alpha": alpha,
        "lora_dropout": dropout, "target_modules": list(hf_modules(targets)),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True,
        "base_model_name_or_path": base_model, "inference_mode": True, "modules_to_save": None,
    }
