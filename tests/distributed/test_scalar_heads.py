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


LR = 0.5


def _critic_inputs():
    g = torch.Generator().manual_seed(9)
    ids, attn = _batch()
    resp = attn.clone()
    resp[:, :3] = 0
    return resp, torch.randn(4, 12, generator=g) * resp, torch.randn(4, 12, generator=g) * 0.3 * resp


def _world(rank, world_size, rm_ckpt, lm_ckpt, old_values):
    from megarl.controller.role import WorkerContext
    from megarl.data.batch import Batch
    from megarl.engine.config import EngineConfig, MicroBatchConfig
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.critic import CriticRole, RewardModelRole

    layout = ParallelLayout(tp=2, pp=2)
    init_distributed(layout)
    ctx = WorkerContext(rank, world_size, layout, layout.coords(rank), "127.0.0.1", "local", 0, "cpu")
    engine = EngineConfig(micro_batch=MicroBatchConfig(max_tokens=24, max_size=4))
    ids, attn = _batch()
    batch = Batch.from_dict({"input_ids": ids, "attention_mask": attn})
    scores = RewardModelRole(ctx, checkpoint_dir=rm_ckpt, engine=engine).compute_scores(batch)
    rm_values = CriticRole(ctx, checkpoint_dir=rm_ckpt, engine=engine, value_clip=0.2,
                           trainable=False).compute_values(batch)
    lm_critic = CriticRole(ctx, checkpoint_dir=lm_ckpt, engine=engine, value_clip=0.2, trainable=False)
    lm_values = lm_critic.compute_values(batch)
    head = [c.output_layer.weight.tolist() for c in lm_critic.engine.chunks if c.post_process]

    from megarl.engine.config import OptimConfig, OptimizerName
    from megarl.models.provider import global_named_parameters

    resp, returns, _ = _critic_inputs()
    sgd = EngineConfig(optim=OptimConfig(optimizer=OptimizerName.SGD, lr=LR, clip_grad=0.0,
                                         use_distributed_optimizer=False),
                       micro_batch=MicroBatchConfig(max_tokens=24, max_size=4))
    critic = CriticRole(ctx, checkpoint_dir=rm_ckpt, engine=sgd, value_clip=0.2)  # token-mean value loss
    result = critic.update(batch.update(Batch.from_dict({"response_mask": resp, "returns": returns,
                                                           "old_values": torch.tensor(old_values)})))
    named = [(n, p) for c in critic.engine.chunks for n, p in global_named_parameters(c)]
    return {
        "vf_loss": result.terms["vf_loss"],
        "coords": list(layout.coords(rank)),
        "params": {n: p.detach().tolist() for n, p in named},
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
    old_values = _critic_reference(tiny_hf("llama_rm"))[0]
    return run_world(_world, 4, str(root / "rm"), str(root / "lm"), old_values.tolist(), timeout_s=900)


def _critic_reference(hf_dir):
    """old values (reference values + noise), clipped value loss and SGD-updated weights, from the HF RM."""
    from transformers import AutoModelForSequenceClassification

    from megarl.models import mapping
    from megarl.models.spec import load_hf_config, spec_from_hf_config

    ids, attn = _batch()
    resp, returns, noise = _critic_inputs()
    rm = AutoModelForSequenceClassification.from_pretrained(hf_dir)
    values = _token_aligned(rm.score(rm.model(ids, attention_mask=attn.long()).last_hidden_state).squeeze(-1), attn)
    old = (values.detach() + noise) * resp
    clipped = old + (values - old).clamp(-0.2, 0.2)
    per_token = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    loss = 0.5 * (per_token * resp).sum() / resp.sum()
    loss.backward()
    spec = spec_from_hf_config(load_hf_config(hf_dir))
    params = dict(rm.named_parameters())
    updated = {
        m.mcore: mapping.to_mcore(m, spec, [params[n].detach() - LR * params[n].grad for n in m.hf],
                                  spec.padded_vocab_size(1))
        for m in mapping.tensor_maps(spec)
    }
    return old, loss.item(), updated


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
        # 1e-5 relative to the value's size (values here reach ~20: fp32 spacing there is 2e-6)
        err = ((torch.tensor(reported[0]) - ref).abs() / ref.abs().clamp(min=1.0)).max().item()
        assert err < 1e-5, key


def test_critic_update_matches_hf_autograd(results, tiny_hf):
    from megarl.models import mapping
    from megarl.models.spec import load_hf_config, spec_from_hf_config

    _, ref_loss, updated = _critic_reference(tiny_hf("llama_rm"))
    spec = spec_from_hf_config(load_hf_config(tiny_hf("llama_rm")))
    maps = {m.mcore: m for m in mapping.tensor_maps(spec)}
    for r in results:
        assert abs(r["vf_loss"] - ref_loss) < 1e-5 * max(1.0, ref_loss)
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for r in results:
        for name, t in r["params"].items():
            shards.setdefault(name, {})[r["coords"][0]] = torch.tensor(t)
    assert set(shards) == set(maps)
    for name, by_tp in shards.items():
        full = mapping.tp_gather(maps[name], [by_tp[t] for t in sorted(by_tp)])[: updated[name].shape[0]]
        rel = (full - updated[name]).norm() / updated[name].norm()
        assert rel < 1e-5, f"{name}: {rel:.2e}"
