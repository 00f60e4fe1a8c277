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

Imports torch and megatron-core's ``PackedSeqParams`` (a dataclass); no process group.
"""

from __future__ import annotations

import dataclasses

import torch

from megarl.engine.vocab_parallel import token_log_probs

PACKING = "packing"  # a packed micro-batch's key for its :class:`Packing` (absent: the rows are the model's input)


@dataclasses.dataclass
class Packing:
    """Where the rows of one micro-batch lie in its packed stream. ``offsets[i]``: row i's first token in the
    stream (``offsets[-1]`` = T); row i's real tokens are ``lengths[i]`` from there, the rest of its extent padding."""

    lengths: list[int]
    offsets: list[int]
    width: int  # the rows' width in the loss function's view (their longest)
    rows: torch.Tensor  # [N] row of each real token
    cols: torch.Tensor  # [N] its position in the row
    stream: torch.Tensor  # [N] its position in the stream
    tokens: torch.Tensor | None = None  # [1, T] the packed input ids (set by the engine)

    @classmethod
    def of(cls, lengths: list[int], width: int, *, align: int = 1, multiple: int = 1) -> Packing:
        extents = [max(-(-n // align) * align, align) for n in lengths]
        total = sum(extents)
        extents[-1] += -total % multiple
        offsets = [0]
        for e in extents:
            offsets.append(offsets[-1] + e)
        rows = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(lengths)])
        cols = torch.cat([torch.arange(n) for n in lengths])
        stream = torch.cat([torch.arange(o, o + n) for o, n in zip(offsets, lengths, strict=False)])
        return cls(list(lengths), offsets, width, rows, cols, stream)

    @property
    def total(self) -> int:
        return self.offsets[-1]

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """Rows [b, w, ...] -> stream [1, T, ...]; padding positions zero."""
        out = x.new_zeros((self.total, *x.shape[2:]))
        out[self.stream.to(x.device)] = x[self.rows.to(x.device), self.cols.to(x.device)]
        return out.unsqueeze(0)

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """Stream [1, T, ...] -> rows [b, width, ...], zero beyond each row's length (differentiable)."""
        y = y.squeeze(0)
        index = (self.rows.to(y.device), self.cols.to(y.device))
        out = y.new_zeros((len(self.lengths), self.width, *y.shape[1:]))
        return out.index_put(index, y[self.stream.to(y.device)])

    def positions(self) -> torch.Tensor:
        """[1, T]: each token's position within its sequence (padding continues its sequence's count)."""
        return torch.cat([torch.arange(b - a) for a, b in zip(self.offsets, self.offsets[1:], strict=False)])[None]

    def seq_params(self, device: torch.device):
        """megatron-core's ``PackedSeqParams`` (THD): ``cu_seqlens_*`` the real lengths' boundaries (as Transformer
        Engine's attention takes them), ``cu_seqlens_*_padded`` the extents' (what RoPE and megarl's CPU attention
        use)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        real = torch.tensor([0, *self.lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
        padded = torch.tensor(self.offsets, dtype=torch.int32, device=device)
        longest = max(b - a for a, b in zip(self.offsets, self.offsets[1:], strict=False))
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=padded,
                               cu_seqlens_kv_padded=padded, max_seqlen_q=longest, max_seqlen_kv=longest)


def rows_of(output: torch.Tensor, mb: dict) -> torch.Tensor:
    """The model's per-token ``output`` as rows [b, w, ...] (a padded micro-batch's output already is)."""
    packing = mb.get(PACKING)
    return output if packing is None else packing.unpack(output)


def row_log_probs(logits: torch.Tensor, mb: dict, *, vocab_size: int, temperature: float = 1.0,
                  group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~megarl.engine.vocab_parallel.token_log_probs` per row [b, w] of micro-batch ``mb``, from the
    model's vocabulary-parallel ``logits`` (rows [b, w, V_local], or a packed stream [1, T, V_local]): token i's
    log-prob and entropy given the tokens before it in its row, 0 at position 0 and beyond the row's length."""
    packing = mb.get(PACKING)
    if packing is None:
        return token_log_probs(logits, mb["input_ids"], vocab_size=vocab_size, temperature=temperature, group=group)
    lp, ent = token_log_probs(logits, packing.tokens, vocab_size=vocab_size, temperature=temperature,
                              group=group)
    # a sequence's first token was scored against the one before it in the stream: another sequence's
    lp, ent = packing.unpack(lp), packing.unpack(ent)
    zero = lp.new_zeros(lp.shape[0], 1)
    return torch.cat([zero, lp[:, 1:]], dim=1), torch.cat([zero, ent[:, 1:]], dim=1)
