"""What checksummed checkpoints cost: writing ``manifest.json`` at commit and verifying it before a resume.

A run checkpoint is a megatron-core dist checkpoint: a few large ``*.distcp`` shards per rank. This
script writes shards of random bytes shaped like that (``--gib`` in ``--shards`` files, fsynced, the way
a save leaves them), then times :func:`megarl.checkpoint.manifest.write_manifest` right after the write
(the commit: the files are in the page cache) and :func:`megarl.checkpoint.manifest.verify` from a cold
cache (a resume after a restart; the cache is dropped when this runs as root). It projects both to the
checkpoint of a 1B-parameter model trained in bf16 with the distributed optimizer: 2 bytes of weights
+ 12 of fp32 main parameters and Adam moments = 14 bytes per parameter (Llama-3.2-1B: 1.236 B
parameters, 17.3 GB), and compares with the time the same bytes took to write.

    .venv/bin/python benchmarks/checkpoint_verify.py [--gib 4] [--shards 8] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from megarl.checkpoint import manifest

PARAMS_1B = 1.236e9
BYTES_PER_PARAM = 14  # bf16 weights + fp32 main params + Adam exp_avg + exp_avg_sq


def _drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=4.0, help="total size of the synthetic checkpoint")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--out", default=f"benchmarks/results/checkpoint_verify-{datetime.date.today()}.md")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    size = int(args.gib * 2**30)
    per_shard, block = size // args.shards, os.urandom(64 << 20)
    try:
        (root / "policy" / "weights").mkdir(parents=True)
        start = time.perf_counter()
        for i in range(args.shards):
            with (root / "policy" / "weights" / f"__{i}_0.distcp").open("wb") as f:
                for _ in range(per_shard // len(block)):
                    f.write(block)
                f.flush()
                os.fsync(f.fileno())
        write_s = time.perf_counter() - start
        total = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
        start = time.perf_counter()
        manifest.write_manifest(root)
        commit_s = time.perf_counter() - start
        cold = _drop_caches()
        start = time.perf_counter()
        manifest.verify(root)
        verify_s = time.perf_counter() - start
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gb = total / 1e9
    one_b = PARAMS_1B * BYTES_PER_PARAM / 1e9
    commit = (os.environ.get("GIT_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                             capture_output=True, text=True).stdout.strip())
    rows = [("write the shards (fsync)", write_s), ("manifest at commit (warm cache)", commit_s),
            (f"verify before resume ({'cold' if cold else 'warm'} cache)", verify_s)]
    lines = [
        f"# checkpoint checksums - {datetime.date.today()}", "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; commit {commit}; "
        f"load average {os.getloadavg()[0]:.2f}. Method: benchmarks/checkpoint_verify.py: {args.shards} shards of "
        f"random bytes, {gb:.2f} GB in all, SHA-256 on a thread pool of min(8, cores).", "",
        "| phase | seconds | GB/s | projected for a 1B model (17.3 GB) |", "|---|---|---|---|",
        *[f"| {name} | {s:.2f} | {gb / s:.2f} | {one_b / (gb / s):.1f} s |" for name, s in rows], "",
        f"1B model: {PARAMS_1B / 1e9:.3f} B parameters x {BYTES_PER_PARAM} bytes (bf16 weights, fp32 main params, "
        f"Adam moments) = {one_b:.1f} GB. The manifest adds {commit_s / write_s:.2f}x the write time to a save and "
        f"verification {verify_s / write_s:.2f}x of it to a resume.",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
