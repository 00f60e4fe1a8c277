"""Planner with split placement (issue #23 item 7): memory per pool, weight-sync bytes between the pools and
the step-time model of the sync, one_step_off and async modes, against hand arithmetic.

The model is a Llama of 4 layers, hidden 64, FFN 128, 4 heads of 16 with 2 KV groups, vocabulary 1024 (a
multiple of 128 * TP and of 64: neither Megatron nor vLLM pads it), untied: every byte count below is
written out from those numbers, not from the planner's or the resharding plan's own helpers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megarl.errors import ConfigError, LayoutError
from megarl.models.spec import spec_from_hf_config
from megarl.parallel.layout import ParallelLayout
from megarl.planner import (
    GB,
    Cluster,
    Mode,
    Phase,
    Pool,
    Recompute,
    Role,
    StageTimes,
    Workload,
    candidate_layouts,
    plan_layout,
    predict_modes,
    predict_step,
    render,
)

REPO = Path(__file__).resolve().parents[2]
HF = dict(architectures=["LlamaForCausalLM"], vocab_size=1024, hidden_size=64, intermediate_size=128,
          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, hidden_act="silu")
H, F, V, L, NH, NG, D = 64, 128, 1024, 4, 4, 2, 16
# per layer: q/k/v rows (4 + 2 + 2 heads of 16) x 64, o_proj 64 x 64, gate/up/down 3 x 128 x 64, two norms of 64
LAYER_SPLIT = (NH + 2 * NG) * D * H + NH * D * H + 3 * F * H
LAYER_NORMS = 2 * H
PARAMS = L * (LAYER_SPLIT + LAYER_NORMS) + H + 2 * V * H  # + final norm, embedding, lm_head
SPLIT_PARAMS = L * LAYER_SPLIT + 2 * V * H  # what tensor parallelism cuts
REPL_PARAMS = L * LAYER_NORMS + H  # the norms every TP rank holds whole


@pytest.fixture(scope="module")
def spec():
    return spec_from_hf_config(dict(HF))


def test_hand_parameter_count(spec):
    assert PARAMS == 279104 == SPLIT_PARAMS + REPL_PARAMS
    assert spec.num_parameters() == PARAMS


# ----------------------------------------------------------------------------------- sync bytes


@pytest.mark.parametrize("dtype, itemsize", [("bfloat16", 2), ("float32", 4)])
def test_rollout_tp1_each_replica_receives_the_whole_model(spec, dtype, itemsize):
    """Rollout TP1 on 4 GPUs: 4 replicas, each receiving every HF tensor whole; the 4 training GPUs
    (TP2 x PP2) only send, each stage's two TP ranks together that stage's share, 4 times."""
    cluster = Cluster(nodes=1, gpus_per_node=8, gpu_mem_gb=80, rollout_gpus=4)
    plan = plan_layout(spec, cluster, Workload(roles=(Role.POLICY,), rollout_dtype=dtype),
                       ParallelLayout(tp=2, pp=2, dp=1), 1)
    r = plan.reshard
    m = PARAMS * itemsize
    assert r.per_rank_received == (0, 0, 0, 0, m, m, m, m)
    assert r.per_rank_sent[4:] == (0, 0, 0, 0)
    assert r.total == 4 * m and r.total_inter == 0  # one node
    assert r.received_max == r.received_mean == m and r.sent_mean == m  # 4 x M over 4 senders
    # stage 0: layers 0-1 and the embedding; stage 1: layers 2-3, the final norm and lm_head (ranks TP-fastest)
    stage0 = (2 * (LAYER_SPLIT + LAYER_NORMS) + V * H) * itemsize
    stage1 = (2 * (LAYER_SPLIT + LAYER_NORMS) + H + V * H) * itemsize
    sent = r.per_rank_sent
    assert (sent[0] + sent[1], sent[2] + sent[3]) == (4 * stage0, 4 * stage1)
    assert r.seconds == pytest.approx(max(max(sent), m) / (300 * GB))


def test_rollout_tp2_replicas_receive_vllm_halves(spec):
    """Rollout TP2 on 4 GPUs: 2 replicas; a rollout GPU holds half of every split tensor and every norm."""
    cluster = Cluster(nodes=1, gpus_per_node=8, gpu_mem_gb=80, rollout_gpus=4)
    plan = plan_layout(spec, cluster, Workload(roles=(Role.POLICY,)), ParallelLayout(tp=1, pp=2, dp=2), 2)
    r = plan.reshard
    per_gpu = 2 * (SPLIT_PARAMS // 2 + REPL_PARAMS)
    assert r.per_rank_received[4:] == (per_gpu,) * 4
    assert r.total == 4 * per_gpu == 2 * (2 * PARAMS + 2 * REPL_PARAMS)  # 2 replicas, norms twice in each
    gen = next(p for p in plan.pool_peaks(Pool.ROLLOUT) if p.phase is Phase.GENERATE)
    assert gen.terms[("rollout", "weights")] == per_gpu


def test_split_sync_crosses_nodes_and_spreads_over_data_parallel_replicas(spec):
    """2 nodes of 2 GPUs: training DP2 on node 0, two rollout TP1 replicas on node 1; replica g draws from
    training replica g, so each training GPU sends the model once, all of it over InfiniBand."""
    cluster = Cluster(nodes=2, gpus_per_node=2, gpu_mem_gb=80, rollout_gpus=2)
    r = plan_layout(spec, cluster, Workload(roles=(Role.POLICY,)), ParallelLayout(tp=1, pp=1, dp=2), 1).reshard
    m = 2 * PARAMS
    assert r.per_rank_sent == (m, m, 0, 0) and r.per_rank_received == (0, 0, m, m)
    assert r.total == r.total_inter == 2 * m and r.slowest_intra == 0
    assert r.seconds == pytest.approx(m / (40 * GB))


# ------------------------------------------------------------------------------- memory per pool


# no CUDA graphs and no runtime estimate: vLLM's own terms that remain are its profiled activations (below) and the
# KV cache its rounded-up budget adds
WORK = Workload(roles=(Role.POLICY,), micro_batch_tokens=32, prompt_tokens=8, response_tokens=8,
                recompute=Recompute.SELECTIVE, concurrent_seqs=4, bucket_mb=1 / 16,  # 65536-byte buckets
                enforce_eager=True, vllm_runtime_gb=0.0)
BUCKET = 65536
# vLLM's profile_run on a GPU under 70 GiB (8192 batched tokens, 256 sequences), bf16: per token the hidden state
# and residual (2h) and the MLP's gate/up and product (3F, wider than attention's (2*4 + 2*2) x 16 = 192), then the
# sampler's 256 rows of the vocabulary in bf16 and two fp32 copies
PROFILE = 8192 * (2 * H + 3 * F) * 2 + 256 * V * (2 + 4 + 4)


def _split_plan(spec, gpu_mem_gb=1.0):
    cluster = Cluster(nodes=1, gpus_per_node=4, gpu_mem_gb=gpu_mem_gb, reserved_gb=0.5, rollout_gpus=2)
    return plan_layout(spec, cluster, WORK, ParallelLayout(tp=1, pp=1, dp=2), 1)


def test_memory_per_pool_by_hand(spec):
    plan = _split_plan(spec)
    reserved = int(0.5 * GB)
    weights, grads, optimizer = 2 * PARAMS, 4 * PARAMS, 12 * PARAMS // 2  # bf16; fp32 grads; Adam over DP 2
    # activations: 2 sequences of 16 tokens; per token and layer 4h + (2*nh*d + 2*ng*d + 4F) = 960 values of 2 B,
    # 4 layers in flight (one stage); the last stage's fp32 logits and softmax, 8 B x 32 tokens x 1024
    acts = 4 * 32 * (4 * H + 2 * NH * D + 2 * NG * D + 4 * F) * 2 + 8 * 32 * V
    largest_shard = V * H * 2  # the embedding (and lm_head), whole at TP1
    train = {p.phase: p.terms for p in plan.pool_peaks(Pool.TRAINING)}
    assert set(train) == {Phase.TRAIN, Phase.SYNC}
    assert train[Phase.TRAIN] == {("policy", "weights"): weights, ("policy", "grads"): grads,
                                  ("policy", "optimizer"): optimizer, ("policy", "activations"): acts,
                                  ("reserved", ""): reserved}
    assert train[Phase.SYNC] == {("policy", "weights"): weights, ("policy", "grads"): grads,
                                 ("policy", "optimizer"): optimizer,
                                 ("policy", "reshard transient"): BUCKET + largest_shard, ("reserved", ""): reserved}
    rollout = {p.phase: p.terms for p in plan.pool_peaks(Pool.ROLLOUT)}
    kv = 2 * L * NG * D * 2 * (4 * 16)  # k and v, 4 layers, 2 heads of 16, 2 B, 4 sequences of 16 tokens
    # vLLM's budget: weights, KV cache and its profiled activations, rounded up to 0.01 of the 1 GB GPU; the
    # KV cache grows into the rounding (vLLM sizes it to the whole budget)
    need = 2 * PARAMS + kv + PROFILE
    assert plan.gpu_memory_utilization == math.ceil(100 * need / GB) / 100 == 0.02
    assert rollout[Phase.GENERATE] == {("rollout", "weights"): 2 * PARAMS, ("rollout", "kv cache"): kv,
                                       ("rollout", "profiled activations"): PROFILE, ("rollout", "cuda graphs"): 0,
                                       ("rollout", "runtime"): 0, ("rollout", "kv rounding"): int(0.02 * GB) - need,
                                       ("reserved", ""): reserved}
    assert rollout[Phase.SYNC] == rollout[Phase.GENERATE] | {("rollout", "reshard transient"): V * H * 2}
    assert plan.fits and plan.worst.pool is Pool.ROLLOUT and plan.worst.phase is Phase.SYNC


def test_colocated_pool_carries_both_engines(spec):
    """The same workload colocated: rollout weights and KV cache share the training GPUs (one pool)."""
    cluster = Cluster(nodes=1, gpus_per_node=2, gpu_mem_gb=1.0, reserved_gb=0.5)
    plan = plan_layout(spec, cluster, WORK, ParallelLayout(tp=1, pp=1, dp=2), 1)
    assert {p.pool for p in plan.peaks} == {Pool.TRAINING} and [p.phase for p in plan.peaks] == list(Phase)
    gen = next(p for p in plan.peaks if p.phase is Phase.GENERATE).terms
    assert gen[("rollout", "weights")] == 2 * PARAMS and ("policy", "grads") not in gen


def test_not_fitting_names_the_pool(spec):
    # 8 MB above the reserve: training (~4.7 MB of state and activations) fits; vLLM's budget, 0.03 x 508 MB, not
    plan = _split_plan(spec, gpu_mem_gb=0.508)
    assert not plan.fits
    assert [r.split(" needs")[0] for r in plan.reasons] == ["rollout pool: sync phase", "rollout pool: generate phase"]
    assert "rollout profiled activations" in plan.reasons[0] and "the fullest rollout GPU" in plan.reasons[0]
    small = _split_plan(spec, gpu_mem_gb=0.5005)  # now neither pool fits
    assert "training pool: train phase needs" in small.reason and "pipeline stage 0" in small.reason


def test_split_overrides_describe_both_pools(spec):
    cluster = Cluster(nodes=3, gpus_per_node=4, gpu_mem_gb=80, rollout_gpus=4)
    plan = plan_layout(spec, cluster, WORK, ParallelLayout(tp=2, pp=2, dp=2), 2)
    over = plan.overrides()
    # the training pool is the first 2 nodes, the rollout pool the third: tp = rollout.engine.tp, pp 1 (its default)
    assert over[:8] == ["cluster.pools.main.nodes=2", "cluster.pools.main.devices_per_node=4",
                        "cluster.pools.main.tp=2", "cluster.pools.main.pp=2", "cluster.pools.rollout.nodes=1",
                        "cluster.pools.rollout.devices_per_node=4", "cluster.pools.rollout.tp=2",
                        "cluster.placement.rollout=rollout"]
    assert "rollout.engine.tp=2" in over


def test_cluster_and_layout_checks(spec):
    with pytest.raises(ConfigError, match=r"rollout GPUs must lie in \[0, 8\)"):
        Cluster(nodes=1, gpus_per_node=8, gpu_mem_gb=80, rollout_gpus=8)
    with pytest.raises(ConfigError, match="a pool of 12 GPUs is neither whole nodes of 8"):
        Cluster(nodes=2, gpus_per_node=8, gpu_mem_gb=80, rollout_gpus=4)
    cluster = Cluster(nodes=1, gpus_per_node=8, gpu_mem_gb=80, rollout_gpus=3)
    assert (cluster.train_gpus, cluster.pool_shape(5), cluster.pool_shape(3)) == (5, (1, 5), (1, 3))
    with pytest.raises(LayoutError, match="needs 4 processes, but the world has 5"):
        plan_layout(spec, cluster, WORK, ParallelLayout(tp=2, pp=1, dp=2), 1)
    with pytest.raises(LayoutError, match="rollout pool's 3 ranks"):
        plan_layout(spec, cluster, WORK, ParallelLayout(tp=1, pp=1, dp=5), 2)


def test_candidate_layouts_fill_the_training_pool(spec):
    """8 GPUs, 4 of them for rollout: tp divides 4 GPUs and the 2 KV groups, pp the 4 layers; the rollout pool's
    tp, independent of training's, divides its 4 GPUs (and the 4 heads; 4 KV heads replicate the 2 groups)."""
    cluster = Cluster(nodes=1, gpus_per_node=8, gpu_mem_gb=80, rollout_gpus=4)
    got = {(lay.tp, lay.pp, lay.dp, g) for lay, g in candidate_layouts(spec, cluster)}
    training = {(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1)}
    assert got == {(*t, g) for t in training for g in (1, 2, 4)}


# ------------------------------------------------------------------------------------ step times


def test_step_times_by_hand():
    t = StageTimes(gen_s=10, train_s=8, sync_s=3, reward_s=2)
    sync = predict_step(t, Mode.SYNC)
    assert sync.step_s == 23  # 10 + 2 + 8 + 3
    assert sync.train_busy == pytest.approx(8 / 23) and sync.rollout_busy == pytest.approx(10 / 23)
    off = predict_step(t, Mode.ONE_STEP_OFF)  # max(10 + 2, 8) + 3
    assert off.step_s == 15 and off.train_busy == pytest.approx(8 / 15) and off.rollout_busy == pytest.approx(10 / 15)
    assert predict_step(t, Mode.ASYNC).step_s == 15  # K = 1: one_step_off's time
    assert predict_step(t, Mode.ASYNC, push_every=3).step_s == 13  # 12 + 3/3
    colocated = predict_step(t, Mode.SYNC, split=False)
    assert colocated.step_s == 23 and colocated.train_busy == colocated.rollout_busy == pytest.approx(18 / 23)


def test_training_bound_async_amortises_the_push():
    t = StageTimes(gen_s=4, train_s=9, sync_s=2)
    assert [p.step_s for p in predict_modes(t, push_every=4)] == [15, 11, 9.5]  # 4+9+2, 9+2, 9+2/4
    async_ = predict_modes(t, push_every=4)[2]
    assert async_.mode is Mode.ASYNC and async_.push_every == 4
    assert async_.train_busy == pytest.approx(9 / 9.5) and async_.rollout_busy == pytest.approx(4 / 9.5)
    assert [p.mode for p in predict_modes(t, split=False)] == [Mode.SYNC]


@pytest.mark.parametrize("kwargs, match", [
    (dict(mode=Mode.ONE_STEP_OFF, split=False), "needs the rollout engines on a pool of their own"),
    (dict(mode=Mode.ONE_STEP_OFF, push_every=2), "push_every=2 applies to async only"),
    (dict(mode=Mode.ASYNC, push_every=0), "positive integer"),
])
def test_step_time_rejects_impossible_modes(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        predict_step(StageTimes(gen_s=1, train_s=1, sync_s=1), **kwargs)


@pytest.mark.parametrize("values", [dict(gen_s=0, train_s=1, sync_s=1), dict(gen_s=1, train_s=1, sync_s=-1),
                                    dict(gen_s=1, train_s=float("nan"), sync_s=1)])
def test_stage_times_are_checked(values):
    with pytest.raises(ConfigError):
        StageTimes(**values)


# ------------------------------------------------------------------------------------------- CLI



def test_cli_split_placement_reports_both_pools_and_the_modes(tmp_path, plan_cli):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(HF))
    code, out, err = plan_cli("--hf-config", str(cfg), "--nodes", "2", "--gpus-per-node", "2",
                              "--gpu-mem-gb", "80", "--rollout-gpus", "2", "--tp", "1", "--roles", "policy",
                              "--gen-s", "10", "--train-s", "8", "--sync-s", "3", "--reward-s", "2",
                              "--push-every", "3")
    assert code == 0, err
    assert "split placement: training pool 2 GPUs (1 x 2, GPUs 0-1), rollout pool 2 GPUs (1 x 2, GPUs 2-3)" in out
    assert "training pool, fullest stage" in out and "rollout pool, GB per GPU" in out
    total = 2 * 2 * PARAMS / GB  # two replicas of the model in bf16, every byte between the nodes
    assert f"{total:.2f} GB in all ({total:.2f} GB inter-node)" in out
    assert ("cluster.pools.rollout.devices_per_node=2 cluster.pools.rollout.tp=1 cluster.placement.rollout=rollout"
            in out)
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.strip().startswith(
        ("sync ", "one_step_off", "async"))}
    assert rows == {"sync": "23.00", "one_step_off": "15.00", "async": "13.00"}


def test_cli_colocated_report_mentions_no_pools(tmp_path, plan_cli):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(HF))
    code, out, err = plan_cli("--hf-config", str(cfg), "--nodes", "1", "--gpus-per-node", "2",
                              "--gpu-mem-gb", "80", "--tp", "1", "--gen-s", "10", "--train-s", "8", "--sync-s", "3")
    assert code == 0, err
    report = out.split("predicted step")[0]
    assert not any(w in report for w in ("training pool", "rollout pool", "split placement", "r.sync"))
    lines = out.splitlines()
    assert lines[lines.index("") + 1].startswith("GB per GPU (fullest stage)")  # the table right after the header
    assert "resharding per sync" in out and "overrides: cluster.pools.main.nodes=1" in out
    assert [line.split()[0] for line in out.splitlines()[-1:]] == ["sync"]


def test_render_split_fits_line_names_the_pool(spec):
    text = render(_split_plan(spec), with_reshard=False)
    assert "FITS: peak" in text and "(rollout pool, sync phase)" in text  # vLLM's budget outweighs training here
