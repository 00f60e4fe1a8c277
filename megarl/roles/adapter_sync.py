"""Adapter-only LoRA sync, the training side: what a sync sends when ``rollout.engine.lora_sync=adapter``.

A LoRA policy's base weights are frozen, so the rollout engine needs them once; afterwards a sync is the adapter
alone (:mod:`megarl.rollout.vllm_lora`). :class:`AdapterSync` decides per sync whether the base weights go first
(the engine does not hold them yet, or lost them in a sleep that frees weights) and gathers the adapter: every
factor whole on every rank of the policy's model-parallel group (TP x PP of one data-parallel replica), from this
rank's shards (megarl/models/lora.py: ``B`` of a column-parallel base split like ``W``'s rows, ``A`` of a
row-parallel one like its columns, the other factor replicated). The factors are tiny (rank x width), so one
``all_gather_object`` carries them; each rank hosting an engine then holds the whole adapter, which vLLM slices to
its own TP rank itself. Split placement: training rank 0 sends the gathered adapter to every rollout rank over the
weight link, as one flat tensor in :func:`megarl.models.adapters.factor_shapes` order, which both sides compute
(:func:`send_adapter`, :func:`receive_adapter`; :mod:`megarl.roles.split`).

Uses torch.distributed and the policy's Megatron engine; no vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from megarl.engine.engine import MegatronEngine
from megarl.errors import ConfigError
from megarl.models import adapters, mapping
from megarl.models.provider import global_named_parameters
from megarl.models.spec import ModelSpec
from megarl.resharding.link import Message, WeightLink
from megarl.rollout.config import check_adapter_targets


class AdapterSync:
    """What one policy rank sends at each adapter-only sync."""

    def __init__(self, engine: MegatronEngine, spec: ModelSpec) -> None:
        if engine.lora is None:
            raise ConfigError("rollout.engine.lora_sync=adapter sends a LoRA policy's adapter, but the policy has no "
                              "adapters (policy.lora is null): set policy.lora or rollout.engine.lora_sync=merged.")
        check_adapter_targets(spec.moe is not None, engine.lora.targets, "the policy")
        self.engine, self.spec, self.lora = engine, spec, engine.lora
        self._maps = {m.mcore: m for m in adapters.adapted_maps(spec, self.lora.targets)}

    def gather(self) -> dict[str, torch.Tensor]:
        """Every factor of the adapter, global name -> the whole tensor (on the host), on every rank of the
        model-parallel group (collective over it)."""
        group = self.engine.groups.mp
        tp_rank = self.engine.groups.tp.rank()
        local = {n: p.detach().to("cpu", copy=True) for c in self.engine.chunks
                 for n, p in global_named_parameters(c) if adapters.is_adapter(n)}
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (tp_rank, local), group=group)
        shards: dict[str, dict[int, torch.Tensor]] = {}
        for rank, tensors in gathered:
            for name, t in tensors.items():
                shards.setdefault(name, {})[rank] = t
        out = {}
        tp = self.engine.layout.tp
        for name, by_tp in shards.items():
            m = self._maps[adapters.base_name(name)]
            if adapters.split_factor(m, name.rsplit(".", 1)[-1]):
                if sorted(by_tp) != list(range(tp)):
                    raise RuntimeError(f"factor {name}: shards from TP ranks {sorted(by_tp)}, expected 0..{tp - 1}")
                out[name] = mapping.tp_gather(m, [by_tp[r] for r in range(tp)])
            else:
                out[name] = by_tp[min(by_tp)]
        return out

    def peft(self, factors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The gathered ``factors`` in peft's layout (what the vLLM engine loads)."""
        return adapters.peft_adapter(self.spec, self.lora.targets, factors)


def streamed_weights(engine: MegatronEngine, adapter: AdapterSync | None,
                     base_held: bool) -> Mapping[str, torch.Tensor] | None:
    """What a sync streams through the resharding plan: the model (a LoRA policy's merged, :meth:`MegatronEngine.
    weights`), or with adapter sync (``adapter``) the base weights where the rollout engines do not hold them
    (``base_held``: their first sync, or a sleep dropped them), else nothing. Every rank of a plan must decide
    alike (its engines are built and synced together)."""
    if adapter is None:
        return engine.weights()
    return None if base_held else engine.weights(merged=False)


# the tag of the adapter's message on the weight link (the plan's slabs are tagged by their index in a bucket)
ADAPTER_TAG = 1 << 24


def send_adapter(link: WeightLink, factors: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, int]],
                 dtype: torch.dtype, device: str, peers: range) -> None:
    """Training rank 0 of a split placement: the gathered ``factors``, in ``shapes`` order (:func:`megarl.models.
    adapters.factor_shapes`, computed alike on both sides), as one ``dtype`` tensor to each rollout rank in
    ``peers`` (link ranks)."""
    flat = torch.cat([factors[name].reshape(-1).to(dtype) for name in shapes]).to(device)
    link.exchange([Message(True, flat, peer, ADAPTER_TAG) for peer in peers])


def receive_adapter(link: WeightLink, shapes: Mapping[str, tuple[int, int]], dtype: torch.dtype,
                    device: str) -> dict[str, torch.Tensor]:
    """A rollout rank of a split placement: the factors :func:`send_adapter` sent (from link rank 0)."""
    flat = torch.empty(sum(a * b for a, b in shapes.values()), dtype=dtype, device=device)
    link.exchange([Message(False, flat, 0, ADAPTER_TAG)])
    parts = flat.split([a * b for a, b in shapes.values()])
    return {name: part.reshape(shape) for (name, shape), part in zip(shapes.items(), parts, strict=True)}


def adapter_bytes(factors: Mapping[str, torch.Tensor]) -> int:
    """Bytes of an adapter's factors (what an adapter-only sync moves to each engine)."""
    return sum(t.numel() * t.element_size() for t in factors.values())
