"""Batch-major logits through the engine at TP2 with tied embeddings (a spawned 2-process gloo world).

The vocab-parallel output layer gets the embedding's weight shard at forward. Reference:
`transformers` on the same checkpoint, torch.log_softmax for log-probs and autograd of the mean
token log-prob for gradients (the tied weight's gradient sums the embedding and LM-head terms).
"""

from __future__ import annotations

import pytest
import torch

from megarl.checkpoint.convert import convert_hf_to_megatron
from megarl.testing.dist import run_world

pytestmark = pytest.mark.dist


def _batch_tensors():
    g = torch.Generator().manual_seed(4)
    lengths = [7, 3, 5]
    ids = torch.zeros(3, 7, dtype=torch.long)
    attn = torch.zeros(3, 7)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(5, 300, (n,), generator=g)
        attn[i, :n] = 1
    target = attn.clone()
    target[:, 0] = 0  # position 0 has no prediction
    return ids, attn, target


def _world(rank, world_size, ckpt):
    from megarl.checkpoint.format import read_meta
    from megarl.data.batch import Batch
    from megarl.engine.config import EngineConfig, MicroBatchConfig, OptimConfig, OptimizerName
    from megarl.engine.engine import MegatronEngine
    from megarl.engine.packing import row_log_probs
    from megarl.models.provider import global_named_parameters
    from megarl.models.spec import spec_from_hf_config
    from megarl.parallel.init import init_distributed, process_groups
    from megarl.parallel.layout import ParallelLayout

    layout = ParallelLayout.for_world(world_size, tp=2, pp=1)
    init_distributed(layout)
    spec = spec_from_hf_config(read_meta(ckpt).hf_config)
    config = EngineConfig(optim=OptimConfig(optimizer=OptimizerName.SGD, lr=0.1, clip_grad=0.0,
                                            use_distributed_optimizer=False),
                          micro_batch=MicroBatchConfig(max_tokens=14))  # 2 micro-batches
    engine = MegatronEngine(spec, layout, config, checkpoint_dir=ckpt, trainable=True, groups=process_groups())
    ids, attn, target = _batch_tensors()
    batch = Batch.from_dict({"input_ids": ids, "attention_mask": attn, "target_mask": target})
    count = target.sum()

    def per_token(logits, mb):
        return {"log_probs": row_log_probs(logits, mb, vocab_size=spec.vocab_size)[0]}

    def loss_fn(logits, mb):
        lp = row_log_probs(logits, mb, vocab_size=spec.vocab_size)[0]
        return -(lp * mb["target_mask"]).sum() / count, {}

    lp = engine.forward(batch, per_token)["log_probs"] * attn
    result = engine.train_step(batch, loss_fn)
    grads = {n: p.main_grad.tolist() for n, p in global_named_parameters(engine.chunks[0])}
    return {"tp": layout.coords(rank).tp, "log_probs": lp.tolist(), "loss": result.loss, "grads": grads}


def _hf_reference(hf_dir):
    from transformers import AutoModelForCausalLM

    from megarl.models import mapping
    from megarl.models.spec import load_hf_config, spec_from_hf_config

    ids, attn, target = _batch_tensors()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    logits = model(ids, attention_mask=attn.long()).logits
    lp = torch.zeros_like(attn)
    lp[:, 1:] = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    lp = lp * attn
    loss = -(lp * target).sum() / target.sum()
    loss.backward()
    spec = spec_from_hf_config(load_hf_config(hf_dir))
    params = dict(model.named_parameters())
    maps = {m.mcore: m for m in mapping.tensor_maps(spec)}
    grads = {name: mapping.to_mcore(m, spec, [params[n].grad for n in m.hf], spec.padded_vocab_size(1))
             for name, m in maps.items()}
    return lp.detach(), loss.item(), grads, maps


def test_tp2_tied_log_probs_and_gradients_match_transformers(tiny_hf, tmp_path):
    from megarl.models import mapping

    hf = tiny_hf("qwen2_tied")
    convert_hf_to_megatron(hf, tmp_path / "mc", tp=2)
    ref_lp, ref_loss, ref_grads, maps = _hf_reference(hf)
    world = run_world(_world, 2, str(tmp_path / "mc"), timeout_s=600)

    for r in world:
        err = ((torch.tensor(r["log_probs"]) - ref_lp).abs() / ref_lp.abs().clamp(min=1.0)).max().item()
        assert err < 1e-5
        assert abs(r["loss"] - ref_loss) < 1e-5 * max(1.0, abs(ref_loss))
    assert set(world[0]["grads"]) == set(maps)
    for name, m in maps.items():
        by_tp = {r["tp"]: torch.tensor(r["grads"][name]) for r in world}
        full = mapping.tp_gather(m, [by_tp[t] for t in sorted(by_tp)])[: ref_grads[name].shape[0]]
        rel = (full - ref_grads[name]).norm() / ref_grads[name].norm().clamp(min=1e-12)
        assert rel < 1e-5, f"{name}: relative error {rel:.2e}"
