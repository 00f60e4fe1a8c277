"""One-command GPU check (`make gpu-check`): megarl's GPU paths on one CUDA device, in under 8 minutes, on a bare
CUDA + PyTorch image without network (docs/gpu.md §3).

    python tools/gpu_check.py [--wheels .whl] [--results benchmarks/results]

It installs what the image lacks from wheels brought along (``--wheels``, default ``.whl/``: ``pip download`` on a
networked machine, docs/gpu.md) into a private site directory, then runs each check below as its own pytest
process (tests/gpu; a process each, since each joins its own NCCL world of one) and writes a dated results file
(``gpu_check-<date>`` in ``--results``). A check whose library is missing (vLLM's CUDA wheel, Transformer
Engine) is skipped with one line. Without a CUDA device it says so, lists what it would run and exits 0 (CI
runs that path: tests/unit/test_gpu_check.py). Exit status 1 when a check failed.

Owns: the list of GPU checks and their running; not the tests themselves (tests/gpu, tests/rollout).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# every check together; the install and the start-up fit in the rest of 8 minutes. Checks 1-4 took 155-165 s on an
# H200 (2026-12-04); the rehearsal (5) is estimated at ~100 s and limited to 240 s, so 1-5 end by ~405 s at worst
BUDGET_S = 420.0
BASE_NEEDS = ("megatron.core", "transformers", "tensordict", "safetensors", "einops")


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    tests: tuple[str, ...]  # pytest paths or node ids, run in one process
    needs: tuple[str, ...] = ()  # modules besides BASE_NEEDS; one missing: the check is skipped with one line
    timeout_s: float = 150.0


CYCLE = "tests/gpu/test_cuda_cycle.py"
CHECKS = (
    Check("collective devices over a dense and an MoE cycle (sync, sampling, log-probs, update; NCCL world of one)",
          (f"{CYCLE}::test_cycle_collectives_on_the_compute_device",)),
    Check("checkpoint save/resume bit-exact on CUDA", (f"{CYCLE}::test_checkpoint_resume_is_bit_exact",)),
    Check("policy worker: weight sync, greedy tokens and log-probs vs transformers, an update (fp32 and bf16)",
          ("tests/gpu/test_cuda_engine.py",)),
    Check("megatron-core logits vs transformers (local spec; the Transformer Engine spec where TE is installed)",
          ("tests/gpu/test_cuda_models.py",)),
    Check("one-GPU rehearsal of the 7B recipe at true width (2 layers): round trip, log-probs and greedy tokens vs "
          "transformers, sync bytes vs the plan, each phase's memory vs the planner",
          ("tests/gpu/test_cuda_rehearsal.py",), timeout_s=240.0),
    Check("Transformer Engine round trip: a converted checkpoint in TE layers", ("tests/gpu/test_cuda_models.py",
                                                                                "-k", "True"),
          needs=("transformer_engine",)),
    Check("vLLM engine on CUDA (sync by name, sampling, sleep and wake)", ("tests/rollout/test_vllm_engine.py",),
          needs=("vllm",), timeout_s=200.0),
    Check("vLLM in the policy's process: sleep/wake/sync/generate twice, log-probs equal training's",
          (f"{CYCLE}::test_vllm_sleep_wake_sync_generate_twice",), needs=("vllm",)),
    Check("colocated policy at a realistic memory ratio: vLLM starts at the planner's utilization",
          (f"{CYCLE}::test_colocated_vllm_starts_at_the_planned_utilization",), needs=("vllm",)),
)


@dataclasses.dataclass
class Outcome:
    check: Check
    status: str  # passed, failed, skipped, not run
    seconds: float = 0.0
    note: str = ""
    output: str = ""  # pytest's stdout and stderr


def cuda_device() -> str | None:
    """The CUDA device's name, or None without one (or without torch)."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def dry_run() -> int:
    print("no CUDA device here: nothing is run. On a machine with one GPU, `make gpu-check` runs:")
    for i, c in enumerate(CHECKS, 1):
        needs = f" (needs {', '.join(c.needs)})" if c.needs else ""
        print(f"  {i}. {c.name}{needs}: pytest {' '.join(c.tests)}")
    return 0


def install(wheels: Path, site: Path) -> list[str]:
    """Install every wheel in ``wheels`` into ``site`` (no index, no dependencies: the wheels are the closure)."""
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        return [f"no wheels in {wheels}: using what the image has"]
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", str(site), *map(str, found)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        return [f"pip install from {wheels} failed: {done.stderr.strip().splitlines()[-1:]}"]
    sys.path.insert(0, str(site))
    return [f"installed {len(found)} wheels from {wheels} into {site}"]


def missing(modules: tuple[str, ...]) -> list[str]:
    out = []
    for m in modules:
        try:
            if importlib.util.find_spec(m) is None:
                out.append(m)
        except ImportError:  # a dotted name whose parent package is absent
            out.append(m)
    return out


def run_check(check: Check, env: dict[str, str], left_s: float, wheels: Path) -> Outcome:
    lacking = missing(BASE_NEEDS + check.needs)
    if lacking:
        return Outcome(check, "skipped", note=f"{', '.join(lacking)} not installed (bring the wheels in {wheels})")
    if left_s < 30:
        return Outcome(check, "not run", note="the time budget is spent")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-ra", *check.tests]
    start, limit = time.monotonic(), min(check.timeout_s, left_s)
    try:
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return Outcome(check, "failed", time.monotonic() - start, f"timed out after {limit:.0f} s")
    lines = [ln for ln in done.stdout.splitlines() if ln.strip()]
    summary = lines[-1] if lines else done.stderr.strip()[-200:]
    skips = [ln for ln in lines if ln.startswith("SKIPPED")]
    note = "; ".join([summary.strip("= "), *skips[:3]])
    status = "passed" if done.returncode == 0 and " passed" in summary else (
        "skipped" if done.returncode == 0 else "failed")
    if status == "failed":
        print(done.stdout[-4000:], done.stderr[-2000:], sep="\n")
    return Outcome(check, status, time.monotonic() - start, note, done.stdout + done.stderr)


def environment(device: str) -> list[str]:
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown (no git here)"
    versions = []
    for m in ("megatron.core", "transformers", "vllm", "transformer_engine"):
        try:
            mod = __import__(m, fromlist=["__version__"])
            versions.append(f"{m} {getattr(mod, '__version__', '?')}")
        except Exception:  # noqa: BLE001 - a broken optional install is reported, not raised
            versions.append(f"{m}: not installed")
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except (AttributeError, RuntimeError):  # a torch built without NCCL
        nccl = "none"
    return [f"- megarl commit {commit}; {device}; torch {torch.__version__} (CUDA {torch.version.cuda}, NCCL "
            f"{nccl}); Python {platform.python_version()}",
            f"- {'; '.join(versions)}"]


def write_results(outcomes: list[Outcome], head: list[str], install_lines: list[str], results: Path) -> Path:
    day = datetime.date.today().isoformat()
    path = results / f"gpu_check-{day}.md"
    rows = [f"| {i} | {o.check.name} | {o.status} | {o.seconds:.0f} | {o.note.replace('|', '/')} |"
            for i, o in enumerate(outcomes, 1)]
    text = "\n".join([f"# GPU check, {day}", "", *head, *(f"- {ln}" for ln in install_lines), "",
                      "| # | check | outcome | s | pytest |", "|---|---|---|---|---|", *rows, ""])
    results.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wheels", type=Path, default=REPO / ".whl", help="wheels to install first (default .whl/)")
    p.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results", help="where the results go")
    p.add_argument("--log", type=Path, default=None, help="write every check's whole pytest output to this file")
    p.add_argument("--site", type=Path, default=Path("/tmp/megarl-gpu-check-site"), help="install target")
    args = p.parse_args(argv)
    device = cuda_device()
    if device is None:
        return dry_run()
    start = time.monotonic()
    install_lines = install(args.wheels, args.site)
    print(*install_lines, sep="\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(args.site), str(REPO), os.environ.get("PYTHONPATH", "")]),
               CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONUNBUFFERED="1")
    outcomes = []
    for check in CHECKS:
        o = run_check(check, env, BUDGET_S - (time.monotonic() - start), args.wheels)
        print(f"{o.status:>8}  {o.seconds:5.0f} s  {check.name}" + (f": {o.note}" if o.note else ""), flush=True)
        outcomes.append(o)
        if args.log is not None:
            with args.log.open("a") as f:
                f.write(f"===== {check.name}: {o.status} ({o.seconds:.0f} s)\n{o.output}\n")
    path = write_results(outcomes, environment(device), install_lines, args.results)
    print(f"results: {path} ({time.monotonic() - start:.0f} s)")
    return 1 if any(o.status == "failed" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
