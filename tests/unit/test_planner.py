"""Layout planner: per-device memory, resharding bytes and proposals against hand arithmetic.

References are independent of the planner: the worked example of docs/resharding.md §3.4 and §4
(Llama-3-70B, TP8 x PP4 x DP2 -> rollout TP8; the doc counts 70.55 B parameters, decimal GB), the
closed-form resharding volume ``M/TP_g - M/(T*P)`` on a model where it is exact, and per-token
activation bytes written out by hand.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.engine.config import Precision
from megarl.errors import ConfigError, LayoutError
from megarl.models.spec import spec_from_hf_config
from megarl.parallel.layout import ParallelLayout
from megarl.planner import (
    GB,
    Cluster,
    Phase,
    Recompute,
    Role,
    Workload,
    memory,
    plan_layout,
    preset_names,
    preset_spec,
    propose,
    training_state_bytes,
)
from megarl.resharding.plan import make_plan

REPO = Path(__file__).resolve().parents[2]
CLUSTER_70B = Cluster(nodes=8, gpus_per_node=8, gpu_mem_gb=80)
POLICY_ONLY = Workload(roles=(Role.POLICY,))


@pytest.fixture(scope="module")
def llama70b():
    return preset_spec("llama3-70b")


@pytest.fixture(scope="module")
def plan_3d(llama70b):
    """docs/resharding.md §3.4: TP8 x PP4 x DP2 on 64 GPUs, rollout TP8 (resharding computed once here)."""
    p = plan_layout(llama70b, CLUSTER_70B, POLICY_ONLY, ParallelLayout(tp=8, pp=4, dp=2), 8, "Llama-3-70B")
    _ = p.reshard
    return p


def _gb(n: float) -> float:
    return n / GB


# ------------------------------------------------------------------------------------------ presets


def test_presets_are_the_published_configs():
    """Spot values of the hub config.json files (docs/resharding.md §1.6 table for two of them)."""
    assert preset_names() == ["llama3-70b", "llama3-8b", "qwen2.5-0.5b", "qwen2.5-72b", "qwen2.5-7b", "qwen3-30b-a3b"]
    l70, q7 = preset_spec("llama3-70b"), preset_spec("qwen2.5-7b")
    assert (l70.num_layers, l70.hidden_size, l70.ffn_hidden_size) == (80, 8192, 28672)
    assert (l70.num_attention_heads, l70.num_query_groups, l70.head_dim, l70.vocab_size) == (64, 8, 128, 128256)
    assert (q7.num_layers, q7.hidden_size, q7.ffn_hidden_size, q7.num_attention_heads, q7.num_query_groups) == (
        28, 3584, 18944, 28, 4)
    assert q7.qkv_bias and not q7.tie_word_embeddings
    # published parameter counts: 8.03 B, 70.55 B (docs/resharding.md §3.4), 0.49 B (tied), 7.62 B, 72.71 B,
    # 30.53 B (MoE, tests/unit/test_planner_moe.py)
    counts = {n: round(preset_spec(n).num_parameters() / 1e9, 2) for n in preset_names()}
    assert counts == {"llama3-8b": 8.03, "llama3-70b": 70.55, "qwen2.5-0.5b": 0.49, "qwen2.5-7b": 7.62,
                      "qwen2.5-72b": 72.71, "qwen3-30b-a3b": 30.53}
    q05 = preset_spec("qwen2.5-0.5b")
    assert (q05.num_layers, q05.hidden_size, q05.head_dim, q05.num_query_groups, q05.tie_word_embeddings) == (
        24, 896, 64, 2, True)


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown model preset 'llama3-7b'.*llama3-70b.*qwen2.5-7b"):
        preset_spec("llama3-7b")


# ------------------------------------------------------------------------ docs/resharding.md §3.4


def test_worked_example_3d_memory(llama70b, plan_3d):
    n = llama70b.num_parameters()
    assert round(2 * n / GB, 1) == 141.1  # M
    states = training_state_bytes(llama70b, plan_3d.layout, Precision.BF16, distributed_optimizer=True)
    assert len(states) == 4
    mean = {k: sum(getattr(s, k) for s in states) / 4 / GB for k in ("params", "grads", "optimizer")}
    # doc: training shard M/32 = 4.41 GB; fp32 grads 8.8 GB; distributed optimizer 12 B/param/DP = 13.2 GB
    assert mean["params"] == pytest.approx(4.41, abs=0.005)
    assert mean["grads"] == pytest.approx(8.82, abs=0.01)
    assert mean["optimizer"] == pytest.approx(13.23, abs=0.01)
    assert sum(mean.values()) == pytest.approx(26.5, abs=0.05)  # section 4: "about 26.5 GB of states"
    # the fullest stage holds the embedding: ~(20 x 855.7 M + 1.05 B) / 8 parameters (examples/ppo_llama3_70b):
    # per layer qkv [10240, 8192], o_proj, fc1 [2 x 28672], fc2 split over TP; two norms of 8192 replicated
    per_rank = 20 * (8192 * (10240 + 8192 + 3 * 28672) // 8 + 2 * 8192) + 129024 // 8 * 8192
    assert states[0].params == 2 * per_rank
    assert states[0].optimizer == 12 * per_rank // 2
    # vLLM shard M/8 = 17.64 GB (V = 128256 splits evenly over 8 with vLLM's 64-padding)
    gen = next(p for p in plan_3d.peaks if p.phase is Phase.GENERATE).terms
    norms = (2 * 80 + 1) * 8192  # replicated in vLLM too
    assert gen[("rollout", "weights")] == 2 * (n - norms) // 8 + 2 * norms
    assert round(_gb(gen[("rollout", "weights")]), 2) == 17.64


def test_worked_example_3d_resharding(llama70b, plan_3d):
    r = plan_3d.reshard
    n = llama70b.num_parameters()
    m = 2 * n
    # (b)/(c): each GPU receives M/8 - M/32 = 13.2 GB, all of it from the 3 PP peers on other nodes (IB)
    assert _gb(r.received_mean) == pytest.approx(_gb(m / 8 - m / 32), abs=0.02)
    assert round(_gb(r.received_mean), 1) == 13.2
    assert _gb(r.received_max) < 13.5  # vocabulary rows overlap a neighbour (16128 vs 16032 rows per rank)
    assert r.slowest_intra < 0.05 * GB
    # lower bound 13.2 GB / 40 GB/s = 0.33 s (doc); the slowest rank moves a little more for the vocabulary
    assert r.seconds == pytest.approx(0.33, abs=0.015)


def test_worked_example_section_4_refit_budget(plan_3d):
    """Section 4: during refit vLLM weights 17.6 + Megatron params 4.4 + transient <= 8 ~ 30 GB."""
    sync = next(p for p in plan_3d.peaks if p.phase is Phase.SYNC)
    terms = {k: _gb(v) for k, v in sync.terms.items()}
    assert terms[("policy", "weights")] == pytest.approx(4.54, abs=0.01)  # fullest stage: embedding included
    assert 0 < terms[("rollout", "reshard transient")] <= 8
    assert 22 < _gb(sync.total) - CLUSTER_70B.reserved_gb <= 30
    # the policy's grads and optimizer are offloaded before the sync, and nothing of it is left while generating
    assert ("policy", "grads") not in sync.terms and ("policy", "optimizer") not in sync.terms
    gen = next(p for p in plan_3d.peaks if p.phase is Phase.GENERATE)
    assert not any(owner == "policy" for owner, _ in gen.terms)


def test_overrides_load_as_the_layout(plan_3d):
    from megarl.config.train import load_config

    over = plan_3d.overrides()
    pool = "cluster.pools.main"
    assert {f"{pool}.tp=8", f"{pool}.pp=4", "rollout.engine.tp=8", f"{pool}.nodes=8",
            f"{pool}.devices_per_node=8"} <= set(over)
    cfg = load_config(None, over)
    assert cfg.cluster.layout() == ParallelLayout(tp=8, pp=4, dp=2)
    assert cfg.rollout.engine.tp == 8 and cfg.policy.precision is Precision.BF16
    assert cfg.policy.micro_batch.max_tokens == 2048 and cfg.rollout.max_new_tokens == cfg.data.max_prompt_length == 512
    assert 0 < cfg.rollout.engine.gpu_memory_utilization < 1


# --------------------------------------------------------------------------------------- activations


def test_activation_bytes_by_hand(llama70b):
    """Per token and layer (bf16): 4h replicated + (2*n_h*d + 2*n_g*d + 4F)/t split, + n_h*s/t scores."""
    lay = ParallelLayout(tp=8, pp=4, dp=2)
    per_token = 4 * 8192 + (2 * 64 * 128 + 2 * 8 * 128 + 4 * 28672) / 8  # 49408 values
    tokens = 2 * 1024
    got = memory.activation_bytes(llama70b, lay, 0, micro_batch_tokens=2048, seq_len=1024,
                                  recompute=Recompute.SELECTIVE)
    assert got == 80 * int(tokens * per_token * 2)  # stage 0 of 1F1B: 4 micro-batches x 20 layers
    none = memory.activation_bytes(llama70b, lay, 0, micro_batch_tokens=2048, seq_len=1024, recompute=Recompute.NONE)
    assert none == 80 * int(tokens * (per_token + 64 * 1024 / 8) * 2)
    # last stage: one micro-batch of 20 layers + fp32 logits and softmax of the 16128 local vocabulary rows
    last = memory.activation_bytes(llama70b, lay, 3, micro_batch_tokens=2048, seq_len=1024,
                                   recompute=Recompute.SELECTIVE)
    assert last == 20 * int(tokens * per_token * 2) + 8 * tokens * 16128
    full = memory.activation_bytes(llama70b, lay, 1, micro_batch_tokens=2048, seq_len=1024, recompute=Recompute.FULL)
    assert full == 60 * tokens * 8192 * 2 + int(tokens * per_token * 2)


def test_interleaved_schedule_holds_the_papers_factor(llama70b):
    """VPP v: the first stage holds (1 + (p-1)/(p*v)) x L layer-micro-batches (Korthikanti et al. 4.2.3)."""
    lay = ParallelLayout(tp=8, pp=4, dp=2, vpp=2)
    assert memory.in_flight_layers(llama70b, lay, 0) == 80 * (1 + 3 / 8)
    assert memory.in_flight_layers(llama70b, ParallelLayout(tp=8, pp=4, dp=2), 2) == 2 * 20


def test_kv_cache_by_hand(llama70b):
    # 2 (k, v) x 80 layers x 1 KV head per GPU x 128 x 2 B = 40 KiB per token; KV heads replicate past 8
    assert memory.kv_cache_bytes(llama70b, 8, 2, 1000) == 2 * 80 * 1 * 128 * 2 * 1000
    assert memory.kv_cache_bytes(llama70b, 1, 2, 1000) == 2 * 80 * 8 * 128 * 2 * 1000
    assert memory.kv_cache_bytes(preset_spec("qwen2.5-7b"), 8, 2, 1) == memory.kv_cache_bytes(
        preset_spec("qwen2.5-7b"), 4, 2, 1)


# ------------------------------------------------------------------------------------------- fitting


def test_tp1_70b_does_not_fit_and_says_why(llama70b):
    p = plan_layout(llama70b, CLUSTER_70B, POLICY_ONLY, ParallelLayout(tp=1, pp=1, dp=64), 1)
    assert not p.fits
    assert p.reason.startswith("train phase needs")
    assert "policy weights 141.1 GB" in p.reason and "policy grads 282.2 GB" in p.reason
    assert "rollout weights 141.1 GB" in p.reason  # the rollout copy at TP1 overflows on its own too


def test_layout_errors(llama70b):
    with pytest.raises(LayoutError, match="must divide the number of layers"):
        plan_layout(llama70b, CLUSTER_70B, POLICY_ONLY, ParallelLayout(tp=2, pp=32, dp=1), 2)
    with pytest.raises(LayoutError, match="needs 32 processes"):
        plan_layout(llama70b, CLUSTER_70B, POLICY_ONLY, ParallelLayout(tp=8, pp=4, dp=1), 8)
    plan_layout(llama70b, CLUSTER_70B, POLICY_ONLY, ParallelLayout(tp=8, pp=4, dp=2), 4)  # inside a TP group
    with pytest.raises(LayoutError, match=r"ranks 0..3 belong to data-parallel replicas \[0, 1\]"):
        plan_layout(llama70b, CLUSTER_70B, POLICY_ONLY, ParallelLayout(tp=2, pp=4, dp=8), 4)


def test_propose_returns_only_fitting_layouts_cheapest_first(llama70b):
    work = Workload(roles=(Role.POLICY, Role.REFERENCE))
    plans = propose(llama70b, CLUSTER_70B, work)
    assert plans and all(p.fits for p in plans)
    assert all(x.total <= p.capacity for p in plans for x in p.peaks)
    found = {(p.layout.tp, p.layout.pp, p.rollout_tp) for p in plans}
    assert (8, 4, 8) in found and (8, 2, 8) in found
    assert not any(tp < 4 for tp, _, _ in found) and not any(g == 1 for _, _, g in found)  # 141 GB rollout copy
    costs = [(p.layout.tp * p.layout.pp, -p.rollout_tp, p.layout.pp) for p in plans]
    assert costs == sorted(costs)
    # with the critic too, TP8xPP4 (examples/ppo_llama3_70b) leaves no room for what vLLM keeps while it sleeps
    # (its CUDA graphs and runtime): its train phase needs 81.7 GB (docs/planner.md §4); TP8xPP8 fits
    full = {(p.layout.tp, p.layout.pp) for p in propose(llama70b, CLUSTER_70B, Workload())}
    assert (8, 8) in full and (8, 4) not in full


# -------------------------------------------------------------------- resharding bytes, exact formula


def _exact_spec():
    """V = 1024 divisible by 128*T (T=2) and by 64: no padding on either side, so M/TP_g - M/(T*P) is exact."""
    return spec_from_hf_config(dict(
        architectures=["LlamaForCausalLM"], vocab_size=1024, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, hidden_act="silu"))


@pytest.mark.parametrize("rollout_tp", [2, 1])
def test_resharding_bytes_equal_the_plan_and_the_formula(rollout_tp):
    spec = _exact_spec()
    cluster = Cluster(nodes=2, gpus_per_node=4, gpu_mem_gb=80)
    layout = ParallelLayout(tp=2, pp=2, dp=2)
    p = plan_layout(spec, cluster, POLICY_ONLY, layout, rollout_tp)
    r = p.reshard
    plan = make_plan(spec, layout, rollout_tp)
    assert list(r.per_rank_received) == [plan.received_bytes(rank, 2) for rank in range(8)]
    # hand formula, bf16: TP-split tensors M_s/TP_g - M_s/(T*P) (each stage owns half of them: embedding +
    # 2 layers, or 2 layers + lm_head); replicated norms: what the other stage holds (stage 1 also has the final norm)
    h, f, v, layers = 64, 128, 1024, 4
    m_split = 2 * (2 * v * h + layers * (h * (4 * 16 + 2 * 2 * 16) + h * 4 * 16 + 3 * f * h))
    m_repl = 2 * (layers * 2 * h + h)
    assert m_split + m_repl == 2 * spec.num_parameters()
    repl_received = {0: 2 * (2 * 2 * h + h), 1: 2 * (2 * 2 * h)}  # stage -> bytes of norms held by the other stage
    expected = [m_split // rollout_tp - m_split // 4 + repl_received[layout.coords(rank).pp] for rank in range(8)]
    assert list(r.per_rank_received) == expected
    assert r.received_mean == m_split / rollout_tp - m_split / 4 + m_repl / 2
    # stage 0 is node 0, stage 1 node 1 (tp-dp-pp order). Rollout TP2 = training TP: a rank only lacks the other
    # stage's half, all over IB. Rollout TP1: the TP peer's shard of its own stage too, over NVLink.
    intra = m_split / 4 if rollout_tp == 1 else 0
    assert r.seconds == pytest.approx(intra / (300 * GB) + (max(expected) - intra) / (40 * GB))
    # the rollout shard per GPU is the plan's destination (vLLM layout)
    gen = next(x for x in p.peaks if x.phase is Phase.GENERATE).terms
    assert gen[("rollout", "weights")] == max(plan.dest_bytes(rank, 2) for rank in range(8))
    assert gen[("rollout", "weights")] == m_split / rollout_tp + m_repl


# ----------------------------------------------------------------------------------------------- CLI


def test_cli_reports_not_fitting_with_the_reason():
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "plan.py"), "--preset", "llama3-70b", "--nodes", "8",
         "--gpus-per-node", "8", "--gpu-mem-gb", "80", "--tp", "1", "--roles", "policy"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "NOT FITTING" in proc.stdout and "policy weights 141.1 GB" in proc.stdout
    assert ("overrides: cluster.pools.main.nodes=8 cluster.pools.main.devices_per_node=8 cluster.pools.main.tp=1 "
            "cluster.pools.main.pp=1") in proc.stdout



def test_cli_bad_input_exits_2(plan_cli):
    code, _, err = plan_cli("--preset", "llama3-7b", "--nodes", "1", "--gpus-per-node", "8",
                            "--gpu-mem-gb", "80")
    assert code == 2 and "llama3-70b" in err and "qwen2.5-72b" in err
    code, _, err = plan_cli("--preset", "qwen2.5-7b", "--nodes", "1", "--gpus-per-node", "8",
                            "--gpu-mem-gb", "80", "--tp", "8")
    assert code == 2 and "tp=8 must divide the number of attention heads (28)" in err


def test_cli_proposes_when_no_layout_is_given(plan_cli):
    code, out, _ = plan_cli("--preset", "qwen2.5-7b", "--nodes", "1", "--gpus-per-node", "8",
                            "--gpu-mem-gb", "80", "--roles", "policy,reference")
    assert code == 0
    assert "fitting layouts, cheapest first" in out and "best:" in out and "FITS" in out
    assert "overrides: cluster.pools.main.nodes=1 cluster.pools.main.devices_per_node=8" in out


# ------------------------------------------------------------------------- vLLM's own start-up budget


@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_budget_of_a_colocated_7b_by_vllms_formula(tp):
    """Qwen2.5-7B, policy + reference, one node of 8 x 80 GB, rollout TP = training TP (issue #41). vLLM 0.32
    (v1/worker/utils.py request_memory, v1/worker/gpu_worker.py determine_available_memory) needs
    ``ceil(util x total)`` bytes free when it starts, beside the training state already resident, and gives its KV
    cache ``util x total`` less its weights, profiled activations, non-torch/runtime memory and CUDA graphs. The
    planner's utilization must hold all of them; hand numbers from the config.json (h 3584, F 18944, 28/4 heads of
    128, vocabulary 152064, 28 layers) and vLLM's defaults on a >= 70 GiB GPU (16384 batched tokens, 1024 seqs)."""
    spec = preset_spec("qwen2.5-7b")
    cap = 80 * GB
    plan = plan_layout(spec, Cluster(1, 8, 80), Workload(roles=(Role.POLICY, Role.REFERENCE)),
                       ParallelLayout.for_world(8, tp=tp), tp)
    n, norms = spec.num_parameters(), (2 * 28 + 1) * 3584  # norms replicated on every vLLM rank
    weights = 2 * ((n - norms) // tp + norms)
    kv = 2 * 28 * (4 // tp) * 128 * 2 * 256 * 1024  # k and v, KV heads per rank, bf16, 256 sequences of 1024
    profile = 16384 * (2 * 3584 + 3 * 18944 // tp) * 2 + 1024 * 152064 * (2 + 8)  # widest layer + sampler
    sizes = 3 + 31 + 17  # capture sizes up to min(2 x 1024, 512): 1, 2, 4; 8..248 by 8; 256..512 by 16
    graphs = 512 * 28 * 2 * 3584 * 2 + 2 * sizes * 2**20
    runtime = 1 * GB
    need = weights + kv + profile + graphs + runtime
    util = math.ceil(100 * need / cap) / 100
    assert plan.gpu_memory_utilization == util == {1: 0.45, 2: 0.24}[tp]
    # vLLM's KV cache at that utilization holds at least the planned 256 x 1024 tokens
    assert util * cap - (weights + profile + runtime) - graphs >= kv
    build = next(p for p in plan.peaks if p.phase is Phase.BUILD)
    others = sum(v for (owner, _), v in build.terms.items() if owner != "rollout")  # resident before vLLM starts
    assert sum(v for (owner, _), v in build.terms.items() if owner == "rollout") == math.ceil(util * cap)
    # start-up check: free memory when vLLM starts (capacity less what is resident) >= ceil(util x total)
    assert (cap - others >= math.ceil(util * cap)) is plan.fits is (tp == 2)
    if tp == 1:  # 15.2 GB of policy weights, 30.5 GB of fp32 gradients, the reference's 15.2 GB: no room
        assert "build phase needs 104.7 GB" in plan.reason
    train = next(p for p in plan.peaks if p.phase is Phase.TRAIN).terms  # vLLM asleep: its graph pool stays
    assert train[("rollout", "cuda graphs")] == graphs and train[("rollout", "runtime")] == runtime
    assert f"rollout.engine.gpu_memory_utilization={util:.2f}" in plan.overrides()
