"""Planner with a LoRA policy (issue #45): training state of a frozen base with trained adapters, megatron-core's
gradient-buffer padding, the merge transient, adapter-only sync bytes in peft's layout, the phases, the overrides
and the CLI, against hand arithmetic.

Qwen2.5-7B (docs/planner.md §11): hidden 3584, FFN 18944, 28 query heads and 4 KV groups of 128, 28 layers. With
rank r a layer's fused factors are qkv ``A [r, 3584]``, ``B [3584 + 2 x 512, r]``; proj ``A [r, 3584]``,
``B [3584, r]``; fc1 ``A [r, 3584]``, ``B [2 x 18944, r]``; fc2 ``A [r, 18944]``, ``B [3584, r]``. Tensor
parallelism splits ``B`` of qkv and fc1 and ``A`` of proj and fc2. peft holds one ``A`` per HF projection (q, k,
v; gate, up) and ``B`` split by projection. The MoE counts are the 4-layer Qwen3-MoE of test_planner_moe.py.
Every count is written out from these numbers, not from the planner's or the mapping's helpers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.engine.config import LoRAConfig, Precision
from megarl.errors import ConfigError
from megarl.models.spec import spec_from_hf_config
from megarl.parallel.layout import ParallelLayout
from megarl.planner import GB, Cluster, Phase, Role, Workload, plan_layout, preset_spec, training_state_bytes
from megarl.planner.lora import (
    adapter_parameters,
    grad_buffer_elements,
    lora_state_bytes,
    merge_transient_bytes,
    peft_bytes,
    peft_parameters,
)

REPO = Path(__file__).resolve().parents[2]
H, F, Q, KV, L, R = 3584, 18944, 28 * 128, 4 * 128, 28, 32
TP4_DP2 = ParallelLayout(tp=4, dp=2)
LORA32 = LoRAConfig(rank=R)

# per layer, fused (megarl): A + B of qkv, proj, fc1, fc2
FUSED = R * (H + Q + 2 * KV) + R * (Q + H) + R * (H + 2 * F) + R * (F + H)
# per layer, peft: q, k, v with an A each; o; gate and up with an A each; down
PEFT = R * (3 * H + Q + 2 * KV) + R * (Q + H) + R * (2 * H + 2 * F) + R * (F + H)
# per layer on one rank at TP4: A of qkv and fc1 and B of proj and fc2 whole, the others a quarter
TP4_SHARD = R * H + R * (Q + 2 * KV) // 4 + R * Q // 4 + R * H + R * H + R * 2 * F // 4 + R * F // 4 + R * H


@pytest.fixture(scope="module")
def qwen7b():
    return preset_spec("qwen2.5-7b")


def test_hand_counts():
    assert (FUSED, PEFT, TP4_SHARD) == (2539520, 2883584, 978944)


def test_adapter_parameters_fused_and_peft(qwen7b):
    assert adapter_parameters(qwen7b, LORA32) == L * FUSED == 71_106_560
    assert peft_parameters(qwen7b, LORA32) == L * PEFT == 80_740_352
    # adapter-only sync: peft's tensors in the rollout dtype
    assert peft_bytes(qwen7b, LORA32, 2) == 2 * L * PEFT
    two = LoRAConfig(rank=8, targets=["qkv", "fc2"])
    assert adapter_parameters(qwen7b, two) == L * 8 * (H + Q + 2 * KV + F + H)
    assert peft_parameters(qwen7b, two) == L * 8 * (3 * H + Q + 2 * KV + F + H)


def test_state_bytes_by_hand(qwen7b):
    """bf16 at TP4 x DP2: the base's weights as in full fine-tuning plus the factors' shard (2 B each); fp32
    gradients and 12 B of optimizer state per factor element, the latter over DP; every factor shard is a
    multiple of 64 elements and the sum of 128, so megatron-core pads nothing."""
    full = training_state_bytes(qwen7b, TP4_DP2, Precision.BF16, True)[0]
    (got,) = lora_state_bytes(qwen7b, TP4_DP2, Precision.BF16, True, LORA32)
    shard = L * TP4_SHARD
    assert got.params == full.params + 2 * shard
    assert got.grads == 4 * shard == 109_641_728
    assert got.optimizer == 12 * shard // 2 == 164_462_592
    # before the first step: the fp32 master shard only; fp32: no master copy; no distributed optimizer: all of it
    (build,) = lora_state_bytes(qwen7b, TP4_DP2, Precision.BF16, True, LORA32, optimizer_states=0)
    assert build.optimizer == 4 * shard // 2
    (fp32,) = lora_state_bytes(qwen7b, TP4_DP2, Precision.FP32, True, LORA32)
    assert (fp32.grads, fp32.optimizer) == (4 * shard, 8 * shard // 2)
    (whole,) = lora_state_bytes(qwen7b, TP4_DP2, Precision.BF16, False, LORA32)
    assert (whole.grads, whole.optimizer) == (4 * shard, 12 * shard)


def test_pipeline_stages_hold_their_layers_adapters(qwen7b):
    stages = lora_state_bytes(qwen7b, ParallelLayout(tp=4, pp=2), Precision.BF16, False, LORA32)
    assert [s.grads for s in stages] == [4 * 14 * TP4_SHARD] * 2


def test_megatron_buffer_padding_by_hand():
    """param_and_grad_buffer.py with the distributed optimizer: each tensor starts at a multiple of 64 elements,
    the buffer ends at a multiple of lcm(dp, 128); without it, no padding."""
    assert grad_buffer_elements((144, 384), 2, True) == 640  # 192 + 384 = 576 -> 640
    assert grad_buffer_elements((144, 384), 2, False) == 528
    assert grad_buffer_elements((100,), 3, True) == 384  # lcm(3, 128)
    assert grad_buffer_elements((), 2, True) == 0
    spec = spec_from_hf_config(dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64,
                                    intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=2, rms_norm_eps=1e-6, hidden_act="silu",
                                    tie_word_embeddings=False))
    # rank 3 on fc2 at TP2: A [3, 96/2] = 144 elements, B [64, 3] = 192
    lora = LoRAConfig(rank=3, targets=["fc2"])
    (dp1,) = lora_state_bytes(spec, ParallelLayout(tp=2), Precision.FP32, True, lora)
    assert dp1.grads == 4 * 384 and dp1.optimizer == 8 * (144 + 192)  # 192 + 192 -> 384; the padding holds no state
    (dp2,) = lora_state_bytes(spec, ParallelLayout(tp=2, dp=2), Precision.FP32, True, lora)
    assert dp2.grads == 4 * 384 and dp2.optimizer == 8 * 192  # at most half the padded buffer


def test_moe_expert_adapters_by_hand():
    """The 4-layer Qwen3-MoE of test_planner_moe.py (hidden 64, q 64, k/v 32 each, 4 experts of FFN 32), rank 4
    at TP1 x DP2 x EP2: a rank holds 2 experts per layer, their factors whole, in a buffer of their own over the
    expert-data-parallel group (tp x dp / ep = 1 rank); attention's over DP."""
    spec = spec_from_hf_config(dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=1024, hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, hidden_act="silu",
        tie_word_embeddings=False))
    r, h, q, kv, fe = 4, 64, 64, 32, 32
    dense = 4 * (r * (h + q + 2 * kv) + r * (q + h))  # 5120
    experts = 4 * 2 * (r * (h + 2 * fe) + r * (fe + h))  # 7168
    layout = ParallelLayout.for_world(2, tp=1, ep=2)
    (got,) = lora_state_bytes(spec, layout, Precision.BF16, True, LoRAConfig(rank=r))
    base = training_state_bytes(spec, layout, Precision.BF16, True)[0].params
    assert got.params == base + 2 * (dense + experts)
    assert got.grads == 4 * (dense + experts)
    assert got.optimizer == 12 * (dense // 2 + experts)
    assert adapter_parameters(spec, LoRAConfig(rank=r)) == dense + 2 * experts  # all 4 experts
    # fc1 of every expert: peft's gate and up have an A each
    assert peft_parameters(spec, LoRAConfig(rank=r, targets=["fc1"])) == 4 * 4 * r * (2 * h + 2 * fe)


def test_merge_transient_is_the_largest_adapted_shard_in_fp32(qwen7b):
    """``W + scale * B A`` of fc1's TP4 shard [2 x 18944 / 4, 3584]: B A, its scaled copy, W and the sum in
    float32 (bf16 weights); an fp32 W is not copied."""
    assert merge_transient_bytes(qwen7b, TP4_DP2, Precision.BF16, LORA32) == 16 * 2 * F // 4 * H
    assert merge_transient_bytes(qwen7b, TP4_DP2, Precision.FP32, LORA32) == 12 * 2 * F // 4 * H
    proj_only = LoRAConfig(rank=R, targets=["proj"])
    assert merge_transient_bytes(qwen7b, TP4_DP2, Precision.BF16, proj_only) == 16 * H * Q // 4


def test_phases_against_full_fine_tuning(qwen7b):
    """§11's example: the LoRA policy's train phase holds the factors' gradients and optimizer state and no
    reference; its sync phase adds the merge transient; rollout terms and activations are full fine-tuning's."""
    cluster = Cluster(1, 8, 80)
    full = plan_layout(qwen7b, cluster, Workload(roles=(Role.POLICY, Role.REFERENCE)), TP4_DP2, 4)
    lora = plan_layout(qwen7b, cluster, Workload(roles=(Role.POLICY,), lora=LORA32), TP4_DP2, 4)
    f = {p.phase: p.terms for p in full.peaks}
    g = {p.phase: p.terms for p in lora.peaks}
    shard = L * TP4_SHARD
    assert g[Phase.TRAIN][("policy", "grads")] == 4 * shard
    assert g[Phase.TRAIN][("policy", "optimizer")] == 6 * shard
    assert g[Phase.TRAIN][("policy", "weights")] == f[Phase.TRAIN][("policy", "weights")] + 2 * shard
    assert g[Phase.TRAIN][("policy", "activations")] == f[Phase.TRAIN][("policy", "activations")]
    assert not any(owner == "reference" for terms in g.values() for owner, _ in terms)
    assert g[Phase.SYNC][("policy", "merge transient")] == 16 * 2 * F // 4 * H
    assert all(g[ph][k] == v for ph in g for k, v in f[ph].items() if k[0] == "rollout")
    assert round(full.worst.total / GB, 2) == 36.64 and round(lora.worst.total / GB, 2) == 19.23
    assert lora.reshard.total == full.reshard.total  # a merged sync moves what a full one moves


def test_lora_workload_has_no_reference_role():
    with pytest.raises(ConfigError, match="no reference role"):
        Workload(roles=(Role.POLICY, Role.REFERENCE), lora=LORA32)


def test_overrides_load_as_a_lora_policy(qwen7b):
    from megarl.config.train import Role as TrainRole
    from megarl.config.train import load_config

    lora = LoRAConfig(rank=16, targets=["qkv", "fc2"])
    plan = plan_layout(qwen7b, Cluster(1, 8, 80), Workload(roles=(Role.POLICY,), lora=lora), TP4_DP2, 4)
    cfg = load_config(None, plan.overrides())
    assert cfg.policy.lora == lora
    assert TrainRole.REFERENCE not in cfg.roles()



def test_cli_lora(plan_cli):
    base = ["--preset", "qwen2.5-7b", "--nodes", "1", "--gpus-per-node", "8", "--gpu-mem-gb", "80", "--tp", "4"]
    code, out, _ = plan_cli(*base, "--lora-rank", "32")
    assert code == 0
    assert "LoRA policy: rank 32 on qkv, proj, fc1, fc2: 71.11 M adapter parameters" in out
    assert "roles policy, critic;" in out  # the default roles without the reference
    assert f"adapter only (vLLM's LoRA support, peft layout, bfloat16): {2 * L * PEFT / 1e6:.1f} MB" in out
    assert "policy merge transient" in out and "policy.lora.rank=32 policy.lora.targets=[qkv,proj,fc1,fc2]" in out
    code, out, _ = plan_cli(*base, "--lora-rank", "8", "--lora-targets", "qkv,fc2",
                            "--roles", "policy")
    assert code == 0 and "rank 8 on qkv, fc2" in out
    code, _, err = plan_cli(*base, "--lora-rank", "8", "--roles", "policy,reference")
    assert code == 2 and "no reference role" in err
    code, _, err = plan_cli(*base, "--lora-targets", "qkv")
    assert code == 2 and "--lora-rank" in err
