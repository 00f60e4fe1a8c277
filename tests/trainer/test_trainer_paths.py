"""Trainer paths no other test runs, on one short run and its resume (CPU, local launcher).

GRPO on the tiny addition task with an adaptive KL penalty in the reward, ``ppo_epochs=2`` x
``mini_batches=2`` (4 optimizer steps a step) under a linear LR warm-up, TensorBoard on, a checkpoint
every step and ``keep_checkpoints=2``: a first run of 3 steps, then a second run of the same config
with ``total_steps=4`` in the same output directory, which resumes from the step-3 checkpoint.
References: the files on disk (TensorBoard's own event reader against ``metrics.jsonl``; the
checkpoint directories and their JSON), the warm-up formula ``lr * k / W`` and the adaptive KL
controller's update (Ziegler et al. 2019, eq. 2), both worked here in float64 from the logged values.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.dist, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_addition_tiny" / "config.yaml"
PROMPTS, N = 4, 4
ROWS = PROMPTS * N  # responses per step: the adaptive controller's n_steps
EPOCHS, MINI_BATCHES = 2, 2
UPDATES = EPOCHS * MINI_BATCHES  # optimizer steps per trainer step
LR, WARMUP = 2e-3, 16  # 4 steps x 4 updates: every update of the test is inside the warm-up
KL_COEF, KL_TARGET, KL_HORIZON = 0.05, 0.025, 32.0  # target: in the range of the KLs of steps 2-4
FIRST_STEPS, TOTAL_STEPS, KEEP = 3, 4, 2


class Recorder:
    """Copies of each step's batch after the advantages stage (log-probs, scores, penalised returns)."""

    def __init__(self) -> None:
        self.batches: dict[int, dict[str, torch.Tensor]] = {}

    def on_stage_end(self, stage, step, batch):
        if stage == "advantages":
            self.batches[step] = {k: v.clone() for k, v in batch.tensors.items()}

    def on_step_end(self, step, metrics):
        pass


def _steps(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megarl.config.train import load_config
    from megarl.metrics.tracking import read_metrics
    from megarl.testing.addition import make_task
    from megarl.trainer.trainer import run as train

    root = tmp_path_factory.mktemp("trainer_paths")
    task = make_task(root / "task", train_rows=64, val_rows=8)
    out = root / "out"
    extra = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
             "trainer.output_dir": out, "trainer.tensorboard": "true", "trainer.save_every": 1,
             "trainer.keep_checkpoints": KEEP, "trainer.val_every": 0, "data.batch_size": PROMPTS,
             "rollout.sampling.n": N, "algorithm.kl_loss_coef": 0, "algorithm.ppo_epochs": EPOCHS,
             "algorithm.mini_batches": MINI_BATCHES, "algorithm.kl_penalty.kind": "adaptive",
             "algorithm.kl_penalty.coef": KL_COEF, "algorithm.kl_penalty.target": KL_TARGET,
             "algorithm.kl_penalty.horizon": KL_HORIZON, "policy.optim.lr": LR,
             "policy.optim.lr_warmup_steps": WARMUP,
             "cluster.launcher": "local", "cluster.pools.main.devices_per_node": 1, "cluster.pools.main.tp": 1}

    def config(total_steps: int):
        return load_config(EXAMPLE, [f"{k}={v}" for k, v in (extra | {"trainer.total_steps": total_steps}).items()])

    cfg = config(FIRST_STEPS)
    assert cfg.algorithm.kl_penalty is not None and cfg.algorithm.recomputes_old_log_probs
    recorder = Recorder()
    first = train(cfg, callbacks=(recorder,))
    after_first = {"checkpoints": _steps(out), "metrics": read_metrics(out)}
    second = train(config(TOTAL_STEPS), callbacks=(recorder,))
    return {"out": out, "first": first, "second": second, "after_first": after_first, "metrics": read_metrics(out),
            "recorder": recorder}


# ------------------------------------------------------------------------------------ TensorBoard


def test_tensorboard_events_hold_the_metrics_jsonl_values(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = run["out"] / "tensorboard"
    assert len(list(tb.glob("events.out.tfevents.*"))) == 2  # one file per run (the resume appends a second)
    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    events: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        steps = [e.step for e in acc.Scalars(tag)]
        assert len(steps) == len(set(steps)), f"{tag}: a step logged twice: {steps}"
        for e in acc.Scalars(tag):
            events.setdefault(e.step, {})[tag] = e.value
    records = {r["step"]: r for r in run["metrics"]}
    assert sorted(records) == sorted(events) == list(range(1, TOTAL_STEPS + 1))
    for step, record in records.items():
        values = {k: v for k, v in record.items() if k not in ("step", "time")}
        assert set(events[step]) == set(values), f"step {step}: tags differ"
        for key, value in values.items():
            got = events[step][key]
            if value is None:  # metrics.jsonl writes a non-finite value as null
                assert not math.isfinite(got), (step, key, got)
            else:  # TensorBoard stores float32: the JSON float rounded to float32, exactly
                assert got == float(np.float32(value)), (step, key, got, value)
    assert {"actor/lr", "reward/mean", "timing/step_s"} <= set(events[TOTAL_STEPS])


# ----------------------------------------------------------------------------------- checkpoints


def _check_complete(ckpt: Path, step: int) -> None:
    state = json.loads((ckpt / "trainer.json").read_text())
    assert state["step"] == step and state["kl_coef"] is not None and "sampler" in state
    policy = ckpt / "policy"
    assert sorted(p.name for p in ckpt.iterdir()) == ["manifest.json", "policy", "trainer.json"]  # GRPO: no critic
    for name in ("megarl_checkpoint.json", "hf/config.json", "weights/metadata.json", "trainer_state.json"):
        assert (policy / name).is_file(), f"{policy / name} missing"
    assert any(p.suffix == ".distcp" for p in (policy / "weights").iterdir())
    policy_state = json.loads((policy / "trainer_state.json").read_text())
    assert policy_state["step"] == step
    assert policy_state["scheduler"]["num_steps"] == step * UPDATES  # ppo_epochs x mini_batches per step


def test_keep_checkpoints_leaves_the_newest_complete_step_directories(run):
    names = [f"step_{s:06d}" for s in range(1, TOTAL_STEPS + 1)]
    assert run["after_first"]["checkpoints"] == names[FIRST_STEPS - KEEP:FIRST_STEPS]  # saved 1, 2, 3: kept 2, 3
    assert _steps(run["out"]) == names[-KEEP:]  # the resumed run saved 4 and pruned 2
    for name in names[-KEEP:]:
        _check_complete(run["out"] / "checkpoints" / name, int(name.removeprefix("step_")))


# ------------------------------------------------------------------------------ ppo_epochs x lr


def test_each_step_takes_epochs_x_mini_batches_optimizer_steps(run):
    """The k-th optimizer step (from 1) runs at lr * k / W; a step's actor/lr is the mean over its updates."""
    assert len(run["first"]) == FIRST_STEPS and len(run["second"]) == TOTAL_STEPS - FIRST_STEPS
    records = {r["step"]: r for r in run["metrics"]}
    for step in range(1, TOTAL_STEPS + 1):
        ks = range((step - 1) * UPDATES + 1, step * UPDATES + 1)
        expected = sum(LR * k / WARMUP for k in ks) / len(ks)
        assert math.isclose(records[step]["actor/lr"], expected, rel_tol=1e-9), (step, records[step]["actor/lr"])
    # one update per step (or the last update's lr alone) would give another number
    assert not math.isclose(records[1]["actor/lr"], LR * UPDATES / WARMUP, rel_tol=1e-3)
    assert records[1]["actor/skipped_steps"] == 0.0


# ------------------------------------------------------------------------------ adaptive KL penalty


def _k3(old: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """low_var_kl of KL(policy || reference) per token, float64 (Schulman 2020: exp(d) - d - 1, d = ref - old)."""
    d = (ref.double() - old.double()).clamp(-20, 20)
    return (d.exp() - d - 1).clamp(-10, 10)


def _reward_kl(b: dict[str, torch.Tensor]) -> float:
    """The controller's input: the per-sequence token mean of the KL, averaged over sequences."""
    mask = b["response_mask"].double()
    kl = _k3(b["old_log_probs"], b["ref_log_probs"]) * mask
    return (kl.sum(-1) / mask.sum(-1)).mean().item()


def _adaptive(coef: float, kl: float) -> float:
    """AdaptiveKLController.update by hand: e = clip(kl / target - 1, +-0.2); coef * (1 + e * n / horizon)."""
    error = min(max(kl / KL_TARGET - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * ROWS / KL_HORIZON)


def _expected_coefs(run) -> dict[int, float]:
    """The coefficient each step should apply (step 1: the configured one), and after the last step."""
    coefs = {1: KL_COEF}
    for step in range(1, TOTAL_STEPS + 1):
        coefs[step + 1] = _adaptive(coefs[step], _reward_kl(run["recorder"].batches[step]))
    return coefs


def _applied_coef(b: dict[str, torch.Tensor]) -> float:
    """The coefficient a step's rewards were penalised with, read from the batch: GRPO's returns are the
    penalised scores ``score - coef * sum_t kl_t`` on every counted token (least squares over the rows)."""
    mask = b["response_mask"].double()
    kl_sum = (_k3(b["old_log_probs"], b["ref_log_probs"]) * mask).sum(-1)
    last = b["response_mask"].cumsum(-1).argmax(-1, keepdim=True)  # a counted token of each row
    penalty = b["scores"].double() - b["returns"].double().gather(-1, last).squeeze(-1)
    return ((kl_sum * penalty).sum() / kl_sum.square().sum()).item()


def test_kl_penalty_in_the_rewards_follows_the_adaptive_controller_across_the_resume(run):
    batches = run["recorder"].batches
    assert sorted(batches) == list(range(1, TOTAL_STEPS + 1))  # step 4: the resumed run's
    b1 = batches[1]
    assert torch.equal(b1["old_log_probs"], b1["ref_log_probs"])  # step 1: the policy is the reference
    assert torch.equal(b1["returns"][b1["response_mask"].bool()],
                       b1["scores"].repeat_interleave(b1["response_mask"].sum(-1).long()))  # KL 0: no penalty
    coefs = _expected_coefs(run)
    for step in range(2, TOTAL_STEPS + 1):
        assert _reward_kl(batches[step]) > 1e-4, step  # the penalty is visible in the returns
        assert math.isclose(_applied_coef(batches[step]), coefs[step], rel_tol=1e-3), (step, coefs)
    # step 4 ran in the resumed run: its coefficient came from the step-3 checkpoint, not from the config
    assert abs(coefs[FIRST_STEPS + 1] - KL_COEF) > 0.05 * KL_COEF
    for step in (FIRST_STEPS, TOTAL_STEPS):  # the kept checkpoints hold the coefficient after their step
        state = json.loads((run["out"] / "checkpoints" / f"step_{step:06d}" / "trainer.json").read_text())
        assert math.isclose(state["kl_coef"], coefs[step + 1], rel_tol=1e-6), (step, state["kl_coef"], coefs)


def test_kl_penalty_metrics_are_logged_and_the_resumed_run_restores_the_coefficient(run):
    records = {r["step"]: r for r in run["metrics"]}
    coefs = _expected_coefs(run)
    for step in range(1, TOTAL_STEPS + 1):
        assert math.isclose(records[step]["actor/reward_kl"], _reward_kl(run["recorder"].batches[step]),
                            rel_tol=1e-4, abs_tol=1e-9), step
        assert math.isclose(records[step]["actor/kl_coef"], coefs[step], rel_tol=1e-6), step
    # the resumed run's first logged value, from the first run's logged KLs by the controller's formula
    expected = KL_COEF
    for record in run["after_first"]["metrics"]:
        expected = _adaptive(expected, record["actor/reward_kl"])
    resumed = run["second"][0]["actor/kl_coef"]
    assert math.isclose(resumed, expected, rel_tol=1e-12) and abs(resumed - KL_COEF) > 0.05 * KL_COEF
