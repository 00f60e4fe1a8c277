#!/usr/bin/env python
"""Convert a megarl Megatron checkpoint back into a HuggingFace model directory.

    python tools/convert_megatron_to_hf.py --mcore-dir DIR --out-dir DIR [--max-shard-size 2GB] [--base-dir DIR]

A LoRA run's checkpoint (adapters only) is written merged onto the base checkpoint the run started from (recorded in
it; --base-dir where that has moved). tools/export_peft.py writes the adapters alone, for peft.
"""

import argparse

from megarl.checkpoint import cpu_only
from megarl.cli.common import run_cli
from megarl.errors import ConfigError

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def parse_size(text: str) -> int:
    t = text.strip().upper()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if t.endswith(unit):
            try:
                return int(float(t[: -len(unit)]) * _UNITS[unit])
            except ValueError:
                break
    raise ConfigError(f"--max-shard-size {text!r} is not a size; write e.g. 2GB, 500MB or 1GiB.")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mcore-dir", required=True, help="megarl Megatron checkpoint directory")
    p.add_argument("--out-dir", required=True, help="new directory for the HF model")
    p.add_argument("--max-shard-size", default="2GB", help="largest safetensors file (default 2GB)")
    p.add_argument("--base-dir", default=None,
                   help="a LoRA checkpoint's base checkpoint, where it is now (default: the path recorded in it)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = p.parse_args()

    cpu_only.hide_cuda()  # before anything queries CUDA: conversion runs in host memory, not on GPU 0
    from megarl.checkpoint.convert import convert_megatron_to_hf

    summary = convert_megatron_to_hf(
        args.mcore_dir, args.out_dir, max_shard_bytes=parse_size(args.max_shard_size), progress=not args.no_progress,
        base_dir=args.base_dir,
    )
    print(summary.line())
    return 0


if __name__ == "__main__":
    run_cli(main)
