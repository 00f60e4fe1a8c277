"""transformers' ``padding_idx`` on megatron-core's vocabulary-parallel input embedding.

transformers builds the input embedding of every family megarl supports as
``nn.Embedding(vocab, hidden, padding_idx=config.pad_token_id)``: the pad row is looked up like any other, but
the lookup adds nothing to that row's gradient. megatron-core's ``VocabParallelEmbedding`` has no such setting,
so a policy that samples the pad token inside a response would train that row where transformers (and the
trainers built on it) does not. :func:`use_padding_idx` restores transformers' behaviour: the embedding's output
is detached at the positions whose input id is the pad id. The forward is unchanged; only the lookup's gradient
of the pad row is removed, so a tied LM head still gives the row its output-side gradient, as in transformers
(docs/resharding.md §1.7).

Installed on the ``VocabParallelEmbedding`` of the first pipeline stage (the only one with an embedding), it
holds at any layout: with the vocabulary split over tensor-parallel ranks every rank's output is the all-reduced
embedding of the whole sequence, ``[b, s, h]``, and every rank detaches the same positions; with sequence
parallelism the output is reduce-scattered inside the embedding into this rank's part of the sequence,
``[s / tp, b, h]``, and the rank detaches the pad positions of that part (the backward all-gathers the gradient,
zero at every pad position). Imports only torch: the module it hooks is given to it.
"""

from __future__ import annotations

import functools

import torch


def use_padding_idx(embedding: torch.nn.Module, padding_idx: int) -> None:
    """Make ``embedding`` (a megatron-core ``VocabParallelEmbedding``) give row ``padding_idx`` no gradient from its
    lookup, as ``nn.Embedding(padding_idx=padding_idx)`` does."""
    embedding.register_forward_hook(functools.partial(_detach_pad_positions, padding_idx=padding_idx),
                                    with_kwargs=True)


def _detach_pad_positions(module: torch.nn.Module, args: tuple, kwargs: dict, output: torch.Tensor, *,
                          padding_idx: int) -> torch.Tensor | None:
    if not output.requires_grad:  # forward-only passes, frozen models
        return None
    input_ids = args[0] if args else kwargs["input_"]
    pad = input_ids == padding_idx  # [b, s]
    if module.reduce_scatter_embeddings:  # sequence parallelism: this rank's part of the sequence, [s / tp, b, h]
        group = module.tp_group
        # contiguous: torch.where lays its result out like a transposed mask, and a pipeline stage sends only
        # contiguous tensors
        pad = pad.t().contiguous().chunk(group.size())[group.rank()]
    if pad.shape != output.shape[:-1]:
        raise RuntimeError(f"the input embedding's output has shape {list(output.shape)}, which does not match the "
                           f"pad positions' {list(pad.shape)}: megatron-core's VocabParallelEmbedding changed its "
                           "output layout; update megarl/models/padding_idx.py")
    return torch.where(pad.unsqueeze(-1), output.detach(), output)
