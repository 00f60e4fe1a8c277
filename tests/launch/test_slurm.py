"""`launch/slurm/megarl.sbatch` end to end on a real single-node Slurm cluster.

Opt-in (``MEGARL_SLURM_TEST=1``, which .ci/run sets): the module fixture brings Slurm up here as root
(installs slurm-wlm and munge with apt when missing, starts munged, slurmctld and slurmd by hand from a
slurm.conf in a temp dir) and stops what it started afterwards; any step that fails skips the test with
the command and its output. The jobs train the tiny addition example on their own Ray cluster (own port
and temp dir): 3 steps; a config error; a graceful stop on the time-limit warning, a requeue and a
resume. The test session's Ray cluster (`ray_cluster`) runs alongside: it must come out untouched.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from megarl.metrics.tracking import read_metrics
from megarl.testing.processes import free_port_block, port_in_use, processes_mentioning

# Opt-in: the fixture installs packages with apt-get and cancels every job of the user (root) on the
# cluster it starts. .ci/run sets MEGARL_SLURM_TEST=1; a plain `make test` elsewhere skips this file.
pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("MEGARL_SLURM_TEST") != "1",
    reason="opt-in: set MEGARL_SLURM_TEST=1 to run it (it installs slurm-wlm and munge with apt-get as root, starts "
           "Slurm daemons and runs `scancel --user=root`); .ci/run sets it")]

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "launch" / "slurm" / "megarl.sbatch"
EXAMPLE = ROOT / "examples" / "grpo_addition_tiny" / "config.yaml"
JOB_TIMEOUT_S = 900
DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
               "BOOT_FAIL", "DEADLINE"}


class SlurmUnavailable(Exception):
    """Slurm could not be brought up here; the message says which step failed and how."""


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _run(cmd: list[str] | str, what: str, timeout: float = 120, **kwargs) -> str:
    """Run a set-up step; raise SlurmUnavailable with the command and its output tail if it fails."""
    try:
        p = subprocess.run(cmd, shell=isinstance(cmd, str), capture_output=True, text=True, timeout=timeout,
                           **kwargs)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SlurmUnavailable(f"{what}: {cmd!r} failed: {e}") from e
    if p.returncode != 0:
        raise SlurmUnavailable(f"{what}: {cmd!r} exited {p.returncode}:\n{_tail(p.stdout + p.stderr)}")
    return p.stdout


def _install() -> None:
    if all(shutil.which(b) for b in ("sbatch", "slurmctld", "slurmd", "munged")):
        return
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"]
    try:
        _run(install, "installing Slurm", timeout=600, env=env)
    except SlurmUnavailable:  # a fresh machine may have empty package lists
        _run(["apt-get", "update", "-q"], "apt-get update before installing Slurm", timeout=600, env=env)
        _run(install, "installing Slurm", timeout=600, env=env)


def _stop_pid(pid: int, grace_s: float = 10) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            os.kill(pid, 0)
            time.sleep(0.2)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class LocalSlurm:
    """munged (unless one runs already), slurmctld and slurmd for this machine, state in `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = os.environ | {"SLURM_CONF": str(self.conf)}
        self.node = socket.gethostname().split(".")[0]
        self.pid_files: list[Path] = []  # daemons this fixture started, stopped in reverse order

    def start(self) -> None:
        if os.geteuid() != 0:
            raise SlurmUnavailable(f"starting Slurm daemons needs root (euid {os.geteuid()})")
        _install()
        for port in (6817, 6818):  # fixed by Slurm's defaults and by the client tools
            if port_in_use(port):
                raise SlurmUnavailable(f"port {port} is in use: another slurmctld/slurmd runs on this machine")
        self._start_munge()
        self._write_conf()
        for daemon in ("slurmctld", "slurmd"):
            _run([f"/usr/sbin/{daemon}", "-f", str(self.conf)], f"starting {daemon}", env=self.env)
            self.pid_files.append(self.root / f"{daemon}.pid")
        self._wait_idle()

    def _start_munge(self) -> None:
        if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
            return  # a munged already runs: use it, leave it running
        key = Path("/etc/munge/munge.key")
        setup = ("install -d -o munge -g munge -m 0755 /run/munge"
                 f" && {{ test -s {key} || dd if=/dev/urandom of={key} bs=1024 count=1 2>/dev/null; }}"
                 f" && chown munge:munge {key} && chmod 0400 {key}")
        _run(setup, "preparing munge (run dir, key)")
        _run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], "starting munged")
        self.pid_files.append(Path("/run/munge/munged.pid"))
        _run("munge -n | unmunge", "checking munge (munge -n | unmunge)")

    def _write_conf(self) -> None:
        mem_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        r = self.root
        self.conf.write_text(f"""\
ClusterName=megarltest
SlurmctldHost={self.node}
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
ReturnToService=2
KillWait=10
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd.log
NodeName={self.node} CPUs={os.cpu_count()} RealMemory={int(mem_mib * 0.9)} State=UNKNOWN
PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""")
        for d in ("state", "spool"):
            (r / d).mkdir(exist_ok=True)

    def _wait_idle(self, timeout_s: float = 60) -> None:
        deadline, state = time.monotonic() + timeout_s, ""
        while time.monotonic() < deadline:
            p = subprocess.run(["sinfo", "-h", "-n", self.node, "-o", "%t"], capture_output=True, text=True,
                               env=self.env)
            state = (p.stdout + p.stderr).strip()
            if state == "idle":
                return
            time.sleep(0.5)
        logs = "\n".join(f"--- {f.name}\n{_tail(f.read_text(errors='replace'), 8)}"
                         for f in (self.root / "slurmctld.log", self.root / "slurmd.log") if f.exists())
        raise SlurmUnavailable(f"node {self.node} not idle after {timeout_s:.0f}s (sinfo: {state!r})\n{logs}")

    def job(self, job_id: str) -> dict[str, str]:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                             env=self.env).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def stop(self) -> None:
        """Cancel what still runs (its script then stops its Ray), then stop the daemons we started."""
        subprocess.run(["scancel", "--user=root"], capture_output=True, env=self.env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and subprocess.run(
                ["squeue", "-h"], capture_output=True, text=True, env=self.env).stdout.strip():
            time.sleep(1)
        for pid_file in reversed(self.pid_files):
            if pid_file.exists():
                _stop_pid(int(pid_file.read_text().split()[0]))


@pytest.fixture(scope="module")
def slurm():
    root = Path(tempfile.mkdtemp(prefix="megarl-slurm-"))
    cluster = LocalSlurm(root)
    try:
        cluster.start()
    except SlurmUnavailable as e:
        cluster.stop()
        pytest.skip(f"no Slurm here: {e}")
    yield cluster
    cluster.stop()
    shutil.rmtree(root, ignore_errors=True)


def _free_ports(n: int) -> int:
    """A port p with p .. p+n-1 all free (the sbatch script uses RAY_PORT, +1, +2)."""
    base = free_port_block(6390, 6590, n)
    if base is None:
        raise RuntimeError("no free port block in 6390-6590")
    return base


def _sbatch(slurm: LocalSlurm, tmp_path: Path, overrides: dict, env: dict | None = None) -> tuple[str, str]:
    """Submit the sbatch script on the example with `overrides` (and extra `env`); (job id, its Ray dir)."""
    ray_tmp = tempfile.mkdtemp(prefix="mrl_ray_", dir="/tmp")  # short: Ray's unix sockets live there
    # The job's Ray must not find the session's cluster: no inherited address, its own port and dir.
    job_env = {k: v for k, v in slurm.env.items() if k not in ("RAY_ADDRESS", "RAY_NAMESPACE")} | {
        "RAY_AUTH_MODE": "disabled", "RAY_PORT": str(_free_ports(3)), "RAY_TMPDIR": ray_tmp,
        "RAY_START_ARGS": f"--object-store-memory={200 * 2**20}", "LOG_DIR": str(tmp_path / "logs"),
        "VENV": sys.prefix, "RAY_JOIN_TIMEOUT": "180"} | (env or {})
    submit = subprocess.run(
        ["sbatch", "--parsable", f"--output={tmp_path / 'job.out'}", f"--chdir={tmp_path}", str(SBATCH), str(EXAMPLE),
         *(f"{k}={v}" for k, v in overrides.items())], capture_output=True, text=True, env=job_env)
    assert submit.returncode == 0, f"sbatch exited {submit.returncode}: {submit.stderr}"
    return submit.stdout.strip().split(";")[0], ray_tmp


def _wait(slurm: LocalSlurm, job_id: str, tmp_path: Path, start: float) -> tuple[dict[str, str], str]:
    """Poll until the job is done; (scontrol's job record, the job's output)."""
    # `sbatch --wait` polls lazily (it doubled a 21 s job here): poll scontrol instead.
    job = slurm.job(job_id)
    while job.get("JobState") not in DONE_STATES and time.monotonic() - start < JOB_TIMEOUT_S:
        time.sleep(1)
        job = slurm.job(job_id)
    print(f"Slurm job {job_id}: {job.get('JobState')} exit {job.get('ExitCode')} in {time.monotonic() - start:.0f}s")
    log = tmp_path / "job.out"
    return job, log.read_text(errors="replace") if log.exists() else "(no job output)"


def _submit(slurm: LocalSlurm, tmp_path: Path, overrides: dict) -> tuple[dict[str, str], str, str]:
    """Run the sbatch script on the example with `overrides`; (scontrol's job record, its output, Ray dir)."""
    start = time.monotonic()
    job_id, ray_tmp = _sbatch(slurm, tmp_path, overrides)
    job, log = _wait(slurm, job_id, tmp_path, start)
    return job, log, ray_tmp


def _assert_ray_stopped_and_session_cluster_untouched(ray_tmp: str) -> None:
    """The job stopped its own Ray and nothing else: none of its processes are left (they all name
    its temp dir), and the session's cluster still has both nodes and runs tasks."""
    import ray

    assert not processes_mentioning(ray_tmp), processes_mentioning(ray_tmp)
    assert sum(n["Alive"] for n in ray.nodes()) == 2
    assert ray.get(ray.remote(lambda: 42).remote(), timeout=60) == 42
    shutil.rmtree(ray_tmp, ignore_errors=True)


def test_sbatch_trains_tiny_example_beside_session_ray(slurm, ray_cluster, tmp_path):
    from megarl.testing.addition import make_task

    task = make_task(tmp_path / "task")
    out = tmp_path / "run"
    job, job_log, ray_tmp = _submit(slurm, tmp_path, {
        "model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
        "trainer.output_dir": out, "trainer.total_steps": 3, "trainer.save_every": 0, "trainer.val_every": 0,
        "trainer.tensorboard": "false"})
    assert job.get("JobState") == "COMPLETED" and job.get("ExitCode") == "0:0", _tail(job_log, 40)
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3], _tail(job_log, 40)
    _assert_ray_stopped_and_session_cluster_untouched(ray_tmp)


def test_sbatch_failing_driver_fails_job_and_stops_ray(slurm, ray_cluster, tmp_path):
    job, job_log, ray_tmp = _submit(slurm, tmp_path, {"trainer.total_stepz": 3})  # a config error
    assert job.get("JobState") == "FAILED" and job.get("ExitCode") == "2:0", _tail(job_log, 40)
    assert "did you mean 'total_steps'" in job_log and "stopping the Ray cluster" in job_log
    _assert_ray_stopped_and_session_cluster_untouched(ray_tmp)


def _logged_steps(out: Path) -> int:
    """Lines metrics.jsonl holds (whole ones only: the driver may be writing one)."""
    path = out / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def _checkpoints(out: Path) -> list[int]:
    """The steps of the finished checkpoints under out/checkpoints (step_NNNNNN holding trainer.json)."""
    return sorted(int(d.name.removeprefix("step_")) for d in (out / "checkpoints").glob("step_*")
                  if (d / "trainer.json").is_file())


def test_sbatch_time_limit_warning_saves_exits_75_and_requeues_once(slurm, ray_cluster, tmp_path):
    """The time-limit warning (SIGUSR1 to the batch shell, what `--signal=B:USR1@600` sends) makes the driver
    finish its step, checkpoint it and exit 75, before the job's Ray is stopped. With MEGARL_REQUEUE=1 and
    MEGARL_MAX_REQUEUES=1 the job is requeued once: the second allocation resumes from that checkpoint, and
    the same warning there ends the job with 75 (a second requeue would pass the bound)."""
    from megarl.testing.addition import make_task

    task = make_task(tmp_path / "task")
    out = tmp_path / "run"
    start = time.monotonic()
    job_id, ray_tmp = _sbatch(slurm, tmp_path, {
        "model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
        "trainer.output_dir": out, "trainer.total_steps": 200, "trainer.save_every": 0, "trainer.val_every": 0,
        "trainer.tensorboard": "false"}, env={"MEGARL_REQUEUE": "1", "MEGARL_MAX_REQUEUES": "1"})
    warned: list[int] = []  # the number of finished steps when each allocation got its warning
    job = slurm.job(job_id)
    while job.get("JobState") not in DONE_STATES and time.monotonic() - start < JOB_TIMEOUT_S:
        steps = _logged_steps(out)
        # once per allocation, as soon as it has finished a step of its own
        if job.get("JobState") == "RUNNING" and len(warned) == int(job.get("Restarts", 0)) and steps > max(
                _checkpoints(out), default=0):
            subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True, env=slurm.env)
            warned.append(steps)
        time.sleep(0.5)
        job = slurm.job(job_id)
    job, job_log = _wait(slurm, job_id, tmp_path, start)
    assert job.get("JobState") == "FAILED" and job.get("ExitCode") == "75:0", _tail(job_log, 60)
    assert job.get("Restarts") == "1" and len(warned) == 2, (warned, _tail(job_log, 60))
    # each allocation saved the step it was in when warned (or a later one) and stopped there
    first, second = _checkpoints(out)  # trainer.keep_checkpoints: 2
    assert warned[0] <= first < warned[1] <= second < 200, (warned, first, second)
    # the second allocation resumed from the first one's checkpoint: every step once, none after the last save
    assert [m["step"] for m in read_metrics(out)] == list(range(1, second + 1)), _tail(job_log, 60)
    assert job_log.count("the driver exited with status 75") == 2, _tail(job_log, 60)
    assert "requeueing job" in job_log and "not requeueing: 1 requeue(s) done (MEGARL_MAX_REQUEUES=1)" in job_log
    assert job_log.index("the driver exited with status 75") < job_log.index("stopping the Ray cluster")
    _assert_ray_stopped_and_session_cluster_untouched(ray_tmp)
