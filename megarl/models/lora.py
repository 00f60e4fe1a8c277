"""LoRA adapters on megatron-core's tensor-parallel linears, in the base weights' own layout.

:func:`add_adapters` gives each targeted linear of a built model (a layer's ``linear_qkv``, ``linear_proj``,
``linear_fc1``, ``linear_fc2``; in an MoE layer the experts' ``linear_fc1`` / ``linear_fc2``) two factors,
``lora_A`` [r, in] and ``lora_B`` [out, r], and adds ``scale * B (A x)`` to its output (``scale = alpha / r``;
peft's ``LoraLayer``: A drawn as ``kaiming_uniform(a=sqrt(5))``, B zero, dropout on the adapter's input). The
base weights are frozen. The factors are sharded so that each rank's ``B A`` is exactly the shape of its own
shard of ``W``:

- column-parallel base (qkv, fc1: ``W`` split along its output rows): ``A`` replicated, ``B`` split like ``W``
  (rows). ``A x`` is computed on every rank; its gradient is summed over the TP group on the way back
  (megatron-core's ``copy_to_tensor_model_parallel_region``). Under sequence parallelism each rank holds its
  part of the sequence: ``A x`` is gathered over the sequence (``gather_from_sequence_parallel_region``) and
  ``A``'s gradient, which then covers this rank's tokens only, is marked ``sequence_parallel`` for megatron-core's
  ``finalize_model_grads`` to sum over TP, as the norms are.
- row-parallel base (proj, fc2: ``W`` split along its input columns): ``A`` split like ``W`` (columns), ``B``
  replicated. ``A x`` is a partial sum, reduced over TP (``reduce_from_tensor_model_parallel_region``, or
  ``reduce_scatter_to_sequence_parallel_region`` under sequence parallelism, where ``B``'s gradient is then
  per-token-shard and marked ``sequence_parallel``).

So a merged weight (:func:`merged_weight`: ``W + scale * B A``) is computed on each rank from its own tensors,
with no communication, and streams through the existing resharding plan like ``W``. An expert's linears run at
expert-TP 1 (megarl's MoE layout): their factors are whole on each rank and reduced over the expert-data-parallel
group as the expert weights are (``allreduce = False``).

In a checkpoint each factor is a global tensor in its weight's layout (a gated fc1's ``B`` as ``[gate; up]`` rows,
through megatron-core's swiglu factory, as the weight), so it loads at any TP size.

Initial factors depend only on the seed and the parameter's global name (drawn whole, then sliced), so any
TP/PP/EP layout starts from the same adapter. :func:`adapters_disabled` runs the base model (the reference).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megarl.engine.config import LoRAConfig
from megarl.models.adapters import LORA_A, LORA_B, MODULES
from megarl.models.provider import ScalarHead, global_named_parameters


class _LoRALinear:
    """Mixin placed before a megatron-core Column/RowParallelLinear class (instances are re-classed in place, so
    the base weight keeps its name, sharding and checkpoint key)."""

    lora_scale: float
    lora_dropout: float
    lora_column: bool  # the base is column-parallel
    lora_gated: bool  # the base is a gated MLP's fc1: [gate; up] rows, each half split over TP on its own

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        if _DISABLED.depth:
            return output, bias
        return output + self._lora(input_).to(output.dtype), bias

    def _lora(self, x: torch.Tensor) -> torch.Tensor:
        # in updates only: a trainable engine's forward-only passes (old log-probs, the reference) run in train
        # mode too, without a graph, and must be the deterministic model the rollout engine samples from
        if self.lora_dropout and self.training and torch.is_grad_enabled():
            x = F.dropout(x, self.lora_dropout)
        group = self.tp_group
        parallel = group.size() > 1 and not getattr(self, "explicit_expert_comm", False)
        z = F.linear(x, self.lora_A)
        if self.lora_column and parallel:
            z = (gather_from_sequence_parallel_region(z, group=group) if self.sequence_parallel
                 else copy_to_tensor_model_parallel_region(z, group=group))
        elif parallel:
            z = (reduce_scatter_to_sequence_parallel_region(z, group=group) if self.sequence_parallel
                 else reduce_from_tensor_model_parallel_region(z, group=group))
        return F.linear(z * self.lora_scale, self.lora_B)  # scaled at rank width, not at the output's

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        factors = {LORA_A: self.lora_A, LORA_B: self.lora_B}
        axis = {LORA_B: 0} if self.lora_column else {LORA_A: 1}
        sharded = make_sharded_tensors_for_checkpoint(factors, prefix, axis, sharded_offsets, tp_group=self.tp_group,
                                                      dp_cp_group=(metadata or {}).get("dp_cp_group"))
        if self.lora_gated:  # B's rows as the weight's (megatron-core's MLP): the global [gate; up] at any TP size
            key = f"{prefix}{LORA_B}"
            sharded[key] = apply_swiglu_sharded_factory(sharded[key], sharded_offsets,
                                                        (metadata or {}).get("singleton_local_shards", False))
        out.update(sharded)
        return out


_CLASSES: dict[type, type] = {}


def _lora_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"LoRA{cls.__name__}", (_LoRALinear, cls), {})
    return _CLASSES[cls]


class _Disabled:
    depth = 0


_DISABLED = _Disabled()


@contextlib.contextmanager
def adapters_disabled() -> Iterator[None]:
    """Every adapter of this process off: the base model (the reference policy of a LoRA run)."""
    _DISABLED.depth += 1
    try:
        yield
    finally:
        _DISABLED.depth -= 1


def add_adapters(model: torch.nn.Module, config: LoRAConfig, seed: int) -> int:
    """Give each targeted linear of one model chunk its factors (in place) and freeze everything else but a scalar
    head (a critic's or reward model's new value head trains whole, as peft's ``modules_to_save`` keeps a sequence
    classifier's ``score``); the number of adapted linears. The initial ``A`` of each is drawn from ``seed`` and
    the weight's global name."""
    global_names = {id(p): n for n, p in global_named_parameters(model)}
    head = getattr(model, "output_layer", None)
    keep = {id(p) for p in head.parameters()} if isinstance(head, ScalarHead) else set()
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)
    wanted = {MODULES[t].rsplit(".", 1)[-1] for t in config.targets}  # megatron-core's module names
    count = 0
    for module_name, module in list(model.named_modules()):
        suffix = module_name.rsplit(".", 1)[-1]
        if suffix in wanted and isinstance(module, ColumnParallelLinear | RowParallelLinear):
            gated = suffix == "linear_fc1" and module.config.gated_linear_unit
            _adapt(module, config, global_names[id(module.weight)].removesuffix(".weight"), seed, gated)
            count += 1
    return count


def _adapt(module: torch.nn.Module, config: LoRAConfig, name: str, seed: int, gated: bool) -> None:
    column = isinstance(module, ColumnParallelLinear)
    w = module.weight
    tp, rank = module.tp_group.size(), module.tp_group.rank()
    out_local, in_local = w.shape
    in_global = in_local * tp if not column else in_local
    # A [r, in] drawn whole (layout-independent), then this rank's columns for a row-parallel base
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(in_global)  # kaiming_uniform_(a=sqrt(5)) on [r, in], as peft
    a = torch.empty(config.rank, in_global, dtype=torch.float32).uniform_(-bound, bound, generator=gen)
    if not column:
        a = a.chunk(tp, dim=1)[rank]
    module.lora_A = torch.nn.Parameter(a.to(device=w.device, dtype=w.dtype).contiguous())
    module.lora_B = torch.nn.Parameter(torch.zeros(out_local, config.rank, dtype=w.dtype, device=w.device))
    split, whole = (module.lora_B, module.lora_A) if column else (module.lora_A, module.lora_B)
    set_tensor_model_parallel_attributes(split, True, 0 if column else 1, 1)
    # the whole factor's gradient covers this rank's tokens only under sequence parallelism: summed over TP
    whole.sequence_parallel = bool(module.sequence_parallel and tp > 1
                                   and not getattr(module, "explicit_expert_comm", False))
    for p in (module.lora_A, module.lora_B):
        p.allreduce = getattr(w, "allreduce", True)  # expert factors: reduced over the expert-data-parallel group
    module.lora_scale = config.scale
    module.lora_dropout = config.dropout
    module.lora_column = column
    module.lora_gated = gated
    module.__class__ = _lora_class(type(module))


def global_adapted_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(global name of its base weight, module) of each adapted linear of one model chunk."""
    owners = {id(m.weight): m for m in model.modules() if isinstance(m, _LoRALinear)}
    for name, p in global_named_parameters(model):
        if id(p) in owners:
            yield name, owners[id(p)]


def merged_weight(module: torch.nn.Module) -> torch.Tensor:
    """``W + scale * B A`` of this rank's shard (in ``W``'s dtype, computed in float32)."""
    delta = module.lora_B.detach().float() @ module.lora_A.detach().float()
    return (module.weight.detach().float() + module.lora_scale * delta).to(module.weight.dtype)


class MergedParameters(Mapping):
    """Global name -> this rank's shard, as ``params`` of the resharding plan (``params``: the model's, no factor),
    with each adapted weight merged on access (one merged tensor at a time: the plan reads one parameter after
    another)."""

    def __init__(self, params: Mapping[str, torch.Tensor], modules: Mapping[str, torch.nn.Module]) -> None:
        self._params = params
        self._modules = modules  # global base-weight name -> adapted module

    def __getitem__(self, name: str) -> torch.Tensor:
        module = self._modules.get(name)
        return self._params[name] if module is None else merged_weight(module)

    def __iter__(self):
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)
