"""Packed and context-parallel causal attention (values and gradients) against a float64 dense reference.

One spawned world of 2 gloo ranks (the context-parallel group is the world). The reference is dense
attention over the whole packed stream with an explicit block-diagonal causal mask and repeated KV heads,
computed by hand on every rank. Checked there: :func:`packed_causal_attention` on the whole stream (output
and q/k/v gradients for a random upstream gradient); :func:`context_parallel_attention` at CP2, each rank's
output and q/k/v gradients (k/v reduce-scattered by megatron-core's collective) against the reference's rows
at :func:`cp_token_index`; that index against megatron-core's own THD CP split of RoPE positions
(``_get_thd_freqs_on_this_cp_rank``) and a hand-worked case, and that the ranks' indices form a permutation.
Negative control: plain causal attention over the stream (segments not isolated) is far from the reference.
"""

from __future__ import annotations

import pytest
import torch

from megarl.testing.dist import run_world

pytestmark = pytest.mark.dist

LENGTHS = (8, 12, 0, 4, 16)  # multiples of 2 * cp = 4 (padded); an empty segment is skipped
OFFSETS = [sum(LENGTHS[:i]) for i in range(len(LENGTHS) + 1)]
HQ, HK, D, SCALE = 4, 2, 8, 0.3  # GQA: two query heads per KV head; a scale that is not 1/sqrt(D)
TOL = 1e-12


def _inputs():
    g = torch.Generator().manual_seed(7)
    t = OFFSETS[-1]
    q, dout = (torch.randn(t, HQ, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(t, HK, D, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, dout


def _dense(q, k, v, dout, block_diagonal=True):
    """softmax(q k^T * scale + mask) v over the whole stream, KV heads repeated; and its q/k/v gradients."""
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    t = q.size(0)
    segment = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    pos = torch.arange(t)
    allowed = pos[None, :] <= pos[:, None]
    if block_diagonal:
        allowed &= segment[None, :] == segment[:, None]
    kr, vr = (x.repeat_interleave(HQ // HK, dim=1) for x in (k, v))  # query head h reads KV head h // (HQ / HK)
    scores = torch.einsum("qhd,khd->hqk", q, kr) * SCALE
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    out = torch.einsum("hqk,khd->qhd", probs, vr)
    (out * dout).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _max_errors(got, want, rows=None):
    return [float((g - (w if rows is None else w[rows])).abs().max()) for g, w in zip(got, want, strict=True)]


def _world(rank, world_size):
    import torch.distributed as dist
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    from megarl.models.context_parallel import context_parallel_attention, cp_token_index, packed_causal_attention
    from megarl.parallel import cpu_compat
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    # megatron-core's gathers allocate on torch.cuda.current_device(), in forward and in backward: the CPU
    # redirection the engine's layers run them under
    init_distributed(ParallelLayout.for_world(world_size))
    cpu_compat.redirect_sequence_parallel()
    group = dist.group.WORLD
    q, k, v, dout = _inputs()
    ref = _dense(q, k, v, dout)
    out = {"control": float((_dense(q, k, v, dout, block_diagonal=False)[0] - ref[0]).abs().max())}

    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    packed = packed_causal_attention(*leaves, OFFSETS, SCALE)
    (packed * dout).sum().backward()
    out["packed"] = _max_errors([packed.detach()] + [x.grad for x in leaves], ref)

    idx = cp_token_index(OFFSETS, world_size, rank)
    leaves = [x[idx].clone().requires_grad_(True) for x in (q, k, v)]
    local = context_parallel_attention(*leaves, OFFSETS, SCALE, group)
    (local * dout[idx]).sum().backward()
    out["cp"] = _max_errors([local.detach()] + [x.grad for x in leaves], ref, rows=idx)

    # megatron-core's own split: RoPE positions 0..t-1 (as "freqs") cut per segment for this CP rank
    positions = torch.arange(OFFSETS[-1])
    mcore = [_get_thd_freqs_on_this_cp_rank(rank, world_size, torch.empty(n // world_size), positions, offset=s)
             for s, n in zip(OFFSETS[:-1], LENGTHS, strict=True) if n]
    out["mcore_index"] = torch.cat(mcore).tolist()
    out["index"] = idx.tolist()
    out["small_index"] = cp_token_index([0, 8, 12], world_size, rank).tolist()
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(_world, 2, timeout_s=120)


def test_packed_attention_matches_dense_reference(results):
    for r in results:
        assert max(r["packed"]) < TOL, r["packed"]  # output, dq, dk, dv
        assert r["control"] > 0.1  # the segment mask matters for these inputs


def test_context_parallel_attention_matches_reference_rows(results):
    for r in results:
        assert max(r["cp"]) < TOL, r["cp"]  # output, dq, dk, dv at the rank's rows


def test_token_index_is_megatron_cores_split(results):
    assert [r["index"] for r in results] == [r["mcore_index"] for r in results]
    assert sorted(sum((r["index"] for r in results), [])) == list(range(OFFSETS[-1]))
    assert [r["small_index"] for r in results] == [[0, 1, 6, 7, 8, 11], [2, 3, 4, 5, 9, 10]]
