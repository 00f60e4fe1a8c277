"""The layout planner: memory per device, resharding traffic and config overrides of a training
layout, computed from a model config and a cluster description (issue #7 item 3); with split
placement, memory per pool, the bytes crossing between the pools and the step time of the modes
(issue #23 item 7).

Pure package: no torch.distributed, no megatron-core, no Ray; torch only through the pure model
mapping and resharding-plan modules it reuses. ``presets`` holds published HF configs, ``memory``
the per-rank byte arithmetic, ``compute`` FLOPs per token and the expert-parallel all-to-all bytes of
MoE models (issue #24), ``layouts`` the phases and fits, ``proposals`` the layouts to try and their order,
``packing`` the padding of padded and packed micro-batches (issue #46), ``modes`` the step-time model of
sync, one-step-off and asynchronous training, ``report`` the text reports of ``tools/plan.py``.
"""

from megarl.planner.compute import ExpertTraffic, alltoall_bytes, forward_flops_per_token, training_flops_per_token
from megarl.planner.layouts import (
    Cluster,
    LayoutPlan,
    Phase,
    PhasePeak,
    Pool,
    ReshardEstimate,
    Role,
    Workload,
    plan_layout,
    reshard_estimate,
)
from megarl.planner.memory import GB, Recompute, StateBytes, training_state_bytes
from megarl.planner.modes import Mode, StageTimes, StepPrediction, predict_modes, predict_step
from megarl.planner.packing import Alignment, PassTokens, ResponseLengths, expected_padding, pass_tokens
from megarl.planner.presets import PRESETS, load_model, preset_names, preset_spec
from megarl.planner.proposals import candidate_layouts, closest, context_parallel_sizes, propose
from megarl.planner.report import proposals_table, render, step_time_lines

__all__ = [
    "GB", "PRESETS", "Alignment", "Cluster", "ExpertTraffic", "LayoutPlan", "Mode", "PassTokens", "Phase",
    "PhasePeak", "Pool", "Recompute", "ReshardEstimate", "ResponseLengths", "Role", "StageTimes", "StateBytes",
    "StepPrediction", "Workload", "alltoall_bytes", "candidate_layouts", "closest", "context_parallel_sizes",
    "expected_padding", "forward_flops_per_token", "load_model", "pass_tokens", "plan_layout", "predict_modes",
    "predict_step", "preset_names", "preset_spec", "proposals_table", "propose", "render", "reshard_estimate",
    "step_time_lines", "training_flops_per_token", "training_state_bytes",
]
