"""A Transformer-Engine-shaped stand-in for CPU tests: a module given extra state the way TE's modules have it.

TE (CUDA-only) modules, its norms and linears alike, define ``get_extra_state``/``set_extra_state`` (FP8
scaling metadata serialised into a uint8 tensor), which megatron-core checkpoints as a ``ShardedObject``
under ``<module>._extra_state``. :func:`add_extra_state` gives one module of a megatron-core model built
here such a pair, so that its sharded state dict carries the entry a TE build would; the module counts the
values it is loaded with. Imports torch only.
"""

from __future__ import annotations

import functools

import torch


class _ExtraState:
    extra_state: torch.Tensor
    extra_state_loads: int

    def get_extra_state(self) -> torch.Tensor:
        return self.extra_state

    def set_extra_state(self, state: object) -> None:
        self.extra_state = state
        self.extra_state_loads += 1


@functools.cache
def _with_extra_state(cls: type) -> type:
    return type(f"{cls.__name__}WithExtraState", (_ExtraState, cls), {})


def add_extra_state(module: torch.nn.Module, value: torch.Tensor) -> None:
    """Give ``module`` extra state ``value`` (in place: its class becomes a subclass with the pair)."""
    module.__class__ = _with_extra_state(type(module))
    module.extra_state = value
    module.extra_state_loads = 0
