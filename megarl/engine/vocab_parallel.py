"""Per-token log-probs and entropy from vocabulary-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for its slice of the (padded) vocabulary. One fused autograd
function computes, per token, ``log p(target)`` and the entropy of the softmax at a temperature, and
differentiates both exactly. Forward reads each rank's logits once, chunk by chunk (row max, then sum e^z
and sum e^z z relative to it while the chunk is in cache), then makes exactly two all-reduces over the
TP group per call, whatever the number of chunks (the max; then the sums, rescaled to the global max,
with the target logit; none at TP1).

Invariants:

- Memory: nothing of size [tokens, V_local] is created except the gradient in backward. The work is
  done in token chunks through reused float32 buffers of at most ``CHUNK_BYTES`` each (so glibc
  serves them from the heap, not from fresh page-faulting mmaps), and backward saves only the input
  logits (which the caller holds anyway) and a few floats per token; it recomputes p per chunk.
- Columns at or beyond the true vocabulary size (Megatron's padding, always a suffix of the last
  shards) are never read: they get zero probability and exactly zero gradient, so results match a
  model with the unpadded vocabulary. Targets must be below the true vocabulary size.
- Math is float32 whatever the logits' dtype (bf16 is cast per chunk); the gradient comes back in the
  logits' dtype. Only the entropy (log-prob) term of the gradient is computed when only the entropy
  (log-prob) output is differentiated.

This module imports torch.distributed (its reductions through :mod:`megarl.parallel.collectives`), no
megatron-core; it owns no process group (megatron-core's TP group is the default).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.parallel import collectives

# Size of one float32 [chunk tokens, V_local] work buffer (forward uses two, backward one or two).
# CPU: small enough to stay in L2/L3 and far below glibc's 32 MiB mmap threshold; large enough that the
# per-chunk op overhead is negligible (V=32000: 16 tokens a chunk; V=152k: 3).
# GPU: each chunk is ~6 kernel launches of ~5 us, so chunks must be large: with 2 MiB a 0.5B model's
# log-prob pass launched 80k kernels and kept the H200 34% busy; 256 MiB is ~440 tokens at V=152k.
CHUNK_BYTES = 2**21
CHUNK_BYTES_GPU = 2**28


def chunk_tokens(local_vocab: int, chunk_bytes: int | None = None, device: torch.device | None = None) -> int:
    """Tokens per chunk so that one float32 [chunk, local_vocab] buffer takes at most ``chunk_bytes``
    (default: ``CHUNK_BYTES``, or ``CHUNK_BYTES_GPU`` for logits on a GPU ``device``)."""
    if chunk_bytes is None:
        chunk_bytes = CHUNK_BYTES_GPU if device is not None and device.type == "cuda" else CHUNK_BYTES
    return max(1, chunk_bytes // (4 * max(1, local_vocab)))


def _shift(x: torch.Tensor, mx: torch.Tensor, temperature: float, out: torch.Tensor) -> torch.Tensor:
    """``out`` = (x - mx) / temperature in float32 (a bf16 ``x`` is promoted by the float32 ``mx``)."""
    torch.sub(x, mx, out=out)
    return out.div_(temperature) if temperature != 1.0 else out


def _local_stats(x: torch.Tensor, temperature: float, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``x`` [n, v], chunk by chunk, each chunk read from memory once: the row max ``mx`` and
    [sum e^z, sum e^z z] with z = (x - mx) / temperature. Rows of an empty ``x``: -inf and zeros."""
    n, v = x.shape
    mx, stats = torch.full((n,), float("-inf"), device=x.device), torch.zeros(3, n, device=x.device)
    if v == 0:
        return mx, stats
    zbuf, ebuf = mx.new_empty(min(rows, n), v), mx.new_empty(min(rows, n), v)
    for i in range(0, n, rows):
        j = min(i + rows, n)
        xc = x[i:j]
        mx[i:j] = xc.amax(dim=-1)
        z = _shift(xc, mx[i:j, None], temperature, zbuf[: j - i])
        e = torch.exp(z, out=ebuf[: j - i])
        torch.sum(e, dim=-1, out=stats[0, i:j])
        torch.sum(z.mul_(e), dim=-1, out=stats[1, i:j])
    return mx, stats


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start: int, vocab_size: int, temperature: float, rows: int, group):
        ctx.set_materialize_grads(False)
        x = logits.reshape(-1, logits.shape[-1])  # a view for contiguous logits
        n_valid = min(max(vocab_size - vocab_start, 0), x.shape[1])  # the padding is a suffix
        local_t = target.reshape(-1) - vocab_start
        in_shard = (local_t >= 0) & (local_t < n_valid)
        idx = local_t.clamp(0, max(n_valid - 1, 0))

        mx, stats = _local_stats(x[:, :n_valid], temperature, rows)  # stats[0:2] relative to the local max
        if group is not None and dist.get_world_size(group) > 1:
            local_mx = mx.clone()
            collectives.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
            # to the global max, with d = (mx - local_mx) / T >= 0:
            # sum e^(z-d) = e^-d sum e^z ;  sum e^(z-d) (z-d) = e^-d (sum e^z z - d sum e^z)
            d = (mx - local_mx) / temperature  # inf on a padding-only shard, whose sums are 0
            scale = torch.exp(-d)
            stats[1] = torch.where(stats[0] > 0, (stats[1] - d * stats[0]) * scale, 0.0)
            stats[0] *= scale
            t_z = _shift(x.gather(-1, idx[:, None]).squeeze(-1), mx, temperature, torch.empty_like(mx))
            stats[2] = torch.where(in_shard, t_z, 0.0)
            collectives.all_reduce(stats, group=group)
        else:
            stats[2] = _shift(x.gather(-1, idx[:, None]).squeeze(-1), mx, temperature, torch.empty_like(mx))
        sum_exp, sum_exp_z, t_z = stats
        lse = sum_exp.log()  # of the shifted logits
        log_prob = t_z - lse
        entropy = lse - sum_exp_z / sum_exp
        ctx.save_for_backward(logits, idx, in_shard, mx, sum_exp, lse, entropy)
        ctx.n_valid, ctx.temperature, ctx.rows = n_valid, temperature, rows
        shape = logits.shape[:-1]
        return log_prob.view(shape), entropy.view(shape)

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        nones = (None,) * 6
        if grad_log_prob is None and grad_entropy is None:
            return (None, *nones)
        logits, idx, in_shard, mx, sum_exp, lse, entropy = ctx.saved_tensors
        n_valid, temperature, rows = ctx.n_valid, ctx.temperature, ctx.rows
        x = logits.reshape(-1, logits.shape[-1])
        grad = torch.empty(x.shape, dtype=logits.dtype, device=logits.device)
        grad[:, n_valid:].zero_()
        # With z = (x - mx) / T, p_j = e^z_j / S, d log p_t / dz_j = [j=t] - p_j, dH/dz_j = -p_j (log p_j + H):
        # grad_j = (p_j (a + b (log p_j + H)) + [j=t] g_lp / T  with a = -g_lp / T, b = -g_H / T
        #        = e^z_j (c + b' z_j) + [j=t] g_lp / T  with c = (a + b (H - lse)) / S, b' = b / S,
        # so each chunk takes one shift, one exp and one or two fused multiply-adds (the unused term is skipped).
        a = None if grad_log_prob is None else grad_log_prob.reshape(-1).float() / -temperature
        b = None if grad_entropy is None else grad_entropy.reshape(-1).float() / -temperature
        inv_s = sum_exp.reciprocal()
        c = ((0.0 if a is None else a) + (0.0 if b is None else b * (entropy - lse))) * inv_s
        c, b = c[:, None], (None if b is None else (b * inv_s)[:, None])
        t_grad = None if a is None else torch.where(in_shard, -a, 0.0)[:, None]
        direct = grad.dtype == torch.float32  # compute in place in the gradient; else via a float32 buffer
        k = min(rows, x.shape[0])
        zbuf = None if direct else x.new_empty(k, n_valid, dtype=torch.float32)
        ebuf = None if b is None else x.new_empty(k, n_valid, dtype=torch.float32)
        for i in range(0, x.shape[0] if n_valid else 0, rows):
            j = min(i + rows, x.shape[0])
            out = grad[i:j, :n_valid]
            z = _shift(x[i:j, :n_valid], mx[i:j, None], temperature, out if direct else zbuf[: j - i])
            if b is None:
                z.exp_().mul_(c[i:j])
            else:
                e = torch.exp(z, out=ebuf[: j - i])
                torch.addcmul(c[i:j], z, b[i:j], out=z).mul_(e)
            if t_grad is not None:
                z.scatter_add_(-1, idx[i:j, None], t_grad[i:j])
            if not direct:
                out.copy_(z)
        return (grad.view(logits.shape), *nones)


def vocab_parallel_log_prob_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    group: dist.ProcessGroup | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) per position from this rank's vocabulary shard of ``logits / temperature``.

    ``logits``: [..., V_local] (rank r holds columns [r*V_local, (r+1)*V_local) of the padded vocab),
    best contiguous (else one copy is made); ``target``: [...] global token ids below ``vocab_size``,
    the true vocabulary (padding excluded); ``group``: the tensor-parallel group (None: megatron-core's);
    ``chunk``: tokens per work chunk (None: :func:`chunk_tokens`). Needs an initialised world.
    Gradients flow to ``logits`` (through the temperature).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, found {temperature}")
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
    vocab_start = dist.get_rank(group) * logits.shape[-1]
    rows = chunk or chunk_tokens(logits.shape[-1], device=logits.device)
    return _VocabParallelLogProbEntropy.apply(logits, target, vocab_start, vocab_size, float(temperature), rows,
                                              group)


def token_log_probs(
    logits: torch.Tensor, input_ids: torch.Tensor, *, vocab_size: int, temperature: float = 1.0,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-aligned (log p(input_ids[:, i] | input_ids[:, :i]), entropy of that distribution).

    ``logits`` [b, s, V_local] from a causal LM (position i predicts token i+1), vocabulary-sharded over
    the tensor-parallel ``group`` (None: megatron-core's). Position 0 has no prediction and gets 0 in
    both outputs.
    """
    # Every position is evaluated (the last one against a dummy target, then dropped) because
    # logits[:, :-1] is not viewable as [tokens, V] and would cost a full copy of the logits.
    target = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)
    lp, ent = vocab_parallel_log_prob_entropy(logits, target, vocab_size=vocab_size, temperature=temperature,
                                              group=group)
    zero = lp.new_zeros(lp.shape[0], 1)
    return torch.cat([zero, lp[:, :-1]], dim=1), torch.cat([zero, ent[:, :-1]], dim=1)
