"""Router statistics of an MoE model's updates: per-expert token loads and the load-balancing loss.

:class:`RouterStats` hooks every megatron-core router of one rank's model chunks and counts, during an
update, how many real tokens (padding excluded, from each micro-batch's attention mask) each layer
sends to each expert. :meth:`RouterStats.metrics` reduces the counts over data and pipeline parallel
ranks (tensor-parallel ranks route the same tokens; with sequence parallelism each routes its part of the
sequence, and the counts are summed over them too) and returns:

- ``moe_load_max``, ``moe_load_min``: the largest and smallest share of a layer's routed tokens an
  expert received, over all layers and experts, relative to an even split (1.0 = balanced,
  ``num_experts`` = one expert took every token);
- ``moe_load_balancing_loss``: megatron-core's auxiliary load-balancing loss (switch-transformer form,
  ``E / (k T^2) * sum_e tokens_e * sum_t p_e(t)`` over a micro-batch's T real tokens: the engine hands the
  router the padding mask), averaged over layers, micro-batches and DP ranks, before its coefficient; present
  only when the coefficient (``moe_aux_loss_coef``) is non-zero, since megatron-core computes it only then;
- with the rollout's recorded routing in the batch (``routed_experts`` [b, s, layers, k]):
  ``moe_routing_disagreement``, the share of (token, layer) pairs whose top-k expert set, computed by this
  model from the layer's router input, differs from the rollout's (tokens the rollout engine fed: real
  tokens followed by another); with router replay also ``moe_replay_mismatch``, how many of those pairs
  the router did not route to the rollout's experts (0: replay forces every token).

Router replay (rollout routing replay, R3; ``router_replay``): every forward of the engine, not only
updates, routes each token to the rollout's recorded experts through megatron-core's ``RouterReplay``
(``moe_enable_routing_replay``), the weights of those experts still coming from this model's router.

Imports megatron-core; used by :class:`megarl.engine.engine.MegatronEngine`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from megarl.models.spec import ModelSpec
from megarl.parallel import collectives

_AUX = "load_balancing_loss"  # megatron-core's tracker name for the aux_loss term


class RouterStats:
    def __init__(self, chunks: list[torch.nn.Module], spec: ModelSpec, groups, aux_loss_coef: float,
                 replay: bool = False, sequence_parallel: bool = False) -> None:
        assert spec.moe is not None
        self.groups, self.aux_loss_coef, self.replay, self.top_k = groups, aux_loss_coef, replay, spec.moe.top_k
        self.sequence_parallel = sequence_parallel  # each TP rank's routers see its part of the sequence
        self.counts = torch.zeros(spec.num_layers, spec.moe.num_experts, dtype=torch.float64)
        self.compared = torch.zeros(3, dtype=torch.float64)  # differing pairs, compared pairs, replay misses
        self.mask: torch.Tensor | None = None  # the current micro-batch's real tokens, in the router's order
        self.routed: torch.Tensor | None = None  # its rollout routing [tokens, layers, k], same order
        self.fed: torch.Tensor | None = None  # tokens the rollout engine fed (whose routing it recorded)
        self.active = False
        self.routers = []
        for chunk in chunks:
            for layer in chunk.decoder.layers:
                router = getattr(layer.mlp, "router", None)
                if router is not None:
                    router.register_forward_hook(self._hook(layer.layer_number - 1))
                    self.routers.append((layer.layer_number - 1, router))

    def _hook(self, layer: int):
        def count(module, inputs, output) -> None:
            if not self.active or self.mask is None:
                return
            _, routing_map = output  # [tokens, experts], tokens sequence-major like the layer's input
            self.counts[layer] += routing_map[self.mask].sum(0, dtype=torch.float64).cpu()
            if self.routed is None:
                return
            target = self.routed[:, layer]
            with torch.no_grad():  # this model's own choice, from the router's input and weights (fp32)
                hidden = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
                own = F.linear(hidden, module.weight.float()).topk(self.top_k, dim=-1).indices
            differ = (own.sort(-1).values != target.sort(-1).values).any(-1)
            self.compared[0] += differ[self.fed].sum().item()
            self.compared[1] += self.fed.sum().item()
            if self.replay:
                wanted = torch.zeros_like(routing_map).scatter_(1, target, True)
                self.compared[2] += (routing_map != wanted).any(-1)[self.fed].sum().item()
        return count

    def set_micro_batch(self, real: torch.Tensor, fed: torch.Tensor, routed_experts: torch.Tensor | None) -> None:
        """The micro-batch about to run, each tensor laid out as the model's input [b, s] (rows, or one packed
        stream; megatron's layers see [s, b], with sequence parallelism this TP rank's part of s): ``real`` its real
        tokens, ``fed`` those the rollout engine fed (a real token followed by another: whose routing it recorded)
        and, when the batch carries it, the rollout's routing [b, s, layers, k], which replay forces on every
        router."""
        self.mask = self._tokens(real).bool()
        if routed_experts is None:
            if self.replay:
                raise ValueError("router replay is on but the batch carries no routed_experts: the rollout engine "
                                 "did not record its routing (docs/moe.md)")
            self.routed = self.fed = None
            return
        self.routed = self._tokens(routed_experts).long()
        self.fed = self._tokens(fed).bool()
        if self.replay:
            for layer, router in self.routers:
                router.router_replay.clear_indices()
                router.router_replay.set_target_indices(self.routed[:, layer])
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def _tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[b, s, ...] -> the tokens this rank's routers see, sequence-major: [s * b, ...], or with sequence
        parallelism [s/tp * b, ...] of this TP rank's part of the sequence (megatron-core's split)."""
        x = x.transpose(0, 1)
        if self.sequence_parallel:
            x = x.chunk(self.groups.tp.size(), dim=0)[self.groups.tp.rank()]
        return x.reshape(-1, *x.shape[2:])

    def end_pass(self) -> None:
        """After a pass: no replay targets left behind for the next caller of the model."""
        for _, router in self.routers:
            if router.router_replay is not None:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()
        self.routed = self.fed = None

    def begin(self) -> None:
        self.counts.zero_()
        self.compared.zero_()
        moe_utils.clear_aux_losses_tracker()
        self.active = True

    def metrics(self, num_microbatches: int) -> dict[str, float]:
        """Collective over this engine's data- and pipeline-parallel groups."""
        self.active = False
        # host statistics reduced on the collective device (NCCL takes no CPU tensor): see parallel/collectives.py
        over = (self.groups.dp, self.groups.pp)  # each stage filled its own layers' rows
        if self.sequence_parallel:  # each TP rank counted (and its routers saw) its part of the sequence
            over += (self.groups.tp,)
        if self.groups.cp.size() > 1:  # so did each context-parallel rank
            over += (self.groups.cp,)
        counts = collectives.sum_over(self.counts.clone(), *over)
        routed = counts.sum(-1, keepdim=True)
        share = counts / routed.clamp(min=1.0) * counts.shape[-1]
        used = routed.squeeze(-1) > 0
        out = {}
        if used.any():
            out["moe_load_max"] = share[used].max().item()
            out["moe_load_min"] = share[used].min().item()
        compared = collectives.sum_over(self.compared.clone(), *over)
        if compared[1] > 0:
            out["moe_routing_disagreement"] = (compared[0] / compared[1]).item()
            if self.replay:
                out["moe_replay_mismatch"] = compared[2].item()
        tracker = moe_utils.get_moe_layer_wise_logging_tracker().get(_AUX)  # process-wide, shared by engines
        if tracker is not None and self.aux_loss_coef > 0:
            # per layer, summed over micro-batches; a TP rank's value has its own tokens' probabilities
            values = collectives.sum_over(tracker["values"].detach().double().cpu(), *over)
            layers = len(values)
            out["moe_load_balancing_loss"] = values.sum().item() / (layers * num_microbatches * self.groups.dp.size())
        return out
