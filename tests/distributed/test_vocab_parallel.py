"""Vocab-parallel log-probs and entropy (values and gradients) against float64 torch on full logits.

One spawned world of 2 processes runs TP=1 (two groups of one) and TP=2, each over several cases:
several token chunks with a ragged last one, temperature, a padded vocabulary (true vocab 300 inside
a padded 384, and 100 inside 256, where the second TP2 shard is padding only), bf16 logits, shards whose
maxima lie far apart, and the gradient of the log-prob only / entropy only / both. It also counts the
all-reduces: two per forward at TP2 whatever the number of chunks, none in backward.
"""

from __future__ import annotations

import pytest
import torch

from megarl.testing.dist import run_world

pytestmark = pytest.mark.dist

CASES = {  # name: (vocab, padded vocab, temperature, dtype, chunk tokens, differentiated outputs, offset)
    "chunks, temperature": (300, 384, 0.7, "float32", 4, "both", 0.0),  # 21 tokens: 5 chunks of 4, one of 1
    "log-prob grad only": (300, 384, 1.0, "float32", 5, "lp", 0.0),
    "entropy grad only": (300, 384, 0.7, "float32", 5, "ent", 0.0),
    "bf16": (300, 384, 0.7, "bfloat16", 4, "both", 0.0),
    "padding-only shard": (100, 256, 1.3, "float32", None, "both", 0.0),
    # the upper half of the vocabulary 30 below the lower half: the TP2 shards' maxima differ widely
    "distant shard maxima": (300, 384, 0.7, "float32", 4, "both", -30.0),
}


def _inputs(vocab: int, padded: int, dtype: str, offset: float):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 7, padded, generator=g, dtype=torch.float64) * 3
    logits[..., padded // 2:] += offset
    logits = logits.to(getattr(torch, dtype))
    target = torch.randint(0, vocab, (3, 7), generator=g)
    return logits, target, torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)


def _grads(which: str, g_lp, g_ent):
    return (g_lp if which in ("lp", "both") else None), (g_ent if which in ("ent", "both") else None)


def _reference(case: str):
    vocab, padded, temperature, dtype, _, which, offset = CASES[case]
    logits, target, g_lp, g_ent = _inputs(vocab, padded, dtype, offset)
    x = logits.double().requires_grad_(True)
    logp = torch.log_softmax(x[..., :vocab] / temperature, dim=-1)
    lp = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    g_lp, g_ent = _grads(which, g_lp, g_ent)
    sum((o * g.double()).sum() for o, g in ((lp, g_lp), (ent, g_ent)) if g is not None).backward()
    return lp.detach(), ent.detach(), x.grad


def _world(rank, world_size):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.engine.vocab_parallel import vocab_parallel_log_prob_entropy
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    calls = {"n": 0}
    all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls["n"] += 1
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    out = {}
    for tp in (1, 2):
        init_distributed(ParallelLayout.for_world(world_size, tp=tp))
        t = ps.get_tensor_model_parallel_rank()
        for case, (vocab, padded, temperature, dtype, chunk, which, offset) in CASES.items():
            logits, target, g_lp, g_ent = _inputs(vocab, padded, dtype, offset)
            shard = logits.chunk(tp, dim=-1)[t].clone().requires_grad_(True)
            calls["n"] = 0
            lp, ent = vocab_parallel_log_prob_entropy(shard, target, vocab_size=vocab, temperature=temperature,
                                                      chunk=chunk)
            fwd_calls, calls["n"] = calls["n"], 0
            g_lp, g_ent = _grads(which, g_lp, g_ent)
            sum((o * g).sum() for o, g in ((lp, g_lp), (ent, g_ent)) if g is not None).backward()
            out[f"{tp}/{case}"] = {"tp_rank": t, "lp": lp.tolist(), "ent": ent.tolist(),
                                   "grad_dtype": str(shard.grad.dtype), "grad": shard.grad.double().tolist(),
                                   "calls": [fwd_calls, calls["n"]]}
    dist.all_reduce = all_reduce
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(_world, 2, timeout_s=300)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_values_and_gradients_match_float64(results, tp, case):
    vocab, padded, _, dtype, _, _, _ = CASES[case]
    ref_lp, ref_ent, ref_grad = _reference(case)
    rel = 2.0**-8 if dtype == "bfloat16" else 0.0  # bf16 gradients: float32 results rounded to 8 significant bits
    for r in results:
        res = r[f"{tp}/{case}"]
        assert (torch.tensor(res["lp"], dtype=torch.float64) - ref_lp).abs().max() < 1e-5
        assert (torch.tensor(res["ent"], dtype=torch.float64) - ref_ent).abs().max() < 1e-5
        ref_shard = ref_grad.chunk(tp, dim=-1)[res["tp_rank"]]
        grad = torch.tensor(res["grad"], dtype=torch.float64)
        assert res["grad_dtype"] == f"torch.{dtype}"
        assert ((grad - ref_shard).abs() <= 1e-5 + rel * ref_shard.abs()).all()
        # padded columns (vocab..padded-1) sit at the end of the last shard and receive exactly zero gradient
        first = res["tp_rank"] * (padded // tp)
        assert (grad[..., max(vocab - first, 0):] == 0).all()
        assert res["calls"] == ([2, 0] if tp == 2 else [0, 0])
