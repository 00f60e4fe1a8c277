"""Router statistics of an MoE model's updates: per-expert token loads and the load-balancing loss.

:class:`RouterStats` hooks every megatron-core router of one rank's model chunks and counts, during an
update, how many real tokens (padding excluded, from each micro-batch's attention mask) each layer
sends to each expert. :meth:`RouterStats.metrics` reduces the counts over data and pipeline parallel
ranks (tensor-parallel ranks route the same tokens) and returns:

- ``moe_load_max``, ``moe_load_min``: the largest and smallest share of a layer's routed tokens an
  expert received, over all layers and experts, relative to an even split (1.0 = balanced,
  ``num_experts`` = one expert took every token);
- ``moe_load_balancing_loss``: megatron-core's auxiliary load-balancing loss (switch-transformer form,
  ``E / (k T^2) * sum_e tokens_e * sum_t p_e(t)``), averaged over layers, micro-batches and DP ranks,
  before its coefficient; present only when the coefficient (``moe_aux_loss_coef``) is non-zero, since
  megatron-core computes it only then.

Imports megatron-core; used by :class:`megarl.engine.engine.MegatronEngine`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer.moe import moe_utils

from megarl.models.spec import ModelSpec

_AUX = "load_balancing_loss"  # megatron-core's tracker name for the aux_loss term


class RouterStats:
    def __init__(self, chunks: list[torch.nn.Module], spec: ModelSpec, groups, aux_loss_coef: float) -> None:
        assert spec.moe is not None
        self.groups, self.aux_loss_coef = groups, aux_loss_coef
        self.counts = torch.zeros(spec.num_layers, spec.moe.num_experts, dtype=torch.float64)
        self.mask: torch.Tensor | None = None  # the current micro-batch's real tokens, in the router's order
        self.active = False
        for chunk in chunks:
            for layer in chunk.decoder.layers:
                router = getattr(layer.mlp, "router", None)
                if router is not None:
                    router.register_forward_hook(self._hook(layer.layer_number - 1))

    def _hook(self, layer: int):
        def count(module, inputs, output) -> None:
            if self.active and self.mask is not None:
                _, routing_map = output  # [tokens, experts], tokens sequence-major like the layer's input
                self.counts[layer] += routing_map[self.mask].sum(0, dtype=torch.float64).cpu()
        return count

    def set_micro_batch(self, attention_mask: torch.Tensor) -> None:
        """``attention_mask`` [b, s] of the micro-batch about to run (megatron's layers see [s, b])."""
        self.mask = attention_mask.t().reshape(-1).bool()

    def begin(self) -> None:
        self.counts.zero_()
        moe_utils.clear_aux_losses_tracker()
        self.active = True

    def metrics(self, num_microbatches: int) -> dict[str, float]:
        """Collective over this engine's data- and pipeline-parallel groups."""
        self.active = False
        counts = self.counts.clone()
        dist.all_reduce(counts, group=self.groups.dp)
        dist.all_reduce(counts, group=self.groups.pp)  # each stage filled its own layers' rows
        routed = counts.sum(-1, keepdim=True)
        share = counts / routed.clamp(min=1.0) * counts.shape[-1]
        used = routed.squeeze(-1) > 0
        out = {}
        if used.any():
            out["moe_load_max"] = share[used].max().item()
            out["moe_load_min"] = share[used].min().item()
        tracker = moe_utils.get_moe_layer_wise_logging_tracker().get(_AUX)  # process-wide, shared by engines
        if tracker is not None and self.aux_loss_coef > 0:
            values = tracker["values"].detach().double().cpu()  # per layer, summed over micro-batches
            dist.all_reduce(values, group=self.groups.pp)
            dist.all_reduce(values, group=self.groups.dp)
            layers = len(values)
            out["moe_load_balancing_loss"] = values.sum().item() / (layers * num_microbatches * self.groups.dp.size())
        return out
