"""A Qwen3-MoE critic at PP2 x EP2 (a spawned gloo world of 4: two DP ranks per stage, each holding half of every
layer's experts) against `transformers`' Qwen3MoeForSequenceClassification: token values, and one clipped
value-loss update's SGD step for every parameter (experts sliced by hand out of transformers' fused tensors).
"""

from __future__ import annotations

import pytest
import torch

from megarl.checkpoint.convert import convert_hf_to_megatron
from megarl.testing.dist import run_world

pytestmark = pytest.mark.dist

LR = 0.5
CLIP = 0.2


def _inputs():
    """Right-padded rows of different lengths, response masks, returns and the old values' noise."""
    g = torch.Generator().manual_seed(5)
    lengths = [7, 12, 4, 9, 11, 5, 8, 10]
    ids = torch.zeros(len(lengths), 12, dtype=torch.long)
    attn = torch.zeros(len(lengths), 12)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(5, 300, (n,), generator=g)
        attn[i, :n] = 1
    resp = attn.clone()
    resp[:, :3] = 0
    return ids, attn, resp, torch.randn(attn.shape, generator=g) * resp, torch.randn(attn.shape, generator=g) * 0.3


def _reference(hf_dir):
    """Token-aligned values, old values (values + noise), the clipped value loss and the SGD-updated weights
    (Megatron names), from transformers."""
    from transformers import AutoModelForSequenceClassification

    from megarl.models import mapping
    from megarl.models.spec import load_hf_config, spec_from_hf_config
    from megarl.testing.tiny import per_expert

    ids, attn, resp, returns, noise = _inputs()
    model = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32)
    per_position = model.score(model.model(ids, attention_mask=attn.long()).last_hidden_state).squeeze(-1)
    values = torch.zeros_like(attn)
    values[:, 1:] = per_position[:, :-1]
    values = values * attn
    old = (values.detach() + noise) * resp
    clipped = old + (values - old).clamp(-CLIP, CLIP)
    loss = 0.5 * (torch.maximum((values - returns) ** 2, (clipped - returns) ** 2) * resp).sum() / resp.sum()
    loss.backward()
    cfg = load_hf_config(hf_dir)
    spec = spec_from_hf_config(cfg)
    params = dict(model.named_parameters())
    inter = cfg["moe_intermediate_size"]
    new = per_expert({n: p.detach() - LR * p.grad for n, p in params.items()}, inter)
    updated = {m.mcore: mapping.to_mcore(m, spec, [new[n] for n in m.hf], spec.padded_vocab_size(1))
               for m in mapping.tensor_maps(spec)}
    return values.detach(), old, loss.item(), updated


def _world(rank, world_size, ckpt, old_values):
    from megarl.controller.role import WorkerContext
    from megarl.data.batch import Batch
    from megarl.engine.config import EngineConfig, MicroBatchConfig, OptimConfig, OptimizerName
    from megarl.models.provider import global_named_parameters
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.critic import CriticRole

    layout = ParallelLayout.for_world(world_size, pp=2, ep=2)
    init_distributed(layout)
    coords = layout.coords(rank)
    ctx = WorkerContext(rank, world_size, layout, coords, "127.0.0.1", "local", 0, "cpu")
    engine = EngineConfig(optim=OptimConfig(optimizer=OptimizerName.SGD, lr=LR, clip_grad=0.0,
                                            use_distributed_optimizer=False),
                          micro_batch=MicroBatchConfig(max_tokens=24, max_size=4))
    ids, attn, resp, returns, _ = _inputs()
    critic = CriticRole(ctx, checkpoint_dir=ckpt, engine=engine, value_clip=CLIP)
    values = critic.compute_values(Batch.from_dict({"input_ids": ids, "attention_mask": attn}))
    batch = Batch.from_dict({"input_ids": ids, "attention_mask": attn, "response_mask": resp, "returns": returns,
                             "old_values": torch.tensor(old_values)})
    result = critic.update(batch.chunk(layout.dp)[coords.dp])
    return {"values": None if values is None else values["values"].tolist(), "vf_loss": result.terms["vf_loss"],
            "moe_load_max": result.terms["moe_load_max"],
            "params": {n: p.detach().tolist() for c in critic.engine.chunks for n, p in global_named_parameters(c)}}


@pytest.fixture(scope="module")
def setup(tiny_hf, tmp_path_factory):
    hf = tiny_hf("qwen3_moe_rm")
    ckpt = tmp_path_factory.mktemp("moe_critic") / "mc"
    convert_hf_to_megatron(hf, ckpt, pp=2, ep=2)
    reference = _reference(hf)
    return reference, run_world(_world, 4, str(ckpt), reference[1].tolist(), timeout_s=900)


def test_values_match_the_sequence_classifier(setup):
    (values, _, _, _), results = setup
    reported = [r["values"] for r in results if r["values"] is not None]
    assert len(reported) == 2  # one answer per data-parallel replica (last stage, TP rank 0), each of the batch
    for got in reported:
        err = ((torch.tensor(got) - values).abs() / values.abs().clamp(min=1.0)).max().item()
        assert err < 1e-5


def test_value_update_matches_transformers_autograd_for_every_parameter(setup):
    """Each rank holds its stage's parameters and its own experts: every one of them, after the step, equals
    transformers' SGD step (relative 1e-5), and together they cover the model."""
    (_, _, loss, updated), results = setup
    seen = set()
    for r in results:
        assert r["vf_loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
        assert 1.0 <= r["moe_load_max"] <= 4.0  # a share of routed tokens times the 4 experts
        for name, p in r["params"].items():
            seen.add(name)
            ref = updated[name]
            rel = ((torch.tensor(p) - ref).norm() / ref.norm()).item()
            assert rel < 1e-5, f"{name}: {rel:.2e}"
    assert seen == set(updated)
