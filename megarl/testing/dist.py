"""Run a function on every rank of a fresh multi-process gloo world (tests, benchmarks).

Ranks are forked from a fork server (``multiprocessing``'s ``forkserver``) that has imported torch,
megatron-core, transformers and megarl's roles once, at the first world of the process: a rank starts in
milliseconds instead of re-importing them (~7 s of CPU each on the 2-core CI machine, 4 ranks a world, ~30
worlds a test session). The server imports modules only: no torch op runs in it, so no OpenMP team or
thread exists to be copied into a fork, and each rank gets the caller's environment, ``sys.path`` and working
directory as a spawned process would. Each rank joins torch.distributed through the standard environment
variables on a free loopback port, runs ``fn(rank, world_size, *args)``, and returns a JSON-serialisable
result. A rank that raises makes :func:`run_world` raise with that rank's traceback; a world that does not
finish within ``timeout_s`` is killed. A world on CUDA gives rank r the device r
(``LOCAL_RANK``): with fewer devices it is not started and raises :class:`NotEnoughDevices`, which pytest
reports as a skip with its reason. (CUDA is never initialised in the fork server: a rank initialises its own.)
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
import traceback
import unittest
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from megarl.host import forkserver

# What the worlds import (vLLM's engine where the CPU build is installed: a missing module is skipped by the
# server and imported, or not, by the ranks themselves).
PRELOAD = ("torch", "torch.distributed", "transformers", "megatron.core", "megatron.core.parallel_state",
           "megarl.roles.policy", "megarl.roles.critic", "megarl.checkpoint.convert", "vllm.entrypoints.llm")


class NotEnoughDevices(unittest.SkipTest):
    """A CUDA world needs one device per rank and this machine has fewer (pytest: a skip with this reason)."""


def check_devices(world_size: int, cuda: bool = False) -> None:
    """Raise :class:`NotEnoughDevices` unless each of ``world_size`` ranks can have a CUDA device of its own, where
    the world runs on CUDA: when ``cuda`` (it needs CUDA) or when CUDA is available (its ranks then choose NCCL and
    the device of their rank, megarl.parallel.init)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (cuda or count > 0) and world_size > count:
        raise NotEnoughDevices(f"a world of {world_size} CUDA ranks needs {world_size} CUDA devices (one per rank), "
                               f"found {count}; run it on a machine with {world_size} GPUs")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, port: int, out_dir: str, args: tuple,
           env: dict[str, str]) -> None:
    os.environ.clear()  # the caller's, not the fork server's (started at the process's first world)
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)  # the env var comes too late (torch is imported); also keeps results deterministic
    path = Path(out_dir) / f"rank{rank}.json"
    try:
        result = {"ok": True, "value": fn(rank, world_size, *args)}
    except BaseException:  # reported to the parent, which raises
        result = {"ok": False, "error": traceback.format_exc()}
    path.write_text(json.dumps(result))
    if not result["ok"]:
        raise SystemExit(1)


def run_world(fn: Callable, world_size: int, *args: Any, timeout_s: float = 600,
              cuda: bool = False) -> list[Any]:
    """Run ``fn`` on ``world_size`` forked ranks; return the per-rank results in rank order. ``cuda``: the world
    needs CUDA; :func:`check_devices` runs first (a CUDA world without a device per rank is not started)."""
    check_devices(world_size, cuda)
    forkserver.preload(*PRELOAD)  # read when the server starts (megarl.host.forkserver)
    with tempfile.TemporaryDirectory(prefix="megarl-world-") as out_dir:
        ctx = mp.start_processes(
            _entry, args=(fn, world_size, free_port(), out_dir, args, dict(os.environ)), nprocs=world_size,
            join=False, start_method="forkserver",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"a world of {world_size} ranks did not finish within {timeout_s:.0f} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            pass  # the failing rank's traceback is in its result file
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for rank in range(world_size):
            path = Path(out_dir) / f"rank{rank}.json"
            if not path.exists():
                raise RuntimeError(f"rank {rank} of {world_size} died without a result (killed or crashed)")
            r = json.loads(path.read_text())
            if not r["ok"]:
                raise RuntimeError(f"rank {rank} of {world_size} raised:\n{r['error']}")
            results.append(r["value"])
        return results


def from_collect_rank(obj: Any, layout: Any) -> Any:
    """The object (a batch, log-probs) of the rank that answers for data-parallel rank 0 (last pipeline
    stage, tensor rank 0), on every rank of the world (inside a :func:`run_world` function)."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=layout.rank_of(tp=0, pp=layout.pp - 1, dp=0))
    return box[0]


def training_log_probs(role: Any, rows: Any, layout: Any) -> tuple[Any, float]:
    """A policy role's training log-probs of rollout ``rows`` (a collective forward, after ``to_train``) and
    their mean |training - rollout| gap over response tokens (the rollout check), on every rank."""
    from megarl.rollout.mismatch import logprob_abs_diff

    lp = role.compute_log_probs(rows.select("input_ids", "attention_mask"))
    lp = from_collect_rank(None if lp is None else lp["log_probs"], layout)
    return lp, logprob_abs_diff(lp, rows["rollout_log_probs"], rows["response_mask"])


def sgd_policy(hf_dir: Any, ckpt_dir: Any, algorithm: Any, *, max_tokens: int, max_size: int) -> Any:
    """A policy role in this process (a world of one, joined here) on ``hf_dir`` converted into ``ckpt_dir``:
    SGD at lr 1e-12 without clipping, so an update's metrics describe the loss at the loaded weights; update
    micro-batches of at most ``max_tokens`` tokens and ``max_size`` rows."""
    from megarl.checkpoint.convert import convert_hf_to_megatron
    from megarl.controller.role import WorkerContext
    from megarl.engine.config import EngineConfig, MicroBatchConfig, OptimConfig, OptimizerName
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.policy import PolicyRole
    from megarl.rollout.config import RolloutConfig

    convert_hf_to_megatron(hf_dir, ckpt_dir, tp=1, pp=1)
    layout = ParallelLayout()
    init_distributed(layout)
    ctx = WorkerContext(0, 1, layout, layout.coords(0), "127.0.0.1", "local", 0, "cpu")
    engine = EngineConfig(optim=OptimConfig(optimizer=OptimizerName.SGD, lr=1e-12, clip_grad=0.0,
                                            use_distributed_optimizer=False),
                          micro_batch=MicroBatchConfig(max_tokens=max_tokens, max_size=max_size))
    return PolicyRole(ctx, checkpoint_dir=str(ckpt_dir), engine=engine, algorithm=algorithm, temperature=1.0,
                      rollout=RolloutConfig())
