"""Benchmark HF <-> Megatron checkpoint conversion on a random ~1.1B Llama: time, peak RSS, round trip.

    .venv/bin/python benchmarks/convert.py [--dtype bfloat16|float32] [--work-dir DIR] [--results FILE]

Writes a random HF model (TinyLlama-1.1B shape) tensor by tensor, runs HF -> Megatron (tp=2, pp=2)
and Megatron -> HF each in a fresh subprocess of this script (``--phase``), samples that process's
RSS and its whole process tree's RSS and PSS every 50 ms (megatron-core's torch_dist save starts a
Manager and writer processes), checks the round trip bit-exactly tensor by tensor, prints a table
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
    """Random HF Llama written shard by shard (never the whole model in memory); returns (params, bytes)."""
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.checkpoint.hf_io import HFWriter
    from megarl.testing.tiny import make_tokenizer, tiny_config

    config = tiny_config("llama", **SHAPE)
    with torch.device("meta"):  # names and shapes only
        shapes = {n: p.shape for n, p in AutoModelForCausalLM.from_config(config).named_parameters()}
    out.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    writer = HFWriter(out, max_shard_bytes=1024**3)
    n = 0
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen, dtype=dtype)
        t = 1.0 + 0.1 * t if "norm" in name else t * (0.5 if "embed" in name or "lm_head" in name else shape[-1] ** -0.5)
        writer.add(name, t)
        n += t.numel()
    writer.close()
    config.torch_dtype = dtype
    config.save_pretrained(str(out))
    make_tokenizer(out, vocab_size=300)
    return n, writer.total_bytes


def run_phase(args: argparse.Namespace) -> None:
    """Child: one conversion direction; writes its summary as JSON."""
    from megarl.checkpoint.convert import convert_hf_to_megatron, convert_megatron_to_hf

    if args.phase == "to-mcore":
        s = convert_hf_to_megatron(args.src, args.dst, tp=args.tp, pp=args.pp)
    else:
        s = convert_megatron_to_hf(args.src, args.dst)
    logger.info("%s", s.line())
    Path(args.result).write_text(json.dumps({"tensors": s.tensors, "bytes": s.bytes, "seconds": s.seconds}))


def measure(cmd: list[str], interval: float = 0.05) -> dict:
    """Run ``cmd``; sample RSS of the process, RSS and PSS summed over its tree, and anon RSS of the process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd)
    root = psutil.Process(proc.pid)
    peak = dict(main_rss=0, main_anon=0, tree_rss=0, tree_pss=0, max_procs=1)
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
                peak["main_anon"] = max(peak["main_anon"], m.rss - m.shared)
        peak["tree_rss"], peak["tree_pss"] = max(peak["tree_rss"], rss), max(peak["tree_pss"], pss)
        peak["max_procs"] = max(peak["max_procs"], len(procs))
        time.sleep(interval)
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
    peak["wall_s"] = time.perf_counter() - start
    peak["ru_maxrss_children"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    return peak


def verify(a: Path, b: Path) -> tuple[bool, int, str]:
    """Compare every tensor of two HF dirs one at a time; returns (equal, tensors compared, first difference)."""
    import torch
    from safetensors import safe_open

    from megarl.checkpoint.hf_io import HFReader

    ra, rb = HFReader(a), HFReader(b)
    if ra.names() != rb.names():
        return False, 0, f"name sets differ: {sorted(ra.names() ^ rb.names())[:5]}"
    for i, name in enumerate(sorted(ra.names())):
        with safe_open(str(ra.files[name]), "pt") as fa, safe_open(str(rb.files[name]), "pt") as fb:
            ta, tb = fa.get_tensor(name), fb.get_tensor(name)
        if ta.dtype != tb.dtype or ta.shape != tb.shape or not torch.equal(ta.view(torch.uint8), tb.view(torch.uint8)):
            return False, i, f"{name}: {ta.dtype}{tuple(ta.shape)} vs {tb.dtype}{tuple(tb.shape)} or values differ"
    return True, len(ra.names()), ""


def report(info: dict, phases: dict, ok: tuple) -> str:
    gb = lambda x: f"{x / 1e9:.2f} GB"  # noqa: E731
    mb = info["model_bytes"]
    lines = [
        f"# Conversion benchmark, {info['date']}", "",
        f"- Machine: {info['cores']} CPU cores, {info['ram_gib']:.0f} GiB RAM, no GPU; {info['platform']}",
        f"- Python {info['python']}, torch {info['torch']}, megatron-core {info['mcore']}, transformers {info['transformers']}",
        f"- Model: random Llama {info['shape']}, {info['dtype']}: {info['params']:,} params, {info['model_bytes']:,} bytes ({gb(mb)})",
        f"- Layout: tp={info['tp']}, pp={info['pp']}; target: peak RSS <= {TARGET}x model bytes ({gb(TARGET * mb)})",
        "- Timings are noisy: another engineer ran tests on this 2-core machine at the same time.", "",
        "| direction | wall s | convert s | peak RSS main | main anon | tree RSS | tree PSS | procs | ru_maxrss children | main / model | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in phases.items():
        r = p["main_rss"] / mb
        lines.append(
            f"| {name} | {p['wall_s']:.1f} | {p['seconds']:.1f} | {gb(p['main_rss'])} | {gb(p['main_anon'])} | "
            f"{gb(p['tree_rss'])} | {gb(p['tree_pss'])} | {p['max_procs']} | {gb(p['ru_maxrss_children'])} | "
            f"{r:.2f}x (tree {p['tree_rss'] / mb:.2f}x) | {'met' if r <= TARGET else 'NOT met'} |"
        )
    lines += [
        "", f"Round trip bit-exact: {'yes' if ok[0] else 'NO'} ({ok[1]} tensors compared{'; ' + ok[2] if ok[2] else ''}).", "",
        "Notes: wall s includes interpreter start and imports; convert s is the library's own timing. RSS is sampled "
        "every 50 ms. 'main anon' is RSS minus file-backed/shared pages (mmap'd safetensors reads count in RSS). "
        "Tree RSS sums every process of the tree and over-counts copy-on-write pages shared with forked children; "
        "tree PSS splits shared pages between processes. ru_maxrss children is the parent's getrusage(RUSAGE_CHILDREN), "
        "the largest single process so far (cumulative over both phases).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--work-dir", help="where checkpoints go (default: a temporary directory, deleted afterwards)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    p.add_argument("--results", help="results file (default: benchmarks/results/convert-<today>.md)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--phase", choices=["to-mcore", "to-hf"], help=argparse.SUPPRESS)
    p.add_argument("--src", help=argparse.SUPPRESS)
    p.add_argument("--dst", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.phase:
        return run_phase(args)

    import megatron.core
    import torch
    import transformers

    date = datetime.date.today().isoformat()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="megarl-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        hf, mc, back = work / "hf", work / "mcore", work / "hf-roundtrip"
        logger.info("writing a random %s model to %s", args.dtype, hf)
        params, nbytes = make_model(hf, getattr(torch, args.dtype))
        phases = {}
        for name, phase, src, dst in (("HF -> Megatron", "to-mcore", hf, mc), ("Megatron -> HF", "to-hf", mc, back)):
            logger.info("%s in a fresh subprocess", name)
            res = work / f"{phase}.json"
            cmd = [sys.executable, __file__, "--phase", phase, "--src", str(src), "--dst", str(dst), "--result", str(res),
                   "--tp", str(args.tp), "--pp", str(args.pp)]
            phases[name] = measure(cmd) | json.loads(res.read_text())
        logger.info("comparing %s and %s tensor by tensor", hf, back)
        ok = verify(hf, back)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    info = dict(
        date=date, cores=os.cpu_count(), ram_gib=psutil.virtual_memory().total / 1024**3,
        platform=platform.platform(), python=platform.python_version(), torch=torch.__version__,
        mcore=megatron.core.__version__, transformers=transformers.__version__, dtype=args.dtype,
        shape=", ".join(f"{k}={v}" for k, v in SHAPE.items()), params=params, model_bytes=nbytes, tp=args.tp, pp=args.pp,
    )
    text = report(info, phases, ok)
    print(text)
    out = Path(args.results or Path(__file__).parent / "results" / f"convert-{date}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    logger.info("wrote %s", out)
    if not ok[0]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
