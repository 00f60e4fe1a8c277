"""`launch/local.sh` end to end on this machine: its own Ray head, `megarl train` on the tiny example.

GRPO steps of the tiny addition example (its cluster: policy TP2 on 2 CPU worker processes, the reference
colocated) with a few overrides; the script's Ray gets its own port block and temp dir. One run, stopped with
Ctrl-C (SIGINT to the script's process group) once it has logged two steps: exit 75, the step in progress saved.
References: the files the run writes (``metrics.jsonl``, ``config.yaml``) against the overrides given, the
script's exit status and log, and /proc (nothing of the script's Ray is left running).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from megarl.testing.processes import free_port_block, processes_mentioning

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "local.sh"
EXAMPLE = ROOT / "examples" / "grpo_addition_tiny" / "config.yaml"
STEPS, PROMPTS, N, LR = 500, 4, 4, 3.0e-4  # the example: 100 steps, 16 prompts x 16 responses, lr 2e-3
SIGNAL_AFTER = 2  # steps logged before Ctrl-C (far fewer than STEPS: each takes well under a second)
TIMEOUT_S = 600


def _free_port_block(n: int = 3) -> int | None:
    """A port p with p .. p+n-1 free (the script uses RAY_PORT, +1 and +2)."""
    return free_port_block(6690, 6890, n)


def _launch(root: Path, steps: int) -> tuple[subprocess.Popen, Path, str]:
    """Start the script on the tiny example in its own session, `steps` steps; (process, output dir, Ray dir)."""
    if shutil.which("bash") is None:
        pytest.skip("launch/local.sh needs bash")
    if importlib.util.find_spec("ray") is None:
        pytest.skip("launch/local.sh starts a Ray head: the `ray` package is not installed")
    port = _free_port_block()
    if port is None:
        pytest.skip("no free block of 3 ports in 6690-6890 for the script's Ray head")
    from megarl.testing.addition import make_task

    task = make_task(root / "task", train_rows=64, val_rows=8)
    out = root / "run"
    overrides = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
                 "trainer.output_dir": out, "trainer.total_steps": steps, "trainer.save_every": 0,
                 "trainer.val_every": 0, "trainer.tensorboard": "false", "data.batch_size": PROMPTS,
                 "rollout.sampling.n": N, "policy.optim.lr": LR}
    ray_tmp = tempfile.mkdtemp(prefix="mrl_ray_", dir="/tmp")  # short: Ray's unix socket paths
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_NAMESPACE")} | {
        "RAY_AUTH_MODE": "disabled", "RAY_PORT": str(port), "RAY_TMPDIR": ray_tmp, "VENV": sys.prefix,
        "PYTHON": sys.executable, "GPUS_PER_NODE": "0", "CPUS_PER_NODE": "4",
        "RAY_START_ARGS": f"--object-store-memory={200 * 2**20}"}
    cmd = ["bash", str(SCRIPT), str(EXAMPLE), *(f"{k}={v}" for k, v in overrides.items())]
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=_as_in_a_terminal)
    return proc, out, ray_tmp


def _as_in_a_terminal() -> None:
    """SIGINT handled by default, as under a terminal: a test run started in the background (``make test &``,
    nohup) ignores SIGINT, and bash cannot trap a signal ignored on entry, so Ctrl-C would never reach the
    script's trap."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _finish(proc: subprocess.Popen, ray_tmp: str) -> tuple[str, list[str]]:
    """Wait for the script; (its output, the processes of its Ray still running)."""
    try:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the script's trap stops its Ray
        log, _ = proc.communicate(timeout=60)
        pytest.fail(f"launch/local.sh did not finish in {TIMEOUT_S} s:\n{log[-4000:]}")
    deadline = time.monotonic() + 15  # Ray's reaper may still be finishing what the head left
    while (leftovers := processes_mentioning(ray_tmp)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return log, leftovers


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Ctrl-C in a terminal once two steps are logged: SIGINT to the script's whole process group."""
    proc, out, ray_tmp = _launch(tmp_path_factory.mktemp("local_sh"), STEPS)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + TIMEOUT_S
    while proc.poll() is None and not (metrics.exists() and metrics.read_text().count("\n") >= SIGNAL_AFTER):
        assert time.monotonic() < deadline, "no training step logged in time"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    log, leftovers = _finish(proc, ray_tmp)
    yield {"rc": proc.returncode, "log": log, "out": out, "leftovers": leftovers, "ray_tmp": ray_tmp}
    shutil.rmtree(ray_tmp, ignore_errors=True)


def test_ctrl_c_saves_the_step_in_progress_and_exits_75(launched):
    """The driver (in a session of its own) gets exactly one SIGTERM from the script, so it finishes its step,
    checkpoints it and exits 75, and only then is the script's Ray stopped. Two signals would have abandoned the
    step without a checkpoint."""
    from megarl.metrics.tracking import read_metrics

    log, out = launched["log"], launched["out"]
    assert launched["rc"] == 75, log[-4000:]
    assert "SIGINT: asking the driver to finish its step" in log, log[-4000:]
    assert "SIGINT again" not in log and "abandoning the current step" not in log, log[-4000:]
    assert log.index("the driver exited with status 75") < log.index("stopping Ray (exit status 75)"), log[-4000:]
    steps = [m["step"] for m in read_metrics(out)]
    saved = [d.name for d in (out / "checkpoints").glob("step_*") if (d / "trainer.json").is_file()]
    assert steps == list(range(1, len(steps) + 1)) and SIGNAL_AFTER <= len(steps) < STEPS, log[-4000:]
    assert saved == [f"step_{len(steps):06d}"], (saved, log[-4000:])  # the last finished step, saved on the signal
    assert not launched["leftovers"], launched["leftovers"]


def test_metrics_show_the_overrides(launched):
    from megarl.metrics.tracking import read_metrics

    records = read_metrics(launched["out"])
    assert len(records) >= SIGNAL_AFTER, launched["log"][-4000:]
    for r in records:
        assert r["batch/num_sequences"] == PROMPTS * N  # the example's own: 16 x 16
        assert r["rollout/num_tokens"] == PROMPTS * N  # one-token responses (max_new_tokens 1)
        assert r["actor/lr"] == LR  # constant schedule, no warm-up: the lr given, exactly
        assert 0.0 <= r["reward/mean"] <= 1.0
    assert not (launched["out"] / "tensorboard").exists()  # trainer.tensorboard=false


def test_config_yaml_records_the_overrides_over_the_example(launched):
    cfg = yaml.safe_load((launched["out"] / "config.yaml").read_text())
    example = yaml.safe_load(EXAMPLE.read_text())
    assert cfg["trainer"]["total_steps"] == STEPS != example["trainer"]["total_steps"]
    assert cfg["data"]["batch_size"] == PROMPTS != example["data"]["batch_size"]
    assert cfg["rollout"]["sampling"]["n"] == N != example["rollout"]["sampling"]["n"]
    assert cfg["policy"]["optim"]["lr"] == LR != example["policy"]["optim"]["lr"]
    assert cfg["trainer"]["tensorboard"] is False and cfg["trainer"]["save_every"] == 0
    # the example's own settings, not overridden, still apply
    assert cfg["cluster"]["pools"]["main"]["tp"] == example["cluster"]["pools"]["main"]["tp"] == 2
    assert cfg["cluster"]["launcher"] == "ray"
    assert cfg["algorithm"]["mini_batches"] == example["algorithm"]["mini_batches"]
    assert cfg["rollout"]["max_new_tokens"] == example["rollout"]["max_new_tokens"] == 1
