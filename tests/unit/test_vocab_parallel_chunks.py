"""The chunked vocab-parallel log-prob/entropy at TP1 (a world of one) against float64 torch on full logits.

Covers chunking (one token a chunk, a ragged last chunk, the default), padded vocabulary columns,
temperature, bf16 logits, gradients of the log-prob only / entropy only / both, the token alignment of
``token_log_probs``, and that no [tokens, V] temporary is made (profiler memory events).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from megarl.engine.vocab_parallel import CHUNK_BYTES, chunk_tokens, token_log_probs, vocab_parallel_log_prob_entropy

VOCAB, PADDED = 300, 384  # megatron pads to a multiple of 128


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    init_distributed(ParallelLayout())


def reference(logits, target, temperature, g_lp, g_ent):
    """float64 (log p(target), entropy, d(lp*g_lp + ent*g_ent)/d logits) over the unpadded vocabulary."""
    x = logits.detach().double().requires_grad_(True)
    logp = torch.log_softmax(x[..., :VOCAB] / temperature, dim=-1)
    lp = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    loss = sum((o * g.double()).sum() for o, g in ((lp, g_lp), (ent, g_ent)) if g is not None)
    loss.backward()
    return lp.detach(), ent.detach(), x.grad


def inputs(shape=(3, 7), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, PADDED, generator=g, dtype=torch.float64) * 3).to(dtype)
    target = torch.randint(0, VOCAB, shape, generator=g)
    return logits, target, torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def check(lp, ent, grad, ref, dtype):
    assert (lp.double() - ref[0]).abs().max() < 1e-5
    assert (ent.double() - ref[1]).abs().max() < 1e-5
    assert grad.dtype == dtype and grad.shape == ref[2].shape
    # bf16 gradients are float32 results rounded once to 8 significant bits
    rel = 2.0**-8 if dtype == torch.bfloat16 else 0.0
    assert ((grad.double() - ref[2]).abs() <= 1e-5 + rel * ref[2].abs()).all()
    assert grad[..., VOCAB:].abs().max() == 0  # padded columns: exactly zero


CASES = {  # name: (chunk tokens, temperature, dtype, which outputs are differentiated)
    "one token a chunk": (1, 1.0, torch.float32, "both"),
    "ragged chunks, temperature": (4, 0.7, torch.float32, "both"),  # 21 tokens: 5 chunks of 4, one of 1
    "default chunk": (None, 1.3, torch.float32, "both"),
    "log-prob grad only": (5, 0.7, torch.float32, "lp"),
    "entropy grad only": (5, 0.7, torch.float32, "ent"),
    "bf16": (4, 0.7, torch.bfloat16, "both"),
    "bf16 log-prob grad only": (4, 1.0, torch.bfloat16, "lp"),
}


@pytest.mark.parametrize("case", CASES)
def test_values_and_gradients_match_float64(case):
    chunk, temperature, dtype, grads = CASES[case]
    logits, target, g_lp, g_ent = inputs(dtype=dtype)
    g_lp, g_ent = (g_lp if grads in ("lp", "both") else None), (g_ent if grads in ("ent", "both") else None)
    x = logits.clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_prob_entropy(x, target, vocab_size=VOCAB, temperature=temperature, chunk=chunk)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == target.shape
    sum((o * g).sum() for o, g in ((lp, g_lp), (ent, g_ent)) if g is not None).backward()
    check(lp, ent, x.grad, reference(logits, target, temperature, g_lp, g_ent), dtype)


def test_non_contiguous_logits():
    logits, target, g_lp, g_ent = inputs(shape=(3, 8))
    x = logits.clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_prob_entropy(x[:, :-1], target[:, :-1], vocab_size=VOCAB, chunk=3)
    (lp * g_lp[:, :-1] + ent * g_ent[:, :-1]).sum().backward()
    ref = reference(logits[:, :-1], target[:, :-1], 1.0, g_lp[:, :-1], g_ent[:, :-1])
    check(lp, ent, x.grad[:, :-1], ref, torch.float32)
    assert x.grad[:, -1].abs().max() == 0


def test_token_log_probs_is_aligned_to_the_predicted_token():
    logits, ids, g_lp, g_ent = inputs(shape=(2, 9))
    x = logits.clone().requires_grad_(True)
    lp, ent = token_log_probs(x, ids, vocab_size=VOCAB, temperature=0.7)
    (lp * g_lp + ent * g_ent).sum().backward()
    # position i holds log p(ids[i] | logits at i-1); position 0 is 0 and gets no gradient back
    ref = reference(logits[:, :-1], ids[:, 1:], 0.7, g_lp[:, 1:], g_ent[:, 1:])
    assert (lp[:, 0] == 0).all() and (ent[:, 0] == 0).all()
    check(lp[:, 1:], ent[:, 1:], x.grad[:, :-1], ref, torch.float32)
    assert x.grad[:, -1].abs().max() == 0  # the last position predicts nothing


def test_chunk_buffers_stay_small():
    for v in (1, 300, 32000, 152064, 10**6):
        rows = chunk_tokens(v)
        assert rows == 1 or rows * v * 4 <= CHUNK_BYTES
    assert CHUNK_BYTES < 32 * 2**20  # below glibc's largest mmap threshold: buffers come from the heap
    assert chunk_tokens(152064) >= 1 and chunk_tokens(32000) >= 8
    # logits on a GPU: few large chunks (kernel launches, not cache size, bound the speed there)
    gpu = torch.device("cuda", 0)
    assert chunk_tokens(152064, device=gpu) == 2**28 // (4 * 152064) == 441
    assert chunk_tokens(32000, device=torch.device("cpu")) == chunk_tokens(32000) == 16


def _peak_allocated(fn) -> int:
    """Peak of (bytes allocated - bytes freed) on the CPU while ``fn`` runs, from the profiler's memory events."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    results = getattr(prof.profiler, "kineto_results", None)
    if results is None:
        pytest.skip("this torch's profiler exposes no kineto memory events")
    mem = sorted((e.start_ns(), e.nbytes()) for e in results.events() if e.name() == "[memory]")
    if not mem:
        pytest.skip("the profiler recorded no memory events")
    return max(itertools.accumulate(n for _, n in mem))


def test_no_full_vocabulary_temporaries():
    tokens, vocab = 2048, 4096  # logits of 32 MiB; chunk buffers of CHUNK_BYTES (2 MiB) each
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(tokens, vocab, generator=g)
    target = torch.randint(0, vocab, (tokens,), generator=g)
    full = logits.numel() * 4

    def forward():
        with torch.no_grad():
            vocab_parallel_log_prob_entropy(logits, target, vocab_size=vocab)

    assert _peak_allocated(forward) < full / 4  # the former implementation peaked at 5x full

    x = logits.clone().requires_grad_(True)

    def forward_backward():
        lp, ent = vocab_parallel_log_prob_entropy(x, target, vocab_size=vocab)
        (lp + ent).sum().backward()

    # the gradient itself (full) plus chunk buffers; the former implementation peaked at 7x full
    assert _peak_allocated(forward_backward) < full * 1.25
