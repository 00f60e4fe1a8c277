"""Megatron on 4 gloo processes -> vLLM rollout engines (vLLM's CPU build), through the policy's hybrid
engine: TP2xPP2 -> rollout tp 2 (2 replicas: the pipeline stages gathered, the TP shards kept, as in the 70B
example's TP8xPP4 -> rollout tp 8), TP4 -> rollout tp 2 (the layout whose HybridFlow grouping is strided,
which vLLM cannot build: here its consecutive groups run), and a Qwen3-MoE at DP4xEP2 -> rollout tp 1 (4
replicas; every rank receives the experts its expert-parallel peer holds; vLLM's fused-MoE layers, repacked for
its CPU kernel after each sync). Colocated vLLM TP groups must lie inside one data-parallel replica, so an MoE
trained at tp 1 rolls out at tp 1 here; tests/rollout/test_vllm_engine.py checks the experts' TP slices at
rollout tp 2. TP2xPP2 -> rollout tp 1 (TP merged and stages gathered) is the embedded engine's world in
tests/distributed/test_hybrid.py, bit-exact on the weights; the vLLM side of a sync does not depend on the
training layout (it loads what the plan delivers), so that layout is not run again here.

References: `transformers.generate` and a transformers forward on the source HF directory (greedy tokens,
fp32 log-probs of sampled tokens), and the training model's own log-probs after real updates (the weights
vLLM samples with must be the updated ones).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megarl.checkpoint.convert import convert_hf_to_megatron
from megarl.testing.dist import from_collect_rank, run_world, training_log_probs

pytestmark = [pytest.mark.dist, pytest.mark.slow]

PROMPTS = [[5, 17, 42], [8, 9], [100, 3, 4, 77, 12], [250], [31, 32, 33, 34], [60, 61], [7, 7, 7], [199, 2, 45]]
MAX_NEW = 6
STEPS = 3


def _prompt_batch():
    from megarl.data.batch import prompt_batch

    return prompt_batch(PROMPTS)


def _rows(batch):  # results travel as JSON
    return {k: batch[k].tolist() for k in ("input_ids", "response_mask", "rollout_log_probs", "old_log_probs")}


def _world(rank, world_size, ckpt, tp, pp, ep, rollout_tp):
    from megarl.algos.config import AlgorithmConfig
    from megarl.controller.role import WorkerContext
    from megarl.data.batch import Batch
    from megarl.engine.config import EngineConfig, MicroBatchConfig, OptimConfig, OptimizerName, Precision
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.policy import PolicyRole
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.config import RolloutBackend, RolloutConfig

    layout = ParallelLayout.for_world(world_size, tp=tp, pp=pp, ep=ep)
    init_distributed(layout)
    ctx = WorkerContext(rank, world_size, layout, layout.coords(rank), "127.0.0.1", "local", 0, "cpu")
    engine = EngineConfig(optim=OptimConfig(optimizer=OptimizerName.SGD, lr=0.05, clip_grad=0.0,
                                            use_distributed_optimizer=False),
                          micro_batch=MicroBatchConfig(max_tokens=64, max_size=4))
    # buckets of ~10 KB: every decoder layer (~250 KB) is cut into many buckets, q/k/v and their biases apart
    rollout = RolloutConfig(backend=RolloutBackend.VLLM, tp=rollout_tp, dtype=Precision.FP32, bucket_mb=0.01,
                            kv_cache_mb=32, max_model_len=64, enforce_eager=True)
    # the updates below take their PPO ratio's denominator from old_log_probs (the training model's, recomputed)
    role = PolicyRole(ctx, checkpoint_dir=ckpt, engine=engine, algorithm=AlgorithmConfig(recompute_old_log_probs=True),
                      temperature=1.0, rollout=rollout, seed=5)
    torch.distributed.barrier()  # every rank has unlinked its groups' segments
    res: dict = {"frees": role.rollout.rollout.sleep_frees_memory,
                 # vLLM's CPU communicators' shared memory, by name: unlinked once mapped, or the next run fails
                 "shm_left": sorted(p.name for p in Path("/dev/shm").glob("*-cpushm_*"))}

    # 1. greedy: every replica generates its share of the prompts
    sync = role.sync_weights()
    greedy = role.generate(_prompt_batch(), SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))
    role.to_train()
    _, diff = training_log_probs(role, from_collect_rank(greedy, layout), layout)
    if greedy is not None:
        res["greedy"] = [row[: int(m.sum())].tolist() for row, m in zip(greedy["input_ids"], greedy["attention_mask"],
                                                                          strict=True)]
        res["greedy_metrics"] = sync.metrics() | greedy.meta["metrics"] | {"rollout/logprob_abs_diff": diff}

    # 2. seeded sampling: reproducible; log-probs checked against transformers by the test
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW, seed=123)
    role.sync_weights()
    a = role.generate(_prompt_batch(), sampling)
    b = role.generate(_prompt_batch(), sampling)
    role.to_train()
    old, _ = training_log_probs(role, from_collect_rank(a, layout), layout)
    if a is not None:
        res["sampled"] = _rows(a.update(Batch.from_dict({"old_log_probs": old})))
        res["same_seed_equal"] = torch.equal(a["input_ids"], b["input_ids"])

    # 3. unseeded sampling, straight from every rank's engine: equal within a TP group, fresh per call
    role.sync_weights()
    unseeded = SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW)
    res["unseeded"] = [role.rollout.rollout.generate(PROMPTS, unseeded).token_lists() for _ in range(2)]
    role.to_train()

    # 4. real updates: after each, the next rollout's log-probs must equal the updated training model's
    steps = []
    for step in range(STEPS):
        role.sync_weights()
        batch = role.generate(_prompt_batch(), SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW,
                                                              seed=1000 + step))
        role.to_train()
        rows = from_collect_rank(batch, layout)
        old, diff = training_log_probs(role, rows, layout)
        if batch is not None:
            steps.append(diff)
        g = torch.Generator().manual_seed(step)
        adv = torch.randn(rows["input_ids"].shape, generator=g) * rows["response_mask"]
        role.update(rows.select("input_ids", "attention_mask", "response_mask").update(
            Batch.from_dict({"old_log_probs": old, "advantages": adv})))
        moved = role.compute_log_probs(rows.select("input_ids", "attention_mask"))
        if moved is not None:  # how far this update moved the policy on the rows it trained on
            mask = rows["response_mask"]
            res.setdefault("moved", []).append(float(((moved["log_probs"] - old).abs() * mask).sum() / mask.sum()))
    if steps:
        res["step_diffs"] = steps
    return res


WORLDS = {  # name: (tiny model, training tp, pp, ep, rollout tp)
    "tp2pp2_rollout_tp2": ("qwen2_vllm", 2, 2, 1, 2),
    "tp4_rollout_tp2": ("qwen2_vllm_kv4", 4, 1, 1, 2),  # megatron-core TP4 needs 4 KV heads
    "moe_ep2_rollout_tp1": ("qwen3_moe_vllm", 1, 1, 2, 1),
}


@pytest.fixture(scope="module", params=list(WORLDS))
def world(request, tiny_hf, tmp_path_factory):
    name, tp, pp, ep, rollout_tp = WORLDS[request.param]
    hf = tiny_hf(name)
    ckpt = tmp_path_factory.mktemp("vllm_hybrid") / "mc"
    convert_hf_to_megatron(hf, ckpt, tp=tp, pp=pp, ep=ep)
    return rollout_tp, hf, run_world(_world, 4, str(ckpt), tp, pp, ep, rollout_tp, timeout_s=1200)


@pytest.fixture(scope="module")
def references(tiny_hf):
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(hf):
        if hf not in cache:
            cache[hf] = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
        return cache[hf]

    return get


def _collected(results, key):
    return [r[key] for r in results if key in r][0]  # the collect rank's batch (or the first reporting rank)


def test_greedy_of_every_replica_equals_transformers(world, references):
    _, hf, results = world
    reference = references(hf)
    expected = []
    for p in PROMPTS:
        out = reference.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        expected.append(out[0].tolist())
    assert _collected(results, "greedy") == expected
    metrics = _collected(results, "greedy_metrics")
    assert metrics["rollout/logprob_abs_diff"] < 1e-5
    assert metrics["rollout/sleep_frees_memory"] == 0.0  # vLLM cannot sleep on CPU, and says so
    assert not any(r["frees"] for r in results)
    assert all(r["shm_left"] == [] for r in results)


def test_sampled_log_probs_match_a_transformers_forward(world, references):
    _, hf, results = world
    reference = references(hf)
    rows = {k: torch.tensor(v) for k, v in _collected(results, "sampled").items()}
    assert _collected(results, "same_seed_equal")
    with torch.no_grad():
        logits = reference(rows["input_ids"]).logits.double()
    ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, rows["input_ids"][:, 1:, None])[..., 0]
    mask = rows["response_mask"][:, 1:].bool()
    diff = (ref - rows["rollout_log_probs"][:, 1:].double()).abs()[mask]
    # fp32 noise floor on these tokens: megatron-core's own log-probs against the same transformers forward
    floor = (ref - rows["old_log_probs"][:, 1:].double()).abs()[mask]
    print(f"|vLLM - transformers| mean {diff.mean():.2e} max {diff.max():.2e}; "
          f"|megatron-core - transformers| mean {floor.mean():.2e} max {floor.max():.2e}")
    assert mask.sum() >= len(PROMPTS) * 2 and diff.mean() < 1e-5, diff.mean()
    assert diff.max() < max(1e-5, 2 * floor.max()), (diff.max(), floor.max())


def test_unseeded_sampling_is_fresh_and_equal_within_a_tp_group(world):
    tp, _, results = world
    for r in results:
        first, second = r["unseeded"]
        assert first != second  # two unseeded calls differ
    for start in range(0, len(results), tp):
        group = [results[r]["unseeded"] for r in range(start, start + tp)]
        assert all(g == group[0] for g in group)
    if tp == 1:  # replicas are seeded apart
        assert results[0]["unseeded"] != results[1]["unseeded"]


def test_updated_weights_reach_vllm_every_step(world):
    _, _, results = world
    diffs = _collected(results, "step_diffs")
    assert len(diffs) == STEPS and max(diffs) < 1e-5, diffs
    moved = _collected(results, "moved")
    assert min(moved) > 1e-2, moved  # each update moved the policy far beyond the tolerance above
