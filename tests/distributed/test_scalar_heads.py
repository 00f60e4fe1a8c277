"""Reward-model scores and critic values at TP2xPP2 against `transformers` with the same head."""

from __future__ import annotations

import pytest
import torch

from megarl.checkpoint.convert import convert_hf_to_megatron
from megarl.testing.dist import run_world

pytestmark = pytest.mark.dist


def _batch():
    g = torch.Generator().manual_seed(5)
    lengths = [7, 12, 4, 9]
    ids = torch.zeros(4, 12, dtype=torch.long)  # right-padded with pad_token_id 0
    attn = torch.zeros(4, 12)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(5, 300, (n,), generator=g)
        attn[i, :n] = 1
    return ids, attn


def _world(rank, world_size, rm_ckpt, lm_ckpt):
    from megarl.controller.role import WorkerContext
    from megarl.data.batch import Batch
    from megarl.engine.config import EngineConfig, MicroBatchConfig
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.workers.critic import CriticConfig, CriticRole, RewardModelRole

    layout = ParallelLayout(tp=2, pp=2)
    init_distributed(layout)
    ctx = WorkerContext(rank, world_size, layout, layout.coords(rank), "127.0.0.1", "local", 0, "cpu")
    engine = EngineConfig(micro_batch=MicroBatchConfig(max_tokens=24, max_size=4))
    ids, attn = _batch()
    batch = Batch.from_dict({"input_ids": ids, "attention_mask": attn})
    scores = RewardModelRole(ctx, rm_ckpt, engine).compute_scores(batch)
    rm_values = CriticRole(ctx, rm_ckpt, engine, CriticConfig(), trainable=False).compute_values(batch)
    lm_critic = CriticRole(ctx, lm_ckpt, engine, CriticConfig(), trainable=False)
    lm_values = lm_critic.compute_values(batch)
    head = [c.output_layer.weight.tolist() for c in lm_critic.engine.chunks if c.post_process]
    return {
        "scores": None if scores is None else scores["scores"].tolist(),
        "rm_values": None if rm_values is None else rm_values["values"].tolist(),
        "lm_values": None if lm_values is None else lm_values["values"].tolist(),
        "head": head[0] if head else None,
    }


@pytest.fixture(scope="module")
def results(tiny_hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("scalar")
    convert_hf_to_megatron(tiny_hf("llama_rm"), root / "rm", tp=2, pp=2)
    convert_hf_to_megatron(tiny_hf("llama_gqa"), root / "lm")
    return run_world(_world, 4, str(root / "rm"), str(root / "lm"), timeout_s=900)


def _token_aligned(per_position, attn):
    out = torch.zeros_like(attn)
    out[:, 1:] = per_position[:, :-1]
    return out * attn


def test_reward_scores_match_sequence_classifier(results, tiny_hf):
    from transformers import AutoModelForSequenceClassification

    ids, attn = _batch()
    with torch.no_grad():
        ref = AutoModelForSequenceClassification.from_pretrained(tiny_hf("llama_rm")).eval()(
            ids, attention_mask=attn.long()).logits.squeeze(-1)
    reported = [r["scores"] for r in results if r["scores"] is not None]
    assert len(reported) == 1  # DP1: one owner (last stage, TP rank 0)
    assert (torch.tensor(reported[0]) - ref).abs().max().item() < 1e-5


def test_critic_values_match_hidden_states_times_head(results, tiny_hf):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    ids, attn = _batch()
    with torch.no_grad():
        rm = AutoModelForSequenceClassification.from_pretrained(tiny_hf("llama_rm")).eval()
        rm_ref = _token_aligned(rm.score(rm.model(ids, attention_mask=attn.long()).last_hidden_state).squeeze(-1),
                                attn)
        lm = AutoModelForCausalLM.from_pretrained(tiny_hf("llama_gqa")).eval()
        head = torch.tensor(next(r["head"] for r in results if r["head"] is not None))
        hidden = lm.model(ids, attention_mask=attn.long()).last_hidden_state
        lm_ref = _token_aligned((hidden @ head.T).squeeze(-1), attn)
    heads = [torch.tensor(r["head"]) for r in results if r["head"] is not None]
    assert all(torch.equal(h, heads[0]) for h in heads)  # the fresh head is identical on every TP rank
    for key, ref in (("rm_values", rm_ref), ("lm_values", lm_ref)):
        reported = [r[key] for r in results if r[key] is not None]
        assert len(reported) == 1
        assert (torch.tensor(reported[0]) - ref).abs().max().item() < 1e-5, key
