"""The embedded engine's HF model (:mod:`megarl.rollout.embedded`): built from a config with its parameters on the
meta device (no random init, no memory), then given empty storages; the per-expert checkpoint names of fused
Mixture-of-Experts parameters; the MoE routers whose choices the engine records.

Imports torch and (lazily) transformers only.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside the block moves to the meta device; buffers stay where they are.

    Patches ``nn.Module.register_parameter`` for the duration (not thread-safe: build engines one at a time).
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _materialize_(model: nn.Module, device: torch.device) -> None:
    """Give every (meta) parameter an empty storage on ``device``; tied parameters stay one object."""
    memo: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(old) -> (old kept alive, new)
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in memo:
                fresh = torch.empty(param.shape, dtype=param.dtype, device=device)
                memo[id(param)] = (param, nn.Parameter(fresh, requires_grad=False))
            module._parameters[name] = memo[id(param)][1]
    model.to(device)  # the buffers


def build_model(hf_config: PretrainedConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    _materialize_(model, device)
    return model.eval().requires_grad_(False)


_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def expert_pieces(params: dict[str, nn.Parameter]) -> dict[str, tuple[str, tuple]]:
    """Per-expert checkpoint name -> (fused parameter name, index of its view) for every fused 3-D expert
    parameter; per fused parameter the views partition it (gate and up halves of each expert, or each expert)."""
    out: dict[str, tuple[str, tuple]] = {}
    for name, param in params.items():
        m = _FUSED_EXPERTS.match(name)
        if m is None or param.dim() != 3:
            continue
        prefix, experts, rows = m["prefix"], param.shape[0], param.shape[1]
        for e in range(experts):
            if m["kind"] == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = (name, (e,))
            else:
                half = rows // 2
                out[f"{prefix}.{e}.gate_proj.weight"] = (name, (e, slice(0, half)))
                out[f"{prefix}.{e}.up_proj.weight"] = (name, (e, slice(half, rows)))
    return out


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The top-k router of every MoE decoder layer (transformers' ``mlp.gate`` beside ``mlp.experts``), in layer
    order; empty for a dense model."""
    layers = model.get_decoder().layers
    return [layer.mlp.gate for layer in layers if hasattr(layer.mlp, "experts") and hasattr(layer.mlp, "gate")]
