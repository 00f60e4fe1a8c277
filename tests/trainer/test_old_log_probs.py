"""Skipping the old-log-prob forward (one optimizer step per batch): same update, rollout check kept.

References: the recompute path on the same rows and weights (old log-probs from a forward of their
own), float64 sums of hand-computed quantities (|training - rollout| log-prob, k3 KL to a reference)
in the test, and the parameters before an update that must be refused; for the trainer, a first step
of the same run with recomputation forced (metrics, and weights converted back to HF).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megarl.checkpoint.convert import convert_hf_to_megatron, convert_megatron_to_hf
from megarl.testing.dist import run_world

pytestmark = [pytest.mark.dist]

PROMPTS = [[[5, 17, 42], [8, 9], [100, 3, 4, 77, 12]], [[250], [31, 32, 33, 34], [60, 61, 7]]]  # per DP rank
LIMIT = 0.05  # rollout.engine.max_logprob_abs_diff of the skipping policy
SHIFT = 0.01  # the rollout log-probs are moved by SHIFT * N(0, 1): a known, allowed gap
BAD_SHIFT = 1.0  # ... or by BAD_SHIFT * |N(0, 1)| + BAD_SHIFT: a gap over LIMIT


def _prompts(rank):
    from megarl.data.batch import Batch

    rows = PROMPTS[rank]
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for i, p in enumerate(rows):
        ids[i, : len(p)] = torch.tensor(p)
    return Batch.from_dict({"prompt_ids": ids, "prompt_lengths": torch.tensor([len(p) for p in rows])})


def _params(role):
    return [p.detach().clone() for m in role.engine.model for p in m.parameters()]


def _global_token_mean(per_token, mask):
    sums = torch.stack([(per_token.double() * mask).sum(), mask.double().sum()])
    torch.distributed.all_reduce(sums)
    return (sums[0] / sums[1]).item()


def _world(rank, world_size, ckpt):
    import dataclasses

    from megarl.algos.config import AlgorithmConfig
    from megarl.controller.role import WorkerContext
    from megarl.data.batch import Batch
    from megarl.engine.config import EngineConfig, MicroBatchConfig, OptimConfig
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.policy import PolicyRole
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.config import RolloutConfig
    from megarl.rollout.mismatch import RolloutMismatchError

    layout = ParallelLayout.for_world(world_size, tp=1, pp=1)  # DP 2: metrics are reduced across ranks
    init_distributed(layout)
    ctx = WorkerContext(rank, world_size, layout, layout.coords(rank), "127.0.0.1", "local", 0, "cpu")
    # several micro-batches per rank: the metrics' weights must add up over them. The recomputing forward is
    # micro-batched as the update is, so the recomputed log-probs are bit-identical to the update's own (with
    # other groupings the GEMMs round differently, and Adam's first step turns ~1e-7 relative gradient
    # differences on near-zero gradients into lr-sized ones)
    mb = MicroBatchConfig(max_tokens=24, max_size=2)
    engine = EngineConfig(optim=OptimConfig(lr=1e-2), micro_batch=mb, forward_micro_batch=mb)
    recompute = PolicyRole(ctx, checkpoint_dir=ckpt, engine=engine, temperature=1.0, rollout=RolloutConfig(),
                           algorithm=AlgorithmConfig(entropy_coef=0.01, kl_loss_coef=0.1, recompute_old_log_probs=True))
    skip = PolicyRole(ctx, checkpoint_dir=ckpt, engine=engine, temperature=1.0,
                      algorithm=AlgorithmConfig(entropy_coef=0.01, kl_loss_coef=0.1, recompute_old_log_probs=False),
                      rollout=RolloutConfig(max_logprob_abs_diff=LIMIT))
    res = {}
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=5, seed=7 + rank)

    # generation is sampling only for both policies (one rollout phase each: sync, generate, back to training)
    recompute.sync_weights()
    rows = recompute.generate(_prompts(rank), sampling)
    recompute.to_train()
    skip.sync_weights()
    skipped = skip.generate(_prompts(rank), sampling)
    skip.to_train()
    res["generate_keys"] = sorted(rows.tensors.keys()), sorted(skipped.tensors.keys())
    res["generate_metrics"] = sorted(rows.meta["metrics"]), sorted(skipped.meta["metrics"])
    res["same_samples"] = torch.equal(rows["input_ids"], skipped["input_ids"])
    # the recompute path's old log-probs: a training forward of their own after the rollout phase (DP2, TP1 x PP1:
    # every rank owns its rows), as the trainer takes them
    old_lp = recompute.compute_log_probs(rows.select("input_ids", "attention_mask"))["log_probs"]
    rows = rows.update(Batch.from_dict({"old_log_probs": old_lp}))

    mask = rows["response_mask"]
    g = torch.Generator().manual_seed(rank)
    noise = [torch.randn(mask.shape, generator=g) * mask for _ in range(3)]
    common = {"advantages": noise[0], "ref_log_probs": rows["rollout_log_probs"] + 0.2 * noise[1]}
    base = rows.select("input_ids", "attention_mask", "response_mask")

    # 1. a rollout far from the training model: refused before the optimizer step
    before = _params(skip)
    bad = rows["rollout_log_probs"] + (BAD_SHIFT * noise[2].abs() + BAD_SHIFT) * mask
    try:
        skip.update(base.update(Batch.from_dict(common | {"rollout_log_probs": bad})))
        res["refused"] = None
    except RolloutMismatchError as e:
        res["refused"] = str(e)
    res["unchanged_after_refusal"] = all(torch.equal(a, b) for a, b in zip(before, _params(skip), strict=True))

    # 2. the same update both ways (the skipping policy right after its refused one)
    shifted = rows["rollout_log_probs"] + SHIFT * noise[2]
    # StepResults as dicts: results travel as JSON
    res["skip"] = dataclasses.asdict(
        skip.update(base.update(Batch.from_dict(common | {"rollout_log_probs": shifted}))))
    # the trainer sends the rollout log-probs on both paths (the mismatch correction's denominator)
    res["recompute"] = dataclasses.asdict(recompute.update(base.update(Batch.from_dict(
        common | {"old_log_probs": rows["old_log_probs"], "rollout_log_probs": shifted}))))
    res["param_max_diff"] = max((a - b).abs().max().item()
                                for a, b in zip(_params(skip), _params(recompute), strict=True))
    res["param_moved"] = max((a - b).abs().max().item() for a, b in zip(before, _params(skip), strict=True))

    # independent: float64 global token means from the recompute path's old log-probs
    old = rows["old_log_probs"].double()
    res["expected_diff"] = _global_token_mean((old - shifted.double()).abs(), mask)
    d = (common["ref_log_probs"].double() - old).clamp(-20, 20)
    res["expected_kl"] = _global_token_mean((d.exp() - d - 1).clamp(-10, 10), mask)
    return res


@pytest.fixture(scope="module")
def world(tiny_hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("old_log_probs")
    convert_hf_to_megatron(tiny_hf("qwen2_untied"), root / "mc", tp=1, pp=1)
    return run_world(_world, 2, str(root / "mc"), timeout_s=900)


def test_generate_skips_the_forward(world):
    """``generate`` samples only, whatever the algorithm: neither policy's adds old log-probs or runs the
    rollout check (the recompute path's forward is the caller's ``compute_log_probs`` after ``to_train``)."""
    for r in world:
        with_recompute, without = r["generate_keys"]
        assert "old_log_probs" not in with_recompute and "old_log_probs" not in without
        assert with_recompute == without
        m_recompute, m_without = r["generate_metrics"]
        assert m_recompute == m_without
        assert not {"rollout/logprob_abs_diff", "timing/old_log_probs_s"} & set(m_recompute)
        assert r["same_samples"]


def _step_results(r):
    from megarl.engine.results import StepResult

    return StepResult(**r["skip"]), StepResult(**r["recompute"])


def test_update_equals_the_recompute_path(world):
    r = world[0]
    skip, recompute = _step_results(r)
    pairs = {"loss": (skip.loss, recompute.loss), "grad_norm": (skip.grad_norm, recompute.grad_norm)}
    pairs |= {k: (skip.terms[k], recompute.terms[k]) for k in ("pg_loss", "entropy", "kl_loss")}
    for k, (a, b) in pairs.items():
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7), (k, a, b)
    # ratio exactly 1
    assert skip.terms["clip_frac"] == 0 and skip.terms["approx_kl_k1"] == 0 and skip.terms["approx_kl_k3"] == 0
    assert abs(recompute.terms["approx_kl_k1"]) < 1e-6  # same weights: the recomputed ratio is 1 up to rounding
    assert r["param_moved"] > 1e-3 and r["param_max_diff"] < 1e-4 * r["param_moved"]  # float rounding
    assert all(_step_results(w)[0] == skip and w["param_max_diff"] == r["param_max_diff"] for w in world)  # DP-reduced


def test_update_reports_rollout_gap_and_kl(world):
    r = world[0]
    skip, recompute = _step_results(r)
    assert "rollout/logprob_abs_diff" not in recompute.terms and "kl" not in recompute.terms
    # the global token mean over both DP ranks and all micro-batches, against the independent forward
    assert 0.5 * SHIFT < r["expected_diff"] < 1.5 * SHIFT
    assert math.isclose(skip.terms["rollout/logprob_abs_diff"], r["expected_diff"], rel_tol=1e-4)
    assert r["expected_kl"] > 1e-3 and math.isclose(skip.terms["kl"], r["expected_kl"], rel_tol=1e-4)
    assert all(math.isclose(w["expected_diff"], r["expected_diff"], rel_tol=1e-12) for w in world)


def test_mismatch_refused_before_the_optimizer_step(world):
    for r in world:
        assert r["refused"] is not None and f"(limit {LIMIT})" in r["refused"]
        assert r["unchanged_after_refusal"]


# ---------------------------------------------------------------------------------------- trainer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_addition_tiny" / "config.yaml"


def _run(task, out, recompute, steps):
    from megarl.config.train import load_config
    from megarl.trainer.trainer import run

    extra = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
             "trainer.output_dir": out, "trainer.tensorboard": "false", "trainer.total_steps": steps,
             "trainer.save_every": 1, "trainer.val_every": 0, "rollout.max_new_tokens": 4,
             "rollout.engine.max_logprob_abs_diff": 1e-4, "algorithm.mini_batches": 1,
             "algorithm.recompute_old_log_probs": recompute,
             # both paths in-process
             "cluster.launcher": "local", "cluster.pools.main.devices_per_node": 1, "cluster.pools.main.tp": 1}
    cfg = load_config(EXAMPLE, [f"{k}={v}" for k, v in extra.items()])
    history = run(cfg)
    convert_megatron_to_hf(out / "checkpoints" / "step_000001" / "policy", out / "hf")
    return cfg, history


@pytest.mark.slow
def test_trainer_first_step_same_without_recompute(tmp_path):
    from safetensors.torch import load_file

    from megarl.testing.addition import make_task

    task = make_task(tmp_path / "task")
    cfg, (skip, skip_2) = _run(task, tmp_path / "auto", "null", 2)  # auto: GRPO, one step, KL as a loss term
    assert not cfg.algorithm.recomputes_old_log_probs
    _, (recompute,) = _run(task, tmp_path / "forced", "true", 1)

    def values(m):
        return {k: v for k, v in m.items() if not k.startswith(("timing/", "throughput/", "memory/"))}

    assert "timing/old_log_probs_s" in recompute and "timing/old_log_probs_s" not in skip
    assert values(skip).keys() == values(recompute).keys()  # rollout/logprob_abs_diff and actor/kl included
    for k, v in values(recompute).items():
        if k == "rollout/logprob_abs_diff":  # rounding noise on both sides (rollout engine = training model)
            assert v < 1e-5 and skip[k] < 1e-5
        else:
            assert math.isclose(skip[k], v, rel_tol=1e-5, abs_tol=1e-7), (k, skip[k], v)
    assert skip["actor/kl"] == 0 and skip["actor/approx_kl_k3"] == 0  # step 1: policy = reference; ratio 1
    # step 2, after an update and a weight sync: the update's forward still matches the rollout's
    assert skip_2["actor/kl"] > 0 and skip_2["rollout/logprob_abs_diff"] < 1e-5 and skip_2["actor/approx_kl_k3"] == 0
    a, b = load_file(str(tmp_path / "auto" / "hf" / "model.safetensors")), load_file(
        str(tmp_path / "forced" / "hf" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.allclose(a[n], b[n], rtol=0, atol=1e-6) for n in a)
