"""The layout planner: memory per device, resharding traffic and config overrides of a training
layout, computed from a model config and a cluster description (issue #7 item 3).

Pure package: no torch.distributed, no megatron-core, no Ray; torch only through the pure model
mapping and resharding-plan modules it reuses. ``presets`` holds published HF configs, ``memory``
the per-rank byte arithmetic, ``layouts`` the phases, fits, proposals and the text reports of
``tools/plan.py``.
"""

from megarl.planner.layouts import (
    Cluster,
    LayoutPlan,
    Phase,
    PhasePeak,
    ReshardEstimate,
    Role,
    Workload,
    candidate_layouts,
    closest,
    plan_layout,
    proposals_table,
    propose,
    render,
    reshard_estimate,
)
from megarl.planner.memory import GB, Recompute, StateBytes, training_state_bytes
from megarl.planner.presets import PRESETS, load_model, preset_names, preset_spec

__all__ = [
    "GB", "PRESETS", "Cluster", "LayoutPlan", "Phase", "PhasePeak", "Recompute", "ReshardEstimate", "Role",
    "StateBytes", "Workload", "candidate_layouts", "closest", "load_model", "plan_layout", "preset_names",
    "preset_spec", "proposals_table", "propose", "render", "reshard_estimate", "training_state_bytes",
]
