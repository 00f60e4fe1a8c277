"""The demo's GRPO run, then on-policy distillation from it (issue #22, item 4), CPU, local launcher.

The teacher is the demo itself (``make demo``'s config: GRPO with a KL loss to the reference on the addition
task, its 100 steps and validation every 25), so its run is also the proof that the demo learns; the student
reads it from its run checkpoint (``checkpoints/step_N/policy``): the demo's fresh random model, trained on the
teacher's per-token reward alone (``reward.function_weight: 0``; the task's reward is still measured).
References: the task (a random policy answers ~7% of prompts correctly; the teacher's and the student's answer
accuracy must rise clearly), the teacher (the per-token reverse KL must fall) and a float64 hand computation of
GRPO's advantages from the logged token log-probs.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.dist, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_addition_tiny" / "config.yaml"
TEACHER_STEPS, STUDENT_STEPS, KL_COEF = 100, 40, 0.5  # the teacher: the demo's 100 steps


class Recorder:
    def __init__(self) -> None:
        self.batches: dict[int, dict[str, torch.Tensor]] = {}

    def on_stage_end(self, stage, step, batch):
        if stage == "advantages" and step <= 3:
            self.batches[step] = {k: batch[k].clone() for k in batch.tensors.keys()}  # noqa: SIM118

    def on_step_end(self, step, metrics):
        pass


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    from megarl.config.train import load_config
    from megarl.testing.addition import make_task
    from megarl.trainer.trainer import run as train

    root = tmp_path_factory.mktemp("distill")
    task = make_task(root / "task")
    base = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
            "trainer.tensorboard": "false", "trainer.save_every": 0, "trainer.val_every": 0,
            "cluster.launcher": "local", "cluster.pools.main.devices_per_node": 1, "cluster.pools.main.tp": 1}
    # the demo as configured: its steps, its validation every 25 steps
    teacher = base | {"trainer.total_steps": TEACHER_STEPS, "trainer.output_dir": root / "teacher",
                      "trainer.val_every": 25}
    teacher_history = train(load_config(EXAMPLE, [f"{k}={v}" for k, v in teacher.items()]))
    checkpoint = root / "teacher" / "checkpoints" / f"step_{TEACHER_STEPS:06d}" / "policy"
    overrides = base | {"trainer.total_steps": STUDENT_STEPS, "trainer.output_dir": root / "student",
                        "teacher.model.path": checkpoint, "teacher.kl_coef": KL_COEF, "reward.function_weight": 0,
                        "algorithm.kl_loss_coef": 0}
    cfg = load_config(EXAMPLE, [f"{k}={v}" for k, v in overrides.items()])
    recorder = Recorder()
    history = train(cfg, callbacks=(recorder,))
    return {"teacher": teacher_history, "history": history, "recorder": recorder, "cfg": cfg}


def test_the_demo_grpo_run_learns_addition(student):
    """The teacher's run is ``make demo``'s: the reward rises clearly, the rollout engine's log-probs are the
    training model's, validation ran every 25 steps and the KL loss to the reference is live."""
    history = student["teacher"]
    rewards = [m["reward/mean"] for m in history]
    start, end = statistics.mean(rewards[:10]), statistics.mean(rewards[-20:])
    print(f"demo GRPO reward: first 10 steps {start:.3f}, last 20 steps {end:.3f}")
    assert len(history) == TEACHER_STEPS and end > start + 0.15 and end > 2 * start
    assert all(m["rollout/logprob_abs_diff"] < 1e-5 for m in history)  # rollout engines = training model
    assert [step for step, m in enumerate(history, start=1) if "val/reward/mean" in m] == [25, 50, 75, 100]
    assert history[-1]["actor/kl"] > 0


def test_the_student_learns_the_task_and_approaches_the_teacher(student):
    history = student["history"]
    reward = [m["reward/function_mean"] for m in history]
    kl = [m["distill/reverse_kl"] for m in history]
    teacher_end = statistics.mean(m["reward/mean"] for m in student["teacher"][-10:])
    first, last = statistics.mean(reward[:5]), statistics.mean(reward[-10:])
    print(f"teacher reward (last 10 of {TEACHER_STEPS}): {teacher_end:.3f}; student reward {first:.3f} -> {last:.3f}, "
          f"reverse KL {statistics.mean(kl[:5]):.3f} -> {statistics.mean(kl[-10:]):.3f}")
    assert all(m["reward/mean"] == 0.0 for m in history)  # the task's reward has weight 0: only the teacher teaches
    assert last > first + 0.1
    assert statistics.mean(kl[-10:]) < 0.6 * statistics.mean(kl[:5])


def test_advantages_are_grpo_of_the_summed_per_token_teacher_rewards(student):
    eps = student["cfg"].algorithm.advantage.eps
    for step, b in student["recorder"].batches.items():
        mask = b["response_mask"].double()
        own = b["old_log_probs"] if "old_log_probs" in b else b["rollout_log_probs"]
        per_row = (KL_COEF * (b["teacher_log_probs"].double() - own.double()) * mask).sum(-1).tolist()
        groups: dict[int, list[int]] = {}
        for row, uid in enumerate(b["prompt_uid"].tolist()):
            groups.setdefault(uid, []).append(row)
        for rows in groups.values():
            values = [per_row[r] for r in rows]
            mean, std = statistics.mean(values), statistics.stdev(values)
            for r in rows:
                expected = (per_row[r] - mean) / (std + eps)
                got = b["advantages"][r][mask[r].bool()]
                assert torch.allclose(got.double(), torch.full_like(got.double(), expected), atol=1e-4), (step, r)
