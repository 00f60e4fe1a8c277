"""Benchmark HF <-> Megatron checkpoint conversion on a random ~1.1B Llama: time, peak RSS, round trip.

    .venv/bin/python benchmarks/convert.py [--dtype bfloat16|float32] [--work-dir DIR] [--results FILE]

Writes a random HF model (TinyLlama-1.1B shape) tensor by tensor, runs HF -> Megatron (tp=2, pp=2)
and Megatron -> HF each in a fresh subprocess of this script (``--phase``), samples that process's
RSS and its whole process tree's RSS and PSS every 50 ms (megatron-core's torch_dist save forks
writer processes), checks the round trip bit-exactly tensor by tensor, prints a table
and writes it to benchmarks/results/convert-<date>.md. Temporary checkpoints are deleted afterwards.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

logger = logging.getLogger("bench.convert")
TARGET = 1.5  # peak RSS <= TARGET x model bytes
SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=22, num_heads=32, num_kv_heads=4)


def make_model(out: Path, dtype, seed: int = 0) -> tuple[int, int]:
    from megarl.testing.tiny import write_random_model

    return write_random_model(out, "llama", dtype=dtype, seed=seed, **SHAPE)


def run_phase(args: argparse.Namespace) -> None:
    """Child: one conversion direction; writes its summary as JSON."""
    from megarl.checkpoint.convert import convert_hf_to_megatron, convert_megatron_to_hf

    base = psutil.Process().memory_info().rss  # after imports, before any weights
    if args.phase == "to-mcore":
        s = convert_hf_to_megatron(args.src, args.dst, tp=args.tp, pp=args.pp)
    else:
        s = convert_megatron_to_hf(args.src, args.dst)
    logger.info("%s", s.line())
    Path(args.result).write_text(json.dumps({"seconds": s.seconds, "base_rss": base}))


def measure(cmd: list[str], interval: float = 0.05) -> dict:
    """Run ``cmd``; sample RSS and anon RSS of the process, RSS and PSS summed over its process tree."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd)
    root = psutil.Process(proc.pid)
    peak = dict(main_rss=0, main_anon=0, tree_rss=0, tree_pss=0, procs=1)
    while proc.poll() is None:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        rss = pss = 0
        for i, p in enumerate(procs):
            try:
                m = p.memory_full_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            rss, pss = rss + m.rss, pss + m.pss
            if i == 0:
                peak["main_rss"] = max(peak["main_rss"], m.rss)
                peak["main_anon"] = max(peak["main_anon"], m.rss - m.shared)  # shared = file-backed + shmem
        peak["tree_rss"], peak["tree_pss"] = max(peak["tree_rss"], rss), max(peak["tree_pss"], pss)
        peak["procs"] = max(peak["procs"], len(procs))
        time.sleep(interval)
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
    peak["wall_s"] = time.perf_counter() - start
    peak["ru_maxrss"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    return peak


def verify(a: Path, b: Path) -> dict:
    """Compare every tensor of two HF dirs one at a time: bit-exact means same names, dtypes, shapes and bytes."""
    import torch
    from safetensors import safe_open

    def weight_files(d: Path) -> dict[str, Path]:  # tensor name -> safetensors file
        if (index := d / "model.safetensors.index.json").is_file():
            return {n: d / f for n, f in json.loads(index.read_text())["weight_map"].items()}
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            return dict.fromkeys(f.keys(), d / "model.safetensors")

    fa_of, fb_of = weight_files(a), weight_files(b)
    res = dict(compared=0, value_diffs=[], dtype_diffs=[], name_diffs=sorted(fa_of.keys() ^ fb_of.keys()))
    for name in sorted(fa_of.keys() & fb_of.keys()):
        with safe_open(str(fa_of[name]), "pt") as fa, safe_open(str(fb_of[name]), "pt") as fb:
            ta, tb = fa.get_tensor(name), fb.get_tensor(name)
        res["compared"] += 1
        if ta.dtype != tb.dtype:
            res["dtype_diffs"].append(f"{name} {ta.dtype} -> {tb.dtype}")
            tb = tb.to(ta.dtype)  # values are still compared exactly, in the source dtype
        if ta.shape != tb.shape or not torch.equal(ta.view(torch.uint8), tb.view(torch.uint8)):
            res["value_diffs"].append(name)
    res["bit_exact"] = not (res["value_diffs"] or res["dtype_diffs"] or res["name_diffs"])
    return res


def report(info: dict, phases: dict, ok: dict) -> str:
    mb = info["model_bytes"]

    def gb(x: float) -> str:
        return f"{x / 1e9:.2f} GB ({x / mb:.2f}x)"

    lines = [
        f"# Conversion benchmark, {info['date']}", "",
        f"- megarl commit {info['commit']}; {info['cores']} CPU cores, {info['ram_gib']:.0f} GiB RAM, no GPU; "
        f"{info['platform']}",
        f"- Python {info['python']}, torch {info['torch']}, megatron-core {info['mcore']}, transformers {info['tf']}",
        f"- Model: random Llama ({info['shape']}), {info['dtype']}: {info['params']:,} params, {mb:,} bytes",
        f"- Layout tp={info['tp']}, pp={info['pp']}; target: peak RSS <= {TARGET}x model bytes "
        f"= {TARGET * mb / 1e9:.2f} GB; (Nx) = ratio to model bytes",
        "- Timings are noisy: another engineer ran tests on this 2-core machine at the same time.", "",
        "| direction | wall s | convert s | RSS after imports | peak RSS main | main anon | tree RSS | tree PSS "
        "| procs | ru_maxrss children | target (main RSS) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in phases.items():
        lines.append(
            f"| {name} | {p['wall_s']:.1f} | {p['seconds']:.1f} | {gb(p['base_rss'])} | {gb(p['main_rss'])} | "
            f"{gb(p['main_anon'])} | {gb(p['tree_rss'])} | {gb(p['tree_pss'])} | {p['procs']} | "
            f"{gb(p['ru_maxrss'])} | {'met' if p['main_rss'] <= TARGET * mb else 'NOT met'} |"
        )
    lines += [
        "", f"Round trip bit-exact (names, dtypes, shapes, bytes): {'yes' if ok['bit_exact'] else 'NO'}; "
        f"{ok['compared']} tensors compared; values differ: {len(ok['value_diffs'])} {ok['value_diffs'][:3]}; "
        f"dtypes differ: {len(ok['dtype_diffs'])} {ok['dtype_diffs'][:1]}; "
        f"names on one side only: {len(ok['name_diffs'])} {ok['name_diffs'][:3]}.", "",
        "Notes: wall s includes interpreter start and imports; convert s is the library's own timing. RSS is sampled "
        "every 50 ms. 'main anon' is RSS minus file-backed/shared pages (mmap'd safetensors reads count in RSS). "
        "Tree RSS sums every process of the tree and over-counts copy-on-write pages shared with forked children; "
        "tree PSS splits shared pages between processes. ru_maxrss children is the parent's "
        "getrusage(RUSAGE_CHILDREN): the largest single process so far (cumulative over both phases).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--work-dir", help="parent of the temporary checkpoint directory (default: the system temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temporary checkpoint directory")
    p.add_argument("--results", help="results file (default: benchmarks/results/convert-<today>.md)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    for hidden in ("--phase", "--src", "--dst", "--result"):  # the child process's arguments
        p.add_argument(hidden, help=argparse.SUPPRESS)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.phase:
        return run_phase(args)

    import megatron.core
    import torch
    import transformers

    git = ["git", "-C", str(Path(__file__).resolve().parent)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--", "../megarl"], capture_output=True, text=True).stdout
    info = dict(
        date=datetime.date.today().isoformat(), cores=os.cpu_count(), ram_gib=psutil.virtual_memory().total / 2**30,
        commit=f"{commit or 'unknown'}{' + uncommitted changes in megarl/' if dirty.strip() else ''}",
        platform=platform.platform(), python=platform.python_version(), torch=torch.__version__,
        mcore=megatron.core.__version__, tf=transformers.__version__, dtype=args.dtype, tp=args.tp, pp=args.pp,
        shape=", ".join(f"{k}={v}" for k, v in SHAPE.items()),
    )
    if args.work_dir:
        Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="megarl-bench-", dir=args.work_dir))  # only this directory is deleted
    try:
        hf, mc, back = work / "hf", work / "mcore", work / "hf-roundtrip"
        logger.info("writing a random %s model to %s", args.dtype, hf)
        info["params"], info["model_bytes"] = make_model(hf, getattr(torch, args.dtype))
        phases = {}
        for name, phase, src, dst in (("HF -> Megatron", "to-mcore", hf, mc), ("Megatron -> HF", "to-hf", mc, back)):
            logger.info("%s in a fresh subprocess", name)
            res = work / f"{phase}.json"
            cmd = [sys.executable, __file__, "--phase", phase, "--src", str(src), "--dst", str(dst),
                   "--result", str(res), "--tp", str(args.tp), "--pp", str(args.pp)]
            phases[name] = measure(cmd) | json.loads(res.read_text())
        logger.info("comparing %s and %s tensor by tensor", hf, back)
        ok = verify(hf, back)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    text = report(info, phases, ok)
    print(text)
    out = Path(args.results or Path(__file__).parent / "results" / f"convert-{info['date']}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    logger.info("wrote %s", out)
    if not ok["bit_exact"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
