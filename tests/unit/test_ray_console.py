"""What Ray adds to a run's console and /tmp, kept to one line of megarl's each (issue #40): the start-up
notices of a private cluster, the memory monitor's report of a worker it killed; and the session directory a
private cluster leaves, removed at a clean exit. The real run's output: tests/launch/test_private_ray.py."""

from __future__ import annotations

import logging
import os

from ray._private.authentication import authentication_token_setup as ray_auth
from ray.exceptions import OutOfMemoryError, RayActorError

from megarl.controller.group import _memory_monitor_kill
from megarl.trainer.cluster import _quiet_ray_start, _remove_session

# Ray 2.60's OutOfMemoryError text (from a worker it killed on this machine, threshold lowered to 5%; the object
# store, eviction and top-memory tables cut short)
RAY_OOM_REPORT = """1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 192.0.2.2, \
ID: 94c85dbebe2383d7bf25fc18e373bbe742ef7f25f452bb326fecf4d3) was 1.88GB used / 23.54GB limit (0.079767)
OOM kill reason: Memory usage 2016206848B exceeded threshold of 1263810176B (5.0% of 25276203008B limit)
Object store memory usage: [- objects spillable: 0
- bytes spillable: 0
(global lru) bytes evicted: 0]
Ray killed 1 worker(s) based on the killing policy
Considered workers: [
Selected to kill: (Actor(ffcb5cf094d05e2e92b91e8601000000): job ID=01000000, task name=A.__init__, pid=14287)
]
Top 10 memory users: PID	MEM(GB)	COMMAND
14287	0.22	ray::A.f
Refer to the documentation on how to address the out of memory issue: https://docs.ray.io/en/latest/ray-observabi\
lity/user-guides/debug-apps/debug-memory.html. Consider provisioning more memory on this node or reducing task \
parallelism by requesting more CPUs per task."""


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_memory_monitor_kill_is_one_line(caplog):
    with caplog.at_level(logging.DEBUG, logger="megarl.controller.group"):
        line = _memory_monitor_kill(OutOfMemoryError(RAY_OOM_REPORT))
    assert line == ("killed by Ray's memory monitor: memory on node 192.0.2.2 was 1.88GB used of 23.54GB (over Ray's "
                    "threshold of 5.0%); give the run more memory or raise RAY_memory_usage_threshold (Ray's report: "
                    "MEGARL_LOG_LEVEL=DEBUG).")
    assert [r.levelno for r in caplog.records] == [logging.DEBUG] and RAY_OOM_REPORT in caplog.records[0].message
    # Ray before 2.56 worded it so (an actor's death may carry it too)
    old = ("Task was killed due to the node running low on memory.\nMemory on the node (IP: 172.17.0.2, ID: a6a1) "
           "where the task (actor ID: a019) was running was 21.81GB / 33.28GB (0.655227), which exceeds the memory "
           "usage threshold of 0.65. Ray killed this worker")
    assert _memory_monitor_kill(RayActorError(error_msg=old)).startswith(
        "killed by Ray's memory monitor: memory on node 172.17.0.2 was 21.81GB used of 33.28GB (over Ray's threshold "
        "of 0.65);")
    assert _memory_monitor_kill(OutOfMemoryError("no numbers")).startswith("killed by Ray's memory monitor; give")
    assert _memory_monitor_kill(RayActorError(error_msg="The actor died unexpectedly")) is None


def test_private_start_drops_ray_notices_only():
    """Ray's own functions emit the notices; the token-auth one is dropped, the warning of a disabled token
    authentication is not."""
    log = logging.getLogger(ray_auth.__name__)
    records = _Records()
    log.addHandler(records)
    try:
        _quiet_ray_start()
        _quiet_ray_start()  # once per logger
        ray_auth._warn_token_auth_enabled()
        ray_auth._warn_token_auth_disabled()
        logging.getLogger("ray._private.worker").addHandler(records)
        logging.getLogger("ray._private.worker").info("Started a local Ray instance.")
    finally:
        log.removeHandler(records)
        logging.getLogger("ray._private.worker").removeHandler(records)
    assert len(log.filters) == 1
    assert len(records.messages) == 1 and records.messages[0].startswith("Token authentication is disabled")


def test_remove_session(tmp_path):
    ray_tmp = tmp_path / "ray"
    ours, other = ray_tmp / "session_2026-12-04_09-44-10_1_8276", ray_tmp / "session_2026-12-04_09-41-55_2_6836"
    for session in (ours, other):
        (session / "logs").mkdir(parents=True)
        (session / "logs" / "raylet.out").write_text("x")
    os.symlink(ours, ray_tmp / "session_latest")
    _remove_session(ours)
    assert sorted(p.name for p in ray_tmp.iterdir()) == [other.name]  # the link to it went too
    os.symlink(other, ray_tmp / "session_latest")
    (ours / "logs").mkdir(parents=True)
    _remove_session(ours)
    assert sorted(p.name for p in ray_tmp.iterdir()) == [other.name, "session_latest"]  # another's link stays
    _remove_session(ours)  # already gone: nothing to do
