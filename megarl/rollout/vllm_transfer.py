"""megarl's backend for vLLM's weight-transfer engine: checkpoint-format tensors handed over in process.

vLLM (>= 0.16) updates a live engine's weights through a *weight-transfer engine* chosen by
``weight_transfer_config.backend`` and driven by the worker methods ``init_weight_transfer_engine`` /
``start_weight_update`` / ``update_weights`` / ``finish_weight_update``. Its built-in backends move
tensors over NCCL or CUDA IPC; a colocated megarl worker already holds the tensors in the same process
(``external_launcher``: vLLM's worker *is* this process, and ``collective_rpc`` passes arguments by
reference), so this backend only loads them. It is registered under :data:`BACKEND` by
:func:`register` and built by vLLM inside its worker.

A session is vLLM's *layerwise reload* (vllm/model_executor/model_loader/reload/layerwise.py): the start
puts every layer on the meta device and wraps its weight loaders; ``load_weights`` buffers each layer's
checkpoint tensors until the layer is complete, then materialises it, loads it, runs the layer's
``process_weights_after_loading`` (on CPU: the oneDNN repack of every linear weight; for quantized
layers: the quantization) and copies the result into the original storage (CUDA-graph and sleep-pool
addresses stay valid); the finish processes what is left (attention layers) and restores layers that
received nothing. So the same code is correct on CPU and GPU, whatever the kernel format.

Imports vLLM at module level: only vLLM's factory (inside the worker) and :func:`register` import it.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

BACKEND = "megarl_in_process"


@dataclasses.dataclass
class InProcessInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: sender and receiver are one process."""


@dataclasses.dataclass
class InProcessUpdateInfo(WeightTransferUpdateInfo):
    weights: list[tuple[str, torch.Tensor]]  # full HF (checkpoint-format) tensors of whole layers


class InProcessWeightTransfer(WeightTransferEngine[InProcessInitInfo, InProcessUpdateInfo]):
    """Loads checkpoint-format tensors given by reference inside one layerwise-reload session."""

    init_info_cls = InProcessInitInfo
    update_info_cls = InProcessUpdateInfo

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.loaded: set[str] = set()  # vLLM parameter names loaded in this session

    def init_transfer_engine(self, init_info: InProcessInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        self.loaded = set()
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: InProcessUpdateInfo) -> None:
        loaded = self.model.load_weights(update_info.weights)
        if loaded is None:
            raise RuntimeError(f"{type(self.model).__name__}.load_weights does not report the parameters it "
                               "loaded, so a sync's coverage cannot be checked")
        self.loaded |= set(loaded)

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)
        reprocess_tied_modules(self.model)
        repack_cpu_experts(self.model)

    def shutdown(self) -> None:
        pass


def reprocess_tied_modules(model: torch.nn.Module) -> None:
    """Re-run ``process_weights_after_loading`` on every module that shares a parameter with another.

    With tied embeddings, ``lm_head`` and ``embed_tokens`` own one parameter, but the layer-wise reload
    loads and processes only ``embed_tokens`` (the loader skips ``lm_head.weight``). On CPU the head's
    processing packs a private oneDNN copy of the weight for its matmul, so without this the head keeps
    computing logits from the weights of the *previous* sync (measured: every greedy token wrong). On CUDA
    the embedding's processing is a no-op, and so is this.
    """
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)
    for modules in owners.values():
        for module in modules if len(modules) > 1 else ():
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)


def repack_cpu_experts(model: torch.nn.Module) -> None:
    """Redo the CPU fused-MoE kernel's prepacking of every expert layer after a weight update.

    vLLM's unquantized MoE method sets its kernel up on the first load only: the prepack of ``w13_weight`` /
    ``w2_weight`` into the CPU grouped-gemm layout (``CPUUnquantizedExperts.process_weights_after_loading``)
    runs then, and a later reload copies the new weights *unpacked* into the packed storage, which the CPU
    kernel then reads as packed (measured on vLLM 0.32: every greedy token of a synced Qwen3-MoE wrong, while
    the same weights loaded from disk match transformers). CUDA's kernels read the unpacked layout, so this
    only acts on CPU.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)


def register() -> None:
    """Make :data:`BACKEND` known to vLLM's factory (idempotent; lazy: the factory imports this module)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    with contextlib.suppress(ValueError):  # "already registered": an earlier engine in this process did it
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, InProcessWeightTransfer.__name__)
