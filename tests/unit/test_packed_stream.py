"""A micro-batch's packed stream (megarl/engine/packing.py) by hand, without a process group: where each row's tokens
go, the alignment rules, what megatron-core / Transformer Engine are given (``PackedSeqParams``), and the way back."""

import torch

from megarl.engine.micro_batches import Alignment
from megarl.engine.packing import PACKING, Packing, rows_of


def _rows(lengths, width):
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.arange(1, n + 1) + 10 * (i + 1)
    return ids


def test_stream_layout_and_targets_by_hand():
    ids = _rows([3, 1, 2], 3)  # rows 11 12 13 / 21 / 31 32
    p = Packing.of(ids, [3, 1, 2])
    assert p.offsets == [0, 3, 4, 6]
    assert p.tokens.tolist() == [[11, 12, 13, 21, 31, 32]]
    assert p.targets.tolist() == [[12, 13, 21, 31, 32, 32]]  # the next token in the stream (last: itself, unused)
    assert p.positions.tolist() == [[0, 1, 2, 0, 0, 1]]  # RoPE restarts for every sequence
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0], [1, 1, 0]])
    assert p.model_view(mask).tolist() == [[1.0] * 6]
    back = rows_of(p.model_view(ids.float() * 2), {PACKING: p})
    assert torch.equal(back, ids.float() * 2)  # beyond each row's length: 0, as the rows had


def test_sequence_parallel_pads_the_stream_and_cp_every_sequence():
    ids = _rows([5, 2, 4], 5)
    sp = Packing.of(ids, [5, 2, 4], Alignment(multiple=4))  # TP 4 with sequence parallelism: 11 -> 12 tokens
    assert sp.offsets == [0, 5, 7, 12] and sp.tokens.shape == (1, 12)
    assert sp.tokens[0, 11].item() == 0  # padding: id 0, after the last sequence's real tokens
    cp = Packing.of(ids, [5, 2, 4], Alignment(align=4))  # CP 2: every extent a multiple of 2 x 2
    assert cp.offsets == [0, 8, 12, 16]
    params = cp.seq_params(torch.device("cpu"))
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.dtype == torch.int32 and params.cu_seqlens_q_padded.dtype == torch.int32
    assert params.cu_seqlens_q.tolist() == [0, 5, 7, 11]  # real lengths (Transformer Engine's cu_seqlens)
    assert params.cu_seqlens_q_padded.tolist() == [0, 8, 12, 16]  # extents (RoPE, TE's CP, the CPU attention)
    assert params.cu_seqlens_kv.tolist() == [0, 5, 7, 11] and params.cu_seqlens_kv_padded.tolist() == [0, 8, 12, 16]
    assert params.max_seqlen_q == params.max_seqlen_kv == 8
    assert params.cp_group is None  # TE keeps the attention's own CP group


def test_unpack_is_differentiable_into_the_rows():
    ids = _rows([2, 3], 3)
    p = Packing.of(ids, [2, 3])
    stream = torch.arange(5.0, requires_grad=True)
    rows = p.unpack(stream[None])
    assert rows.tolist() == [[0.0, 1.0, 0.0], [2.0, 3.0, 4.0]]
    (rows * torch.tensor([[1.0, 2, 3], [4, 5, 6]])).sum().backward()
    assert stream.grad.tolist() == [1.0, 2.0, 4.0, 5.0, 6.0]
