"""Packed micro-batches: a micro-batch's rows laid end to end in one token stream (megatron-core's THD format).

Batches arrive as right-padded rows [b, s]. Without packing each micro-batch is cut to its longest row and every
shorter row's padding is computed; with packing (``EngineConfig.packing``, the default) the model sees only the
rows' real tokens, one sequence after another ([1, T], T = the sum of the lengths), and megatron-core's
``PackedSeqParams`` (``cu_seqlens``) keep attention and rotary positions within each sequence. The loss and
output functions still see right-padded rows: :func:`rows_of` scatters the model's per-token outputs back into
[b, w] rows, and :func:`row_log_probs` computes token log-probs on the packed stream and returns them per row,
so every role's loss (sequence sums, pairs, last-token scores) is unchanged.

Alignment: each sequence's extent in the stream is its length rounded up to ``align`` (context parallelism
splits every sequence into 2 cp chunks; 1 otherwise), and the last sequence's extent absorbs the padding that
makes T a multiple of ``multiple`` (sequence parallelism splits T over the TP ranks). Padding tokens are id 0,
attend only within their sequence's extent, come after its real tokens (so no real token sees them), and are
dropped on the way back.

With context parallelism each rank computes its share of the stream (:mod:`megarl.models.context_parallel`); the
per-token outputs are gathered over the CP group before they become rows, so every CP rank computes the whole
loss, and its backward reaches this rank's share only (the engine scales for the CP ranks' gradient average).

Imports torch and megatron-core (``PackedSeqParams``, the gather along the sequence); owns no process group.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from megarl.engine.micro_batches import UNALIGNED, Alignment
from megarl.engine.vocab_parallel import token_log_probs, vocab_parallel_log_prob_entropy
from megarl.models.context_parallel import cp_token_index

PACKING = "packing"  # a packed micro-batch's key for its :class:`Packing` (absent: the rows are the model's input)


@dataclasses.dataclass
class Packing:
    """Where the rows of one micro-batch lie in its packed stream, and this rank's share of it. ``offsets[i]``: row
    i's first token in the stream (``offsets[-1]`` = T); row i's real tokens are ``lengths[i]`` from there, the rest
    of its extent padding. With context parallelism (``cp_group`` of more than one rank) the model sees only this
    rank's tokens ``local`` (megatron-core's load-balanced chunks of every sequence, in its order)."""

    lengths: list[int]
    offsets: list[int]
    width: int  # the rows' width in the loss function's view (their longest)
    rows: torch.Tensor  # [N] row of each real token
    cols: torch.Tensor  # [N] its position in the row
    stream: torch.Tensor  # [N] its position in the stream
    tokens: torch.Tensor  # [1, t] the model's input ids (t = T, or T / cp: this rank's)
    targets: torch.Tensor  # [1, t] the token after each in the stream (what its logits predict)
    positions: torch.Tensor  # [1, t] each token's position within its sequence
    local: torch.Tensor | None = None  # [t] the stream positions this CP rank holds (None: all)
    order: torch.Tensor | None = None  # [T] the CP ranks' tokens, gathered rank after rank, back in stream order
    cp_group: Any = None

    @classmethod
    def of(cls, input_ids: torch.Tensor, lengths: list[int], alignment: Alignment = UNALIGNED,
           cp_group=None) -> Packing:
        """``input_ids`` [b, w]: the rows (right-padded, ``lengths`` real tokens each), laid out in the extents of
        ``alignment``."""
        extents = alignment.extents(lengths)
        offsets = [0, *itertools.accumulate(extents)]
        rows = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lengths)])
        cols = torch.cat([torch.arange(n) for n in lengths])
        stream = torch.cat([torch.arange(o, o + n) for o, n in zip(offsets, lengths, strict=False)])
        device = input_ids.device
        ids = input_ids.new_zeros(offsets[-1])
        ids[stream.to(device)] = input_ids[rows.to(device), cols.to(device)]
        following = torch.cat([ids[1:], ids[-1:]])
        positions = torch.cat([torch.arange(e) for e in extents]).to(device)
        cp = 1 if cp_group is None else cp_group.size()
        local = order = None
        if cp > 1:
            shares = [cp_token_index(offsets, cp, r) for r in range(cp)]
            local = shares[cp_group.rank()].to(device)
            order = torch.cat(shares).argsort().to(device)
            ids, following, positions = ids[local], following[local], positions[local]
        return cls(list(lengths), offsets, input_ids.shape[1], rows, cols, stream, ids[None], following[None],
                   positions[None], local, order, cp_group if cp > 1 else None)

    @property
    def total(self) -> int:
        """T: the whole stream's tokens (over every CP rank)."""
        return self.offsets[-1]

    def model_view(self, x: torch.Tensor) -> torch.Tensor:
        """Rows [b, w, ...] -> the model's input layout [1, t, ...]: this rank's tokens of the stream, padding zero."""
        out = x.new_zeros((self.total, *x.shape[2:]))
        out[self.stream.to(x.device)] = x[self.rows.to(x.device), self.cols.to(x.device)]
        return (out if self.local is None else out[self.local.to(x.device)]).unsqueeze(0)

    def gather(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's per-token [1, t, ...] -> the whole stream [1, T, ...] (every CP rank's, in stream order). Its
        gradient is this rank's share: every CP rank computes the same loss of the whole stream."""
        if self.cp_group is None:
            return y
        whole = gather_from_sequence_parallel_region(y.squeeze(0), tensor_parallel_output_grad=False,
                                                     group=self.cp_group)
        return whole[self.order.to(y.device)].unsqueeze(0)

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """The whole stream [1, T, ...] -> rows [b, width, ...], zero beyond each row's length (differentiable)."""
        y = y.squeeze(0)
        index = (self.rows.to(y.device), self.cols.to(y.device))
        out = y.new_zeros((len(self.lengths), self.width, *y.shape[1:]))
        return out.index_put(index, y[self.stream.to(y.device)])

    def seq_params(self, device: torch.device):
        """megatron-core's ``PackedSeqParams`` (THD): ``cu_seqlens_*`` the real lengths' boundaries (as Transformer
        Engine's attention takes them), ``cu_seqlens_*_padded`` the extents' (what RoPE, Transformer Engine's
        context parallelism and megarl's CPU attention use); the whole stream's, at any CP size. No ``cp_group``: the
        attention's own (megatron-core's CP group) applies; given, Transformer Engine would re-register it each call."""
        from megatron.core.packed_seq_params import PackedSeqParams

        real = torch.tensor([0, *itertools.accumulate(self.lengths)], dtype=torch.int32, device=device)
        padded = torch.tensor(self.offsets, dtype=torch.int32, device=device)
        longest = max(b - a for a, b in itertools.pairwise(self.offsets))
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=padded,
                               cu_seqlens_kv_padded=padded, max_seqlen_q=longest, max_seqlen_kv=longest)


def rows_of(output: torch.Tensor, mb: dict) -> torch.Tensor:
    """The model's per-token ``output`` as rows [b, w, ...] (a padded micro-batch's output already is)."""
    packing = mb.get(PACKING)
    return output if packing is None else packing.unpack(packing.gather(output))


def row_log_probs(logits: torch.Tensor, mb: dict, *, vocab_size: int, temperature: float = 1.0,
                  group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~megarl.engine.vocab_parallel.token_log_probs` per row [b, w] of micro-batch ``mb``, from the
    model's vocabulary-parallel ``logits`` (rows [b, w, V_local], or a packed stream [1, t, V_local]): token i's
    log-prob and entropy given the tokens before it in its row, 0 at position 0 and beyond the row's length."""
    packing = mb.get(PACKING)
    if packing is None:
        return token_log_probs(logits, mb["input_ids"], vocab_size=vocab_size, temperature=temperature, group=group)
    lp, ent = vocab_parallel_log_prob_entropy(logits, packing.targets, vocab_size=vocab_size,
                                              temperature=temperature, group=group)
    out = []
    for x in (packing.gather(lp), packing.gather(ent)):  # position i: of token i + 1
        # a sequence's first token is then scored after the one before it in the stream, another sequence's
        rows = packing.unpack(torch.cat([x.new_zeros(1, 1), x[:, :-1]], dim=1))
        out.append(torch.cat([rows.new_zeros(rows.shape[0], 1), rows[:, 1:]], dim=1))
    return out[0], out[1]
