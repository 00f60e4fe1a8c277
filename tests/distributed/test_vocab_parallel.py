"""Vocab-parallel log-probs and entropy (values and gradients) against float64 torch on full logits.

One spawned world of 4 processes checks TP=2 (two TP groups) and TP=4, with a padded vocabulary
(true vocab 300 inside a padded 304) and temperature 0.7.
"""

from __future__ import annotations

import pytest
import torch

from megarl.testing.dist import run_world

pytestmark = pytest.mark.dist

VOCAB, PADDED, TEMP = 300, 304, 0.7


def _inputs():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, PADDED, generator=g, dtype=torch.float64) * 3
    target = torch.randint(0, VOCAB, (3, 5), generator=g)
    g_lp = torch.randn(3, 5, generator=g, dtype=torch.float64)
    g_ent = torch.randn(3, 5, generator=g, dtype=torch.float64)
    return logits, target, g_lp, g_ent


def _reference():
    logits, target, g_lp, g_ent = _inputs()
    logits.requires_grad_(True)
    logp = torch.log_softmax(logits[..., :VOCAB] / TEMP, dim=-1)
    lp = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    (lp * g_lp + ent * g_ent).sum().backward()
    return lp.detach(), ent.detach(), logits.grad


def _world(rank, world_size):
    from megatron.core import parallel_state as ps

    from megarl.engine.vocab_parallel import vocab_parallel_log_prob_entropy
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    out = {}
    for tp in (2, 4):
        init_distributed(ParallelLayout.for_world(world_size, tp=tp))
        logits, target, g_lp, g_ent = _inputs()
        t = ps.get_tensor_model_parallel_rank()
        shard = logits.float().chunk(tp, dim=-1)[t].clone().requires_grad_(True)
        lp, ent = vocab_parallel_log_prob_entropy(shard, target, vocab_size=VOCAB, temperature=TEMP)
        (lp * g_lp.float() + ent * g_ent.float()).sum().backward()
        out[tp] = {"tp_rank": t, "lp": lp.tolist(), "ent": ent.tolist(), "grad": shard.grad.tolist()}
    return out


@pytest.fixture(scope="module")
def results():
    return run_world(_world, 4, timeout_s=300)


@pytest.mark.parametrize("tp", [2, 4])
def test_values_and_gradients_match_float64(results, tp):
    ref_lp, ref_ent, ref_grad = _reference()
    for r in results:
        res = r[str(tp)]
        assert (torch.tensor(res["lp"], dtype=torch.float64) - ref_lp).abs().max() < 1e-5
        assert (torch.tensor(res["ent"], dtype=torch.float64) - ref_ent).abs().max() < 1e-5
        grad_shard = ref_grad.chunk(tp, dim=-1)[res["tp_rank"]]
        assert (torch.tensor(res["grad"], dtype=torch.float64) - grad_shard).abs().max() < 1e-5
    # the padded columns (300..303) live on the last TP rank and receive exactly zero gradient
    last = next(r[str(tp)] for r in results if r[str(tp)]["tp_rank"] == tp - 1)
    assert torch.tensor(last["grad"])[..., -(PADDED - VOCAB):].abs().max() == 0
