"""Planner for Mixture-of-Experts models (issue #24): memory per rank under expert parallelism, FLOPs from the
active parameters, the expert-parallel all-to-all bytes, and the layout search over ep, against hand arithmetic.

The model is a Qwen3-MoE of 4 layers, hidden 64, 4 heads of 16 with 2 KV groups (q/k norms of 16), 4 experts of
FFN 32 with top-2 routing, vocabulary 1024 (a multiple of 128 * TP and of 64: nobody pads it), untied. Every
count below is written out from those numbers, not from the planner's, the spec's or the mapping's helpers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.engine.config import Precision
from megarl.errors import LayoutError
from megarl.models.spec import spec_from_hf_config
from megarl.parallel.layout import ParallelLayout
from megarl.planner import (
    GB,
    Cluster,
    Phase,
    Recompute,
    Role,
    Workload,
    alltoall_bytes,
    candidate_layouts,
    forward_flops_per_token,
    memory,
    plan_layout,
    preset_spec,
    propose,
    training_flops_per_token,
    training_state_bytes,
)

REPO = Path(__file__).resolve().parents[2]
H, V, L, NH, NG, D = 64, 1024, 4, 4, 2, 16
E, K, FE = 4, 2, 32  # experts, top-k, expert FFN
MOE_HF = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=V, hidden_size=H, intermediate_size=128,
              moe_intermediate_size=FE, num_experts=E, num_experts_per_tok=K, norm_topk_prob=True,
              num_hidden_layers=L, num_attention_heads=NH, num_key_value_heads=NG, head_dim=D, rms_norm_eps=1e-6,
              hidden_act="silu", tie_word_embeddings=False, router_aux_loss_coef=0.001)
DENSE_HF = dict(architectures=["Qwen3ForCausalLM"], vocab_size=V, hidden_size=H, intermediate_size=128,
                num_hidden_layers=L, num_attention_heads=NH, num_key_value_heads=NG, head_dim=D, rms_norm_eps=1e-6,
                hidden_act="silu", tie_word_embeddings=False)

# per layer: q/k/v rows (4 + 2 + 2 heads of 16) x 64 and o_proj 64 x 64 (split by TP); q/k norms 2 x 16, the two
# layer norms 2 x 64 and the router 4 x 64 (replicated); each expert gate/up/down 3 x 32 x 64 (whole, placed by EP)
LAYER_SPLIT = (NH + 2 * NG) * D * H + NH * D * H  # 12288
LAYER_REPL = 2 * D + 2 * H + E * H  # 416
EXPERT = 3 * FE * H  # 6144
EMBED = V * H  # embedding and lm_head each
DENSE_TP1 = L * (LAYER_SPLIT + LAYER_REPL) + H + 2 * EMBED  # + final norm: 181952
EXPERTS_ALL = L * E * EXPERT  # 98304
FOUR_NODES = Cluster(nodes=1, gpus_per_node=4, gpu_mem_gb=80)
POLICY_ONLY = Workload(roles=(Role.POLICY,))


@pytest.fixture(scope="module")
def moe():
    return spec_from_hf_config(dict(MOE_HF))


@pytest.fixture(scope="module")
def dense():
    return spec_from_hf_config(dict(DENSE_HF))


def test_hand_counts(moe):
    assert (DENSE_TP1, EXPERTS_ALL) == (181952, 98304)
    assert moe.num_parameters() == DENSE_TP1 + EXPERTS_ALL


# ------------------------------------------------------------------------------------------ memory


def test_ep2_halves_expert_bytes_and_keeps_dense_bytes(moe):
    """TP1 x DP2: at EP1 each rank holds all 4 experts of its layers, at EP2 two of them; the dense part is the
    same. The distributed optimizer shards the dense part over DP (2) and the experts over expert DP (tp*dp/ep:
    2, then 1), so a rank's expert optimizer state is E_all/(tp*dp) either way."""
    ep1, ep2 = ParallelLayout(tp=1, pp=1, dp=2, ep=1), ParallelLayout(tp=1, pp=1, dp=2, ep=2)
    assert memory.stage_expert_parameters(moe, ep1) == [98304]
    assert memory.stage_expert_parameters(moe, ep2) == [49152]
    dense = [a - b for a, b in zip(memory.stage_parameters(moe, ep2), memory.stage_expert_parameters(moe, ep2),
                                   strict=True)]
    assert dense == [DENSE_TP1] == [memory.stage_parameters(moe, ep1)[0] - 98304]
    s1, s2 = (training_state_bytes(moe, lay, Precision.BF16, distributed_optimizer=True)[0] for lay in (ep1, ep2))
    assert (s1.params, s1.grads) == (2 * (181952 + 98304), 4 * (181952 + 98304))
    assert (s2.params, s2.grads) == (2 * (181952 + 49152), 4 * (181952 + 49152))
    assert s1.params - s2.params == 2 * 49152  # expert weights halve, nothing else moves
    assert s1.optimizer == s2.optimizer == 12 * (181952 // 2 + 98304 // 2)
    # without the distributed optimizer every rank keeps the state of all it holds
    s2_plain = training_state_bytes(moe, ep2, Precision.BF16, distributed_optimizer=False)[0]
    assert s2_plain.optimizer == 12 * (181952 + 49152)
    # fp32: 4 B weights, 4 B grads, 8 B moments (no master copy)
    f2 = training_state_bytes(moe, ep2, Precision.FP32, distributed_optimizer=True)[0]
    assert (f2.params, f2.optimizer) == (4 * (181952 + 49152), 8 * (181952 // 2 + 49152))


def test_tp2_does_not_divide_experts(moe):
    """TP2 x DP1: attention, embedding and lm_head are halved, norms and router replicated, experts whole; at
    EP1 the expert optimizer is sharded over the two TP ranks (expert DP = tp*dp/ep = 2), the dense one not (DP 1)."""
    tp2 = ParallelLayout(tp=2, pp=1, dp=1)
    dense_tp2 = L * (LAYER_SPLIT // 2 + LAYER_REPL) + H + 2 * EMBED // 2  # 91840
    assert memory.stage_expert_parameters(moe, tp2) == [98304]
    assert memory.stage_parameters(moe, tp2) == [dense_tp2 + 98304]
    st = training_state_bytes(moe, tp2, Precision.BF16, distributed_optimizer=True)[0]
    assert st.params == 2 * (91840 + 98304)
    assert st.optimizer == 12 * (91840 + 98304 // 2)
    # EP2 on the same two ranks: each holds two experts per layer, expert DP 1
    tp2ep2 = ParallelLayout(tp=2, pp=1, dp=1, ep=2)
    assert memory.stage_expert_parameters(moe, tp2ep2) == [49152]
    assert training_state_bytes(moe, tp2ep2, Precision.BF16, True)[0].optimizer == 12 * (91840 + 49152)


def test_pipeline_stages_hold_their_layers_experts(moe):
    """PP2 x DP2 x EP2: stage 0 has layers 0-1 + embedding, stage 1 layers 2-3 + final norm + lm_head;
    each rank 2 of the 4 experts of each of its 2 layers."""
    lay = ParallelLayout(tp=1, pp=2, dp=2, ep=2)
    assert memory.stage_expert_parameters(moe, lay) == [2 * 2 * EXPERT] * 2
    layer = LAYER_SPLIT + LAYER_REPL
    assert memory.stage_parameters(moe, lay) == [2 * layer + EMBED + 2 * 2 * EXPERT,
                                                 2 * layer + H + EMBED + 2 * 2 * EXPERT]


def test_plan_memory_terms_by_hand(moe):
    """The train phase of a plan carries the same per-rank bytes (TP1 x PP1 x DP4 x EP4: one expert per layer)."""
    plan = plan_layout(moe, FOUR_NODES, POLICY_ONLY, ParallelLayout(tp=1, pp=1, dp=4, ep=4), 1)
    train = next(p for p in plan.peaks if p.phase is Phase.TRAIN).terms
    mine = DENSE_TP1 + L * EXPERT
    assert train[("policy", "weights")] == 2 * mine
    assert train[("policy", "grads")] == 4 * mine
    assert train[("policy", "optimizer")] == 12 * (DENSE_TP1 // 4 + L * EXPERT)  # expert DP = 4/4 = 1
    assert "cluster.pools.main.ep=4" in plan.overrides()


def test_moe_activations_scale_with_dispatched_tokens(moe):
    """Per token and MoE layer: 4h + (2 n_h d + 2 n_g d)/t values, plus k copies of (2h + 4I) values in the
    experts (whole experts: not divided by TP), plus the router's fp32 probabilities (4 E bytes). At t > 1 an MoE
    model trains with sequence parallelism: each TP rank keeps and routes 1/t of the tokens, so every term is
    divided by t (the 4h, the copies and the probabilities too)."""
    tokens = 2 * 64
    assert memory.layer_activation_bytes(moe, 1, tokens, 64, Recompute.SELECTIVE, 2) == int(
        tokens * (4 * H + 2 * NH * D + 2 * NG * D + K * (2 * H + 4 * FE)) * 2) + tokens * 4 * E
    values = (4 * H + 2 * NH * D + 2 * NG * D + K * (2 * H + 4 * FE)) / 2  # 480 at tp 2
    assert memory.layer_activation_bytes(moe, 2, tokens, 64, Recompute.SELECTIVE, 2) == int(
        tokens * values * 2) + tokens * 4 * E // 2
    assert memory.layer_activation_bytes(moe, 2, tokens, 64, Recompute.FULL, 2) == tokens * H * 2 // 2
    assert memory.layer_activation_bytes(moe, 1, tokens, 64, Recompute.SELECTIVE, 2) == tokens * (960 * 2 + 16)
    # full recompute keeps the layer input only, as for a dense layer
    assert memory.layer_activation_bytes(moe, 1, tokens, 64, Recompute.FULL, 2) == tokens * H * 2


def test_rollout_weights_split_experts_over_vllm_tp(moe):
    """vLLM's fused MoE splits every expert's FFN dimension over its TP ranks; router and norms replicated."""
    for g in (1, 2):
        split = (L * LAYER_SPLIT + 2 * EMBED) // g
        repl = L * LAYER_REPL + H
        assert memory.rollout_weight_bytes(moe, g, 2) == 2 * (split + repl + EXPERTS_ALL // g)


# ----------------------------------------------------------------------------------------- compute


def test_flops_use_active_parameters(moe, dense):
    """Forward: 2 x active parameters + 2 L n_h d s per token; training 3x. Active: every layer's attention,
    norms and router and k of its E experts; the embedding and lm_head."""
    active = L * (LAYER_SPLIT + LAYER_REPL + K * EXPERT) + H + 2 * EMBED  # 231104
    assert moe.num_active_parameters() == active == 231104
    attention = 2 * L * NH * D * 64
    assert forward_flops_per_token(moe, 64) == 2 * 231104 + attention == 494976
    assert training_flops_per_token(moe, 64) == 3 * 494976
    # dense: all parameters are active (gate/up/down 3 x 128 x 64 per layer, no router)
    dense_params = L * (LAYER_SPLIT + 2 * D + 2 * H + 3 * 128 * H) + H + 2 * EMBED
    assert forward_flops_per_token(dense, 64) == 2 * dense_params + attention


def test_alltoall_formula():
    """tokens x top-k x hidden x bytes x (ep-1)/ep per all-to-all, each way: Qwen3-30B-A3B's numbers."""
    q = preset_spec("qwen3-30b-a3b")
    assert alltoall_bytes(q, 8, 2048, 2) == 2048 * 8 * 2048 * 2 * 7 // 8 == 58720256
    assert alltoall_bytes(q, 1, 2048, 2) == 0
    assert alltoall_bytes(preset_spec("qwen2.5-7b"), 8, 2048, 2) == 0


def test_expert_traffic_per_micro_batch_and_links(moe):
    """2 nodes x 2 GPUs, TP1 x DP4 x EP4: rank 0's group is ranks 0-3, rank 1 on its node, 2 and 3 on the other.
    A micro-batch of 2 x 64 tokens sends 128 x 2 x 64 x 2 B / 4 = 8192 B to each peer per all-to-all, four
    all-to-alls in each of the 4 layers."""
    cluster = Cluster(nodes=2, gpus_per_node=2, gpu_mem_gb=80)
    work = Workload(roles=(Role.POLICY,), micro_batch_tokens=128, prompt_tokens=32, response_tokens=32)
    plan = plan_layout(moe, cluster, work, ParallelLayout(tp=1, pp=1, dp=4, ep=4), 1)
    t = plan.expert_traffic
    assert t.tokens == 128 and t.layers == 4
    assert t.alltoall == 128 * K * H * 2 * 3 // 4 == 24576
    assert t.per_layer == 4 * 24576 and t.per_micro_batch == 16 * 24576
    per_peer = 128 * K * H * 2 // 4
    assert (t.slowest_intra, t.slowest_inter) == (16 * per_peer, 16 * 2 * per_peer)
    assert t.seconds == pytest.approx(16 * per_peer / (300 * GB) + 32 * per_peer / (40 * GB))
    # EP2 keeps each group on one node; EP1 moves nothing
    t2 = plan_layout(moe, cluster, work, ParallelLayout(tp=1, pp=1, dp=4, ep=2), 1).expert_traffic
    assert (t2.alltoall, t2.slowest_inter) == (128 * K * H * 2 // 2, 0)
    assert plan_layout(moe, cluster, work, ParallelLayout(tp=1, pp=1, dp=4), 1).expert_traffic.per_micro_batch == 0


# ------------------------------------------------------------------------------------------ search


def test_search_enumerates_ep(moe):
    """4 GPUs: tp dividing the 4 heads and 2 KV groups (1, 2; at 2 with sequence parallelism), pp dividing 4/tp
    and the 4 layers, ep dividing the 4 experts and tp*dp = 4/pp; rollout tp 1 or tp."""
    got = {(lay.tp, lay.pp, lay.dp, lay.ep, g) for lay, g in candidate_layouts(moe, FOUR_NODES)}
    want = set()
    for tp in (1, 2):
        for pp in (1, 2, 4):
            for ep in (1, 2, 4):
                if tp * pp <= 4 and (4 // pp) % ep == 0:
                    want |= {(tp, pp, 4 // (tp * pp), ep, g) for g in {1, tp}}
    assert got == want and len(got) == 16
    # 6 experts: ep 4 divides tp*dp but not the experts
    six = spec_from_hf_config(dict(MOE_HF, num_experts=6))
    assert {lay.ep for lay, _ in candidate_layouts(six, FOUR_NODES)} == {1, 2}


def test_search_ranks_smaller_ep_first(moe):
    plans = propose(moe, FOUR_NODES, POLICY_ONLY)
    costs = [(p.layout.tp * p.layout.pp, p.layout.ep, -p.rollout_tp, p.layout.pp) for p in plans]
    assert costs == sorted(costs) and len(plans) == 16  # the tiny model fits everywhere
    assert [str(p.layout) for p in plans[:3]] == ["TP1xPP1xDP4", "TP1xPP1xDP4xEP2", "TP1xPP1xDP4xEP4"]


def test_dense_models_refuse_ep(dense):
    assert {lay.ep for lay, _ in candidate_layouts(dense, FOUR_NODES)} == {1}
    with pytest.raises(LayoutError, match="ep=2 needs a Mixture-of-Experts model"):
        plan_layout(dense, FOUR_NODES, POLICY_ONLY, ParallelLayout(tp=1, pp=1, dp=4, ep=2), 1)
    assert plan_layout(dense, FOUR_NODES, POLICY_ONLY, ParallelLayout(tp=1, pp=1, dp=4), 1).expert_traffic.alltoall == 0


# ------------------------------------------------------------------------------ preset and CLI


def test_qwen3_30b_a3b_preset():
    """48 layers: attention (32 + 2 x 4) x 128 x 2048 + 32 x 128 x 2048, q/k norms 2 x 128, norms 2 x 2048,
    router 128 x 2048, 128 experts of 3 x 768 x 2048; embedding and lm_head 151936 x 2048; final norm."""
    q = preset_spec("qwen3-30b-a3b")
    assert (q.moe.num_experts, q.moe.top_k, q.moe.ffn_hidden_size, q.moe.norm_topk_prob) == (128, 8, 768, True)
    attn = 40 * 128 * 2048 + 32 * 128 * 2048
    rest = 2 * 128 + 2 * 2048 + 128 * 2048
    outer = 2048 + 2 * 151936 * 2048
    assert q.num_parameters() == 48 * (attn + rest + 128 * 3 * 768 * 2048) + outer == 30532122624
    assert q.num_active_parameters() == 48 * (attn + rest + 8 * 3 * 768 * 2048) + outer == 3353032704
    # TP1 x DP8 x EP8: a GPU holds the dense part and 16 experts per layer
    cluster = Cluster(nodes=1, gpus_per_node=8, gpu_mem_gb=80)
    plan = plan_layout(q, cluster, POLICY_ONLY, ParallelLayout(tp=1, pp=1, dp=8, ep=8), 1)
    train = next(p for p in plan.peaks if p.phase is Phase.TRAIN).terms
    dense = 48 * (attn + rest) + outer
    assert train[("policy", "weights")] == 2 * (dense + 48 * 16 * 3 * 768 * 2048)
    assert round(train[("policy", "weights")] / GB, 2) == 10.33
    assert train[("policy", "optimizer")] == 12 * (dense // 8 + 48 * 16 * 3 * 768 * 2048)



def test_cli_plans_qwen3_moe_with_ep(plan_cli):
    code, out, _ = plan_cli("--preset", "qwen3-30b-a3b", "--nodes", "1", "--gpus-per-node", "8",
                            "--gpu-mem-gb", "80", "--tp", "1", "--pp", "1", "--ep", "8", "--roles", "policy")
    assert code == 0
    assert "30.53 B parameters" in out and "3.35 B active per token" in out
    assert "layout: TP1xPP1xDP8xEP8" in out and "cluster.pools.main.ep=8" in out
    one = 2048 * 8 * 2048 * 2 * 7 // 8  # 2 x 1024 tokens per micro-batch
    assert f"sends and receives {one / GB:.3f} GB per all-to-all" in out
    assert f"x48 layers per stage = {4 * 48 * one / GB:.2f} GB" in out
    flops = 3 * (2 * 3353032704 + 2 * 48 * 32 * 128 * 1024)
    assert f"training {flops / 1e9:.2f} GFLOP" in out
    # colocated, rollout tp 1: a GPU receives every expert it does not hold (7/8 of them) and every dense tensor
    # it holds in full already (TP1): 48 layers x 128 experts x 3 x 768 x 2048 x 2 B x 7/8
    missing = 48 * 128 * 3 * 768 * 2048 * 2 * 7 // 8
    assert f"received per GPU max {missing / GB:.2f} GB" in out


def test_cli_refuses_ep_for_a_dense_model(plan_cli):
    code, _, err = plan_cli("--preset", "qwen2.5-7b", "--nodes", "1", "--gpus-per-node", "8",
                            "--gpu-mem-gb", "80", "--tp", "1", "--ep", "2")
    assert code == 2 and "needs a Mixture-of-Experts model" in err
