#!/usr/bin/env python
"""Convert a HuggingFace model directory into a megarl Megatron (dist_checkpointing) checkpoint.

    python tools/convert_hf_to_megatron.py --hf-dir DIR --out-dir DIR --tp N --pp N [--vpp N] [--ep N]
        [--dtype bfloat16]
"""

import argparse

from megarl.checkpoint import cpu_only
from megarl.cli.common import run_cli


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", required=True, help="HF model directory (config.json + *.safetensors)")
    p.add_argument("--out-dir", required=True, help="new directory for the Megatron checkpoint")
    p.add_argument("--tp", type=int, default=1, help="training tensor-parallel size it is meant for")
    p.add_argument("--pp", type=int, default=1, help="training pipeline-parallel size it is meant for")
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size it is meant for (MoE models)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="cast weights (default: keep the checkpoint's dtype)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = p.parse_args()

    cpu_only.hide_cuda()  # before anything queries CUDA: conversion runs in host memory, not on GPU 0
    from megarl.checkpoint.convert import convert_hf_to_megatron

    summary = convert_hf_to_megatron(
        args.hf_dir, args.out_dir, tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, dtype=args.dtype,
        progress=not args.no_progress,
    )
    print(summary.line())
    return 0


if __name__ == "__main__":
    run_cli(main)
