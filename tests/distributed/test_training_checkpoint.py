"""Training checkpoints: save at step 1, resume in a new world, take step 2.

Same layout (TP1xPP2xDP2, Adam, distributed optimizer): bit-identical to the uninterrupted run.
Resumed with DP1 (a 2-process world, TP1xPP2): equal within 1e-6 relative. That world's model also has extra
state the checkpoint lacks, as Transformer Engine's modules do (:mod:`megarl.testing.extra_state`): it resumes,
and the extra state keeps its fresh value.
"""

from __future__ import annotations

import pytest
import torch

from megarl.checkpoint.convert import convert_hf_to_megatron
from megarl.testing.dist import run_world

pytestmark = pytest.mark.dist


def _batch(seed):
    from megarl.data.batch import Batch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 300, (8, 14), generator=g)
    attn, resp = torch.ones(8, 14), torch.zeros(8, 14)
    resp[:, 6:] = 1
    return Batch.from_dict({
        "input_ids": ids, "attention_mask": attn, "response_mask": resp,
        "old_log_probs": (-5.7 + 0.1 * torch.randn(8, 14, generator=g)) * resp,
        "advantages": torch.randn(8, 14, generator=g) * resp,
    })


def _world(rank, world_size, model_ckpt, train_ckpt, mode):
    from megarl.algos.config import AlgorithmConfig
    from megarl.checkpoint.training import load_training_checkpoint, save_training_checkpoint
    from megarl.controller.role import WorkerContext
    from megarl.engine.config import EngineConfig, OptimConfig
    from megarl.models.provider import global_named_parameters
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.policy import PolicyRole

    layout = ParallelLayout.for_world(world_size, pp=2)
    init_distributed(layout)
    coords = layout.coords(rank)
    ctx = WorkerContext(rank, world_size, layout, coords, "127.0.0.1", "local", 0, "cpu")
    config = EngineConfig(optim=OptimConfig(lr=1e-2, lr_warmup_steps=1, lr_decay_steps=3, weight_decay=0.01))
    # the batch's old_log_probs are the PPO ratio's denominator (auto would stand the update's own forward in)
    role = PolicyRole(ctx, checkpoint_dir=model_ckpt, engine=config,
                      algorithm=AlgorithmConfig(recompute_old_log_probs=True), temperature=1.0)

    def step(seed):
        return role.update(_batch(seed).chunk(layout.dp)[coords.dp])

    with_extra = []
    if mode == "resumed_te_shaped":  # TE's final norm; a module in every layer (stacked over layers)
        from megarl.testing.extra_state import add_extra_state

        with_extra = [m for c in role.engine.chunks
                      for m in ([c.decoder.final_layernorm] if c.post_process else []) +
                      [layer.self_attention for layer in c.decoder.layers]]
        for m in with_extra:
            add_extra_state(m, torch.tensor([7, 1, 9], dtype=torch.uint8))
    if mode == "uninterrupted":
        step(1)
        save_training_checkpoint(role.engine, train_ckpt, step=1, source_dir=model_ckpt)
    else:
        assert load_training_checkpoint(role.engine, train_ckpt) == 1
    result = step(2)
    params = {n: p.detach().tolist() for c in role.engine.chunks for n, p in global_named_parameters(c)}
    extra_kept = [m.extra_state_loads == 0 and m.extra_state.tolist() == [7, 1, 9] for m in with_extra]
    return {"coords": list(coords), "params": params if coords.dp == 0 else None, "lr": result.lr,
            "extra_state_kept": extra_kept}


def _by_name(results):
    out = {}
    for r in results:
        if r["params"] is not None:
            out.update({n: torch.tensor(v) for n, v in r["params"].items()})
    return out


@pytest.fixture(scope="module")
def runs(tiny_hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    convert_hf_to_megatron(tiny_hf("llama_gqa"), root / "mc")
    args = (str(root / "mc"), str(root / "step1"))
    return {
        "uninterrupted": run_world(_world, 4, *args, "uninterrupted", timeout_s=600),
        "resumed": run_world(_world, 4, *args, "resumed", timeout_s=600),
        "resumed_dp1": run_world(_world, 2, *args, "resumed_te_shaped", timeout_s=600),
        "dir": root / "step1",
    }


def test_resume_same_layout_is_bit_exact(runs):
    a, b = _by_name(runs["uninterrupted"]), _by_name(runs["resumed"])
    assert set(a) == set(b) and len(a) > 10
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert runs["uninterrupted"][0]["lr"] == runs["resumed"][0]["lr"]  # the LR schedule resumed too


def test_resume_with_another_dp_size_matches_within_rounding(runs):
    a, c = _by_name(runs["uninterrupted"]), _by_name(runs["resumed_dp1"])
    for name in a:
        rel = (a[name] - c[name]).norm() / a[name].norm()
        assert rel < 1e-6, f"{name}: {rel:.2e}"
    # extra state the checkpoint lacks (TE's): on both pipeline stages, every module kept its fresh value
    assert sorted(len(r["extra_state_kept"]) for r in runs["resumed_dp1"]) == [2, 3]  # 2 layers per stage
    assert all(kept for r in runs["resumed_dp1"] for kept in r["extra_state_kept"])


def test_checkpoint_is_complete_and_converts_to_hf(runs, tmp_path, tiny_hf):
    from safetensors.torch import load_file

    from megarl.checkpoint.convert import convert_megatron_to_hf

    ckpt = runs["dir"]
    assert not list(ckpt.parent.glob(".step1.tmp-*"))  # the temporary directory was renamed away
    convert_megatron_to_hf(ckpt, tmp_path / "hf")
    trained = load_file(tmp_path / "hf" / "model.safetensors")
    original = load_file(tiny_hf("llama_gqa") / "model.safetensors")
    assert sorted(trained) == sorted(original)
    assert any(not torch.equal(trained[k], original[k]) for k in original)  # step 1 changed the weights


def _sgd_world(rank, world_size, model_ckpt, out):
    """SGD with momentum (no distributed optimizer): step 1, save, step 2; a second policy resumes from the
    checkpoint and takes step 2. The momentum buffers are the optimizer's only state."""
    from megarl.algos.config import AlgorithmConfig
    from megarl.checkpoint.training import load_training_checkpoint, save_training_checkpoint
    from megarl.controller.role import WorkerContext
    from megarl.engine.config import EngineConfig, OptimConfig, OptimizerName
    from megarl.models.provider import global_named_parameters
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.policy import PolicyRole

    layout = ParallelLayout.for_world(world_size, pp=2)
    init_distributed(layout)
    ctx = WorkerContext(rank, world_size, layout, layout.coords(rank), "127.0.0.1", "local", 0, "cpu")
    config = EngineConfig(optim=OptimConfig(optimizer=OptimizerName.SGD, lr=1e-1, sgd_momentum=0.9,
                                            use_distributed_optimizer=False))

    def role():
        return PolicyRole(ctx, checkpoint_dir=model_ckpt, engine=config,
                          algorithm=AlgorithmConfig(recompute_old_log_probs=True), temperature=1.0)

    def params(r):
        return {n: p.detach().clone() for c in r.engine.chunks for n, p in global_named_parameters(c)}

    full = role()
    full.update(_batch(1))
    save_training_checkpoint(full.engine, out, step=1, source_dir=model_ckpt)
    after_one = params(full)
    full.update(_batch(2))
    resumed = role()
    assert load_training_checkpoint(resumed.engine, out) == 1
    loaded = params(resumed)
    resumed.update(_batch(2))
    a, b = params(full), params(resumed)
    return {"loaded_equal": all(torch.equal(after_one[n], loaded[n]) for n in loaded),
            "step2_equal": all(torch.equal(a[n], b[n]) for n in a),
            "step2_moved": max(float((a[n] - after_one[n]).abs().max()) for n in a)}


def test_sgd_with_momentum_resumes_bit_exact(tiny_hf, tmp_path):
    """Resuming an SGD run raised in megatron-core (no init_state_fn for SGD); with momentum 0.9, step 2 after the
    resume equals the uninterrupted run's only if the momentum buffers were restored."""
    convert_hf_to_megatron(tiny_hf("llama_gqa"), tmp_path / "mc")
    for r in run_world(_sgd_world, 2, str(tmp_path / "mc"), str(tmp_path / "step1"), timeout_s=600):
        assert r["loaded_equal"] and r["step2_equal"] and r["step2_moved"] > 0, r
