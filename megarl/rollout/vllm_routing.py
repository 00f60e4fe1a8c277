"""Expert routing from vLLM for router replay (R3): the engine arguments that make vLLM return each token's routed
experts, and their conversion to :attr:`megarl.rollout.base.RolloutOutput.routed_experts`.

vLLM (>= 0.32) returns them per completion as ``routed_experts [tokens fed, layers, k]`` with
``enable_return_routed_experts``, which runs only in its Model Runner V2 (CUDA) and needs prefix caching; its CPU
build generates with the V1 runner and refuses it. Imports torch and megarl only (vLLM is passed in).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from megarl.errors import ConfigError, MissingDependencyError


def routed_experts(completion: Any, tokens: int, routing: tuple[int, int], prompt: int) -> torch.Tensor:
    """One row's ``routed_experts`` as int16 [tokens fed, layers, k]: vLLM feeds every token but the last."""
    experts = getattr(completion, "routed_experts", None)
    if experts is None:
        raise RuntimeError(f"vLLM returned no routed_experts for a response of prompt {prompt}; the engine must be "
                           "built with enable_return_routed_experts")
    t = torch.as_tensor(experts).to(torch.int16)
    if t.dim() != 3 or tuple(t.shape[1:]) != routing or not tokens - 1 <= t.shape[0] <= tokens:
        raise RuntimeError(f"vLLM's routed_experts for a {tokens}-token row of prompt {prompt} has shape "
                           f"{tuple(t.shape)}; expected [{tokens - 1}, {routing[0]}, {routing[1]}]")
    return t


def stack_routing(rows: list[torch.Tensor], routing: tuple[int, int]) -> torch.Tensor:
    """[rows, W, layers, k], W the longest row; positions a row never fed hold experts 0..k-1 (the contract)."""
    layers, k = routing
    width = max((r.shape[0] + 1 for r in rows), default=0)
    out = torch.arange(k, dtype=torch.int16).expand(len(rows), width, layers, k).clone()
    for j, r in enumerate(rows):
        out[j, : r.shape[0]] = r
    return out


def routing_shape(spec: Any) -> tuple[int, int]:
    """(MoE layers, top-k) of the routing a router-replay run records; refuses a dense model."""
    if spec.moe is None:
        raise ConfigError(f"recording expert routing needs a Mixture-of-Experts model; {spec.architecture} is dense")
    return spec.num_layers, spec.moe.top_k


def prepare_routing_output(vllm: Any, on_gpu: bool) -> None:
    """Check that this vLLM can return each token's routed experts (router replay, R3) and select the runner that
    does; the engine argument itself is :class:`megarl.rollout.vllm_args.EngineOptions`'."""
    if not on_gpu:
        raise ConfigError(
            "router replay with the vLLM backend needs vLLM's routed-experts output (enable_return_routed_experts), "
            "which runs only in its Model Runner V2; vLLM's CPU build generates with the V1 runner and refuses it "
            "(vLLM 0.32). On CPU use rollout.engine.backend=embedded (it records routing) or policy.router_replay="
            "false; on CUDA it works as configured.")
    if "enable_return_routed_experts" not in {f.name for f in dataclasses.fields(vllm.EngineArgs)}:
        raise MissingDependencyError(f"vLLM {getattr(vllm, '__version__', '?')} cannot return routed experts "
                                     "(enable_return_routed_experts, vLLM >= 0.32): upgrade it or set "
                                     "policy.router_replay=false")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # vLLM's aux outputs (routed experts) exist in this runner only
