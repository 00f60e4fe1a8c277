"""Adapter-only LoRA sync into vLLM's LoRA support (``rollout.engine.lora_sync=adapter``), in one spawned world of 2
gloo processes: a LoRA policy at Megatron TP2 -> one vLLM engine at rollout tp 2 (vLLM's CPU build), so the adapter
is gathered from TP shards (``B`` of qkv/fc1 split by rows, ``A`` of proj/fc2 by columns) and sliced again by vLLM.

Every ``lora_B`` is set to a random matrix drawn from its name (the initial adapter is zero, which would make the
rollout equal the base model's whatever the sync does). Then, in one engine:

- parity: vLLM's log-probs of its sampled tokens equal the training model's with adapters (the rollout check
  ``rollout/logprob_abs_diff``, tolerance 1e-5 as the other vLLM tests), after the first sync and after real
  updates; the base model's log-probs of the same tokens are far off (the adapter is in use);
- bytes: the first sync streams the base weights and loads the adapter; later syncs move the adapter alone;
- sabotage (patched in the rank, vLLM itself untouched): the adapter request dropped on its way to generate is
  refused by the engine, naming the adapter, and the rows it would have produced are far over the tolerance; a
  stale adapter kept (verl#7495: the name and id of the first version reused, so vLLM keeps serving it) passes the
  engine's own checks and is caught by the rollout check.
"""

from __future__ import annotations

import importlib.util
import time
import zlib

import pytest
import torch

from megarl.checkpoint.convert import convert_hf_to_megatron
from megarl.testing.dist import from_collect_rank, run_world, training_log_probs

pytestmark = [
    pytest.mark.dist, pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (make install brings its CPU build)"),
]

PROMPTS = [[5, 17, 42], [8, 9], [100, 3, 4, 77, 12], [250], [31, 32, 33, 34], [60, 61]]
RANK, ALPHA = 4, 8.0
TOLERANCE = 1e-5  # fp32 parity, as tests/distributed/test_vllm_hybrid.py


def _random_b(policy, layout) -> None:
    """Every ``lora_B`` a random matrix drawn whole from its global name, this rank's shard of it."""
    from megarl.models import adapters, mapping
    from megarl.models.provider import global_named_parameters

    maps = {m.mcore: m for m in mapping.tensor_maps(policy.spec)}
    tp_rank = layout.coords(torch.distributed.get_rank()).tp
    with torch.no_grad():
        for c in policy.engine.chunks:
            for n, p in global_named_parameters(c):
                if n.endswith(".lora_B"):
                    m = maps[adapters.base_name(n)]
                    shape = (mapping.mcore_shape(m, policy.spec, 0)[0], RANK)
                    full = torch.randn(*shape, generator=torch.Generator().manual_seed(zlib.crc32(n.encode()))) * 0.05
                    p.copy_(mapping.tp_shard(m, full, layout.tp, tp_rank) if m.tp_dim == 0 else full)


def _world(rank, world_size, ckpt):
    from megarl.algos.config import AlgorithmConfig
    from megarl.controller.role import WorkerContext
    from megarl.data.batch import Batch, prompt_batch
    from megarl.engine.config import (
        EngineConfig,
        LoRAConfig,
        MicroBatchConfig,
        OptimConfig,
        OptimizerName,
        Precision,
    )
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.policy import PolicyRole
    from megarl.rollout.base import SamplingParams, WeightUpdateError
    from megarl.rollout.config import LoRASync, RolloutBackend, RolloutConfig
    from megarl.rollout.mismatch import logprob_abs_diff
    from megarl.rollout.vllm_lora import AdapterVersions

    layout = ParallelLayout.for_world(world_size, tp=2)
    init_distributed(layout)
    ctx = WorkerContext(rank, world_size, layout, layout.coords(rank), "127.0.0.1", "local", 0, "cpu")
    engine = EngineConfig(optim=OptimConfig(optimizer=OptimizerName.SGD, lr=0.05, clip_grad=0.0,
                                            use_distributed_optimizer=False),
                          micro_batch=MicroBatchConfig(max_tokens=64, max_size=4),
                          lora=LoRAConfig(rank=RANK, alpha=ALPHA))
    rollout = RolloutConfig(backend=RolloutBackend.VLLM, tp=2, dtype=Precision.FP32, bucket_mb=0.05, kv_cache_mb=32,
                            max_model_len=64, enforce_eager=True, lora_sync=LoRASync.ADAPTER)
    role = PolicyRole(ctx, checkpoint_dir=ckpt, engine=engine, algorithm=AlgorithmConfig(recompute_old_log_probs=True),
                      temperature=1.0, rollout=rollout, seed=5)
    _random_b(role, layout)
    vllm_engine = role.rollout.rollout
    res: dict = {"syncs": [], "moved": []}

    def step(seed, update=True):
        """sync, sample, the rollout check; then a real update (random advantages) unless ``update`` is False."""
        sync = role.sync_weights(seed)
        batch = role.generate(prompt_batch(PROMPTS), SamplingParams(n=2, temperature=1.0, max_new_tokens=6,
                                                                    seed=seed))
        role.to_train()
        rows = from_collect_rank(batch, layout)
        old, diff = training_log_probs(role, rows, layout)
        res["syncs"].append(sync.metrics())
        if update:
            adv = torch.randn(rows["input_ids"].shape, generator=torch.Generator().manual_seed(seed))
            role.update(rows.select("input_ids", "attention_mask", "response_mask").update(
                Batch.from_dict({"old_log_probs": old, "advantages": adv * rows["response_mask"]})))
            moved = role.compute_log_probs(rows.select("input_ids", "attention_mask"))
            moved = from_collect_rank(None if moved is None else moved["log_probs"], layout)
            mask = rows["response_mask"]
            res["moved"].append(float(((moved - old).abs() * mask).sum() / mask.sum()))
        return rows, diff

    # 1. the first sync (base weights + adapter), then a sync of the updated adapter
    t0 = time.perf_counter()
    rows, diff = step(1)
    base = role.compute_log_probs(rows.select("input_ids", "attention_mask"), adapters=False)
    base = from_collect_rank(None if base is None else base["log_probs"], layout)
    res["base_diff"] = logprob_abs_diff(base, rows["rollout_log_probs"], rows["response_mask"])
    res["diffs"] = [diff, step(2)[1]]
    res["seconds"] = {"two_steps": time.perf_counter() - t0}

    # 2. sabotage: a stale adapter kept -- the next version reuses the name and id of the one held now, which vLLM
    # then keeps serving (verl#7495); the engine's own checks pass
    real_load = AdapterVersions.load
    held = vllm_engine._adapters.current

    def reusing(self, tensors, config, version, add, ids):
        from vllm.lora.request import LoRARequest

        self.current = LoRARequest(held.lora_name, held.lora_int_id, held.lora_path)
        add(self.current)
        return self.current

    AdapterVersions.load = reusing
    res["stale_diff"] = step(3, update=False)[1]
    AdapterVersions.load = real_load

    # 3. sabotage: the adapter request does not reach generate
    real_generate = vllm_engine._llm.generate

    def without_adapter(*args, **kwargs):
        kwargs.pop("lora_request", None)
        return real_generate(*args, **kwargs)

    vllm_engine._llm.generate = without_adapter
    role.sync_weights(4)
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=4)
    try:
        role.generate(prompt_batch(PROMPTS), sampling)
        res["dropped_error"] = ""
    except WeightUpdateError as e:
        res["dropped_error"] = str(e)
    real_check = AdapterVersions.check_outputs
    AdapterVersions.check_outputs = lambda self, outputs: None  # what the rollout check sees without the engine's
    batch = role.generate(prompt_batch(PROMPTS), sampling)
    AdapterVersions.check_outputs = real_check
    vllm_engine._llm.generate = real_generate
    role.to_train()
    res["dropped_diff"] = training_log_probs(role, from_collect_rank(batch, layout), layout)[1]

    # 4. honest again: a new name and id load the current adapter
    res["after_diff"] = step(5, update=False)[1]
    res["seconds"]["total"] = time.perf_counter() - t0
    return res


@pytest.fixture(scope="module")
def world(tiny_hf, tmp_path_factory):
    hf = tiny_hf("qwen2_vllm")
    ckpt = tmp_path_factory.mktemp("vllm_lora") / "mc"
    convert_hf_to_megatron(hf, ckpt, tp=2)
    return run_world(_world, 2, str(ckpt), timeout_s=900)


def test_adapter_sync_parity_bytes_and_sabotage(world):
    r = world[0]
    print("adapter sync: rollout gaps", r["diffs"], "base model gap", r["base_diff"], "moved", r["moved"],
          "stale", r["stale_diff"], "dropped", r["dropped_diff"], "after", r["after_diff"], r["seconds"])
    print("syncs (rank 0):", [{k: v for k, v in s.items() if k.startswith("reshard/")} for s in r["syncs"]])
    # parity after the first sync and after every update; the base model is far from what vLLM sampled
    assert max(r["diffs"]) < TOLERANCE, r["diffs"]
    assert r["base_diff"] > 100 * TOLERANCE and min(r["moved"]) > 100 * TOLERANCE, (r["base_diff"], r["moved"])
    # bytes: the base weights once, then the adapter alone
    first, later = r["syncs"][0], r["syncs"][1:]
    moved = [s["reshard/bytes_sent"] + s["reshard/bytes_received"] + s["reshard/bytes_kept"] for s in r["syncs"]]
    assert moved[0] > 0 and all(m == 0 for m in moved[1:]), moved
    assert all(s["reshard/adapter_bytes"] == first["reshard/adapter_bytes"] > 0 for s in later)
    # sabotage: the engine refuses rows without the adapter, and the rollout check would stop them too
    assert "LoRA adapter None" in r["dropped_error"] and "did not reach generate" in r["dropped_error"]
    assert r["dropped_diff"] > 100 * TOLERANCE
    # a stale adapter passes the engine's checks; the rollout check catches it
    assert r["stale_diff"] > 100 * TOLERANCE and r["after_diff"] < TOLERANCE, (r["stale_diff"], r["after_diff"])
