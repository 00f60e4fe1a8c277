"""The trainer end to end on the tiny addition task (CPU: the session's Ray cluster, or the driver process).

References are the task itself (a random policy answers correctly ~7% of the time; what counts is a
clear, robust rise), the run's own uninterrupted twin (resume), and the dataset rows (custom reward).
The demo's own GRPO run (100 steps, KL loss to the reference) is the teacher of tests/trainer/test_distillation.py,
which asserts that it learns.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.metrics.tracking import read_metrics

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "grpo_addition_tiny" / "config.yaml"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from megarl.testing.addition import make_task

    return make_task(tmp_path_factory.mktemp("addition"))


# one rank in the driver process (cluster.launcher=local): no worker start-up, both cores for one rank
LOCAL = {"cluster.launcher": "local", "cluster.pools.main.devices_per_node": 1, "cluster.pools.main.tp": 1}


def _overrides(task, out, **extra):
    base = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
            "trainer.output_dir": out, "trainer.tensorboard": "false"}
    return [f"{k}={v}" for k, v in (base | extra).items()]


def _rise(history, head=10, tail=20):
    rewards = [m["reward/mean"] for m in history]
    return statistics.mean(rewards[:head]), statistics.mean(rewards[-tail:])


def test_ppo_with_critic_tp1pp2_learns(ray_cluster, task, tmp_path):
    from megarl.config.train import load_config
    from megarl.trainer.trainer import run

    extra = {"cluster.pools.main.tp": 1, "cluster.pools.main.pp": 2, "algorithm.advantage.estimator": "gae",
             "algorithm.kl_loss_coef": 0, "critic.optim.lr": "5e-3", "trainer.total_steps": 60,
             "trainer.save_every": 0, "trainer.val_every": 0}
    history = run(load_config(EXAMPLE, _overrides(task, tmp_path / "ppo", **extra)))
    start, end = _rise(history)
    print(f"PPO reward: first 10 steps {start:.3f}, last 20 steps {end:.3f}")
    assert end > start + 0.1
    assert "critic/vf_loss" in history[0] and "actor/kl" not in history[0]  # no reference without a KL term


REWARD_FILE = '''
import json, os

def score(prompt, response, row):
    with open(os.environ["MEGARL_TEST_REWARD_LOG"], "a") as f:
        f.write(json.dumps({"prompt": prompt, "response": response, "row": row}) + "\\n")
    return float(response.strip() == row["answer"]) + 0.01 * row["difficulty"]
'''


def _train_cmd(task, out, reward):
    extra = {"trainer.total_steps": 6, "trainer.save_every": 3, "trainer.val_every": 0, "reward.function": reward,
             **LOCAL}
    return [sys.executable, "-m", "megarl.train", str(EXAMPLE), *_overrides(task, out, **extra)]


def test_resume_after_kill_continues_identically_with_custom_reward(task, tmp_path):
    """A run killed (SIGKILL) after its step-3 checkpoint resumes and continues as an uninterrupted twin would, step
    for step; the killed run is `megarl run` with a user's GRPO listing, its twin `megarl train`."""
    # a dataset with an extra column, and a reward function given by path that records its inputs
    rows = [json.loads(line) for line in (task / "train.jsonl").read_text().splitlines()]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r | {"difficulty": int(r["answer"]) % 3}) + "\n" for r in rows))
    (tmp_path / "reward.py").write_text(REWARD_FILE)
    reward = f"{tmp_path / 'reward.py'}:score"
    env = dict(os.environ, MEGARL_TEST_REWARD_LOG=str(tmp_path / "calls.jsonl"))

    def cmd(out, program=None):
        run = [sys.executable, "-m", "megarl.cli.main", "run", program] if program else [sys.executable, "-m",
                                                                                         "megarl.train"]
        return [*run, *_train_cmd(task, out, reward)[3:], f"data.train={data}"]

    # uninterrupted twin: megarl train's own step
    subprocess.run(cmd(tmp_path / "full"), env=env, cwd=ROOT, check=True, timeout=900, capture_output=True)
    # the killed and resumed run: `megarl run` with the GRPO listing of examples/programs (issue #43), the same loop
    listing = str(ROOT / "examples" / "programs" / "ppo_family.py") + ":grpo"
    # the same run, killed (SIGKILL, whole process group) once step 3's checkpoint is complete
    killed = subprocess.Popen(cmd(tmp_path / "crash", listing), env=env, cwd=ROOT, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = tmp_path / "crash" / "checkpoints" / "step_000003" / "trainer.json"
    deadline = time.monotonic() + 600
    while not marker.exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.exists(), "the run did not reach its step-3 checkpoint"
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    # run the same command again: it resumes at step 4
    proc = subprocess.run(cmd(tmp_path / "crash", listing), env=env, cwd=ROOT, timeout=900, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "step_000003" in proc.stderr

    full, resumed = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "crash")
    assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(full[3:], resumed[3:], strict=True):
        keys = [k for k in a if not k.startswith(("timing/", "throughput/", "memory/")) and k != "time"]
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, a["step"]

    # the custom reward saw the prompt text, the decoded response and the row's extra columns
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert calls and all(set(c["row"]) == {"answer", "difficulty"} for c in calls)
    assert all(c["row"]["difficulty"] == int(c["row"]["answer"]) % 3 for c in calls)
    assert all(c["prompt"].endswith("=") for c in calls)


def test_local_launcher_matches_a_ray_worker(ray_cluster, task, tmp_path):
    """cluster.launcher=local (the driver hosts the one rank) computes what one Ray worker does: same
    seeds, one torch thread each, so the same samples, rewards, losses and gradient norms. It never
    imports Ray (Python's import log, PYTHONPROFILEIMPORTTIME, lists every module the run imported)."""
    from megarl.config.train import load_config
    from megarl.trainer.trainer import run

    one_rank = {"cluster.pools.main.devices_per_node": 1, "cluster.pools.main.tp": 1, "trainer.total_steps": 3,
                "trainer.save_every": 0, "trainer.val_every": 0}
    ray_history = run(load_config(EXAMPLE, _overrides(task, tmp_path / "ray", **one_rank)))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"OMP_NUM_THREADS": "1",
                                                                         "PYTHONPROFILEIMPORTTIME": "1"}
    proc = subprocess.run([sys.executable, "-m", "megarl.train", str(EXAMPLE),
                           *_overrides(task, tmp_path / "local", **one_rank, **{"cluster.launcher": "local"})],
                          env=env, cwd=ROOT, timeout=900, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "in the driver process" in proc.stderr and "private Ray cluster" not in proc.stderr
    imported = re.findall(r"^import time:.*\|\s*([\w.]+)$", proc.stderr, re.M)
    assert "megatron.core" in imported and not [m for m in imported if m.split(".")[0] == "ray"]
    local_history = read_metrics(tmp_path / "local")
    assert len(local_history) == len(ray_history) == 3
    for ours, ref in zip(local_history, ray_history, strict=True):
        assert ours["reward/mean"] == ref["reward/mean"]
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/kl"):
            assert abs(ours[key] - ref[key]) <= 1e-5 * max(1.0, abs(ref[key])), (key, ours[key], ref[key])
