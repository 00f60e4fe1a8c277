"""Training checkpoints at context parallelism, in one spawned gloo world of 2 (megatron-core re-initialised between
layouts): Adam with the distributed optimizer (its state sharded over the data- and context-parallel ranks).

A run at TP1 x CP2 takes step 1, saves, takes step 2; resumed at CP2 its step 2 is bit-identical, resumed at TP1 x DP2
(no CP) equal within 1e-6 relative; and a checkpoint written at DP2 resumes at CP2 likewise. The CP ranks are replicas
of one copy of the model: the checkpoint holds every tensor exactly once (its chunks tile each global tensor, none
twice), as the one written without CP does, and both are the same size within 5%.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.checkpoint.convert import convert_hf_to_megatron
from megarl.testing.dist import run_world

pytestmark = pytest.mark.dist

LAYOUTS = {"cp2": dict(cp=2), "dp2": {}}


def _batch(seed):
    from megarl.data.batch import Batch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([14, 9, 12, 5, 14, 7, 11, 10])
    attn = (torch.arange(14) < lengths[:, None]).float()
    resp = attn.clone()
    resp[:, :4] = 0
    return Batch.from_dict({
        "input_ids": torch.randint(5, 300, (8, 14), generator=g) * attn.long(), "attention_mask": attn,
        "response_mask": resp, "old_log_probs": (-5.7 + 0.1 * torch.randn(8, 14, generator=g)) * resp,
        "advantages": torch.randn(8, 14, generator=g) * resp,
    })


def _run(rank, world_size, model_ckpt, layout_name, *, save=None, load=None):
    """Steps 1 and 2 (saving ``save`` after step 1), or ``load`` then step 2, at one layout; the parameters after
    step 2 (rank 0) and the step-2 learning rate."""
    from megarl.algos.config import AlgorithmConfig
    from megarl.checkpoint.training import load_training_checkpoint, save_training_checkpoint
    from megarl.controller.role import WorkerContext
    from megarl.engine.config import EngineConfig, OptimConfig
    from megarl.models.provider import global_named_parameters
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.policy import PolicyRole

    layout = ParallelLayout.for_world(world_size, **LAYOUTS[layout_name])
    init_distributed(layout)
    coords = layout.coords(rank)
    ctx = WorkerContext(rank, world_size, layout, coords, "127.0.0.1", "local", 0, "cpu")
    config = EngineConfig(optim=OptimConfig(lr=1e-2, lr_warmup_steps=1, lr_decay_steps=3, weight_decay=0.01))
    role = PolicyRole(ctx, checkpoint_dir=model_ckpt, engine=config,
                      algorithm=AlgorithmConfig(recompute_old_log_probs=True), temperature=1.0)

    def step(seed):
        return role.update(_batch(seed).chunk(layout.dp)[coords.dp])

    if load is None:
        step(1)
        save_training_checkpoint(role.engine, save, step=1, source_dir=model_ckpt)
    else:
        assert load_training_checkpoint(role.engine, load) == 1
    result = step(2)
    params = {n: p.detach().tolist() for c in role.engine.chunks for n, p in global_named_parameters(c)}
    return {"params": params if rank == 0 else None, "lr": result.lr}


def _world(rank, world_size, model_ckpt, root):
    cp2, dp2 = f"{root}/cp2", f"{root}/dp2"
    return {"cp2": _run(rank, world_size, model_ckpt, "cp2", save=cp2),
            "cp2_from_cp2": _run(rank, world_size, model_ckpt, "cp2", load=cp2),
            "dp2_from_cp2": _run(rank, world_size, model_ckpt, "dp2", load=cp2),
            "dp2": _run(rank, world_size, model_ckpt, "dp2", save=dp2),
            "cp2_from_dp2": _run(rank, world_size, model_ckpt, "cp2", load=dp2)}


@pytest.fixture(scope="module")
def runs(tiny_hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_resume")
    convert_hf_to_megatron(tiny_hf("llama_gqa"), root / "mc")
    results = run_world(_world, 2, str(root / "mc"), str(root), timeout_s=600)
    return {"rank0": results[0], "root": root}


def _params(run) -> dict[str, torch.Tensor]:
    return {n: torch.tensor(v) for n, v in run["params"].items()}


def test_resume_at_cp2_is_bit_exact(runs):
    a, b = _params(runs["rank0"]["cp2"]), _params(runs["rank0"]["cp2_from_cp2"])
    assert set(a) == set(b) and len(a) > 10
    assert all(torch.equal(a[n], b[n]) for n in a), [n for n in a if not torch.equal(a[n], b[n])]
    assert runs["rank0"]["cp2"]["lr"] == runs["rank0"]["cp2_from_cp2"]["lr"]  # the LR schedule resumed too


@pytest.mark.parametrize("resumed, reference", [("dp2_from_cp2", "cp2"), ("cp2_from_dp2", "dp2")])
def test_resume_across_cp_sizes_matches_within_rounding(runs, resumed, reference):
    a, b = _params(runs["rank0"][reference]), _params(runs["rank0"][resumed])
    assert set(a) == set(b)
    worst = max((float((b[n] - a[n]).norm() / a[n].norm()), n) for n in a)
    print(f"{resumed} vs {reference}: worst relative difference {worst[0]:.2e} ({worst[1]})")
    assert worst[0] < 1e-6, worst
    assert runs["rank0"][resumed]["lr"] == runs["rank0"][reference]["lr"]


def test_every_tensor_is_written_once(runs):
    """The torch_dist metadata: each global tensor's chunks cover it exactly (their elements add up to it, so no
    chunk is written by both CP ranks); the CP2 checkpoint is the size of the one without CP."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    sizes = {}
    for name in ("cp2", "dp2"):
        weights = runs["root"] / name / "weights"
        meta = FileSystemReader(str(weights)).read_metadata()
        tensors = {k: m for k, m in meta.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
        assert any(k.startswith("optimizer.") for k in tensors) and len(tensors) > 20
        for key, m in tensors.items():
            covered = sum(math.prod(c.sizes) for c in m.chunks)
            assert covered == math.prod(m.size), (name, key, covered, tuple(m.size))
        sizes[name] = sum(f.stat().st_size for f in weights.iterdir() if f.suffix == ".distcp")
    print(f"checkpoint bytes: {sizes}")
    assert sizes["cp2"] == pytest.approx(sizes["dp2"], rel=0.05), sizes
