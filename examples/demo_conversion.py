#!/usr/bin/env python
"""Demo (CPU): HF -> Megatron TP2xPP2 -> 4-process gloo forward -> HF, checked against transformers.

1. writes a tiny random Llama (GQA, vocab 300) with a tokenizer, as `save_pretrained` would;
2. converts it to a Megatron dist checkpoint laid out for TP2xPP2 (tools/convert_hf_to_megatron.py);
3. builds the megatron-core model at TP2xPP2 on 4 gloo processes, loads the checkpoint, runs the
   pipeline schedule and compares logits with `transformers` on the original directory;
4. converts back to HF (tools/convert_megatron_to_hf.py) and checks every tensor is bit-identical.

    python examples/demo_conversion.py --out-dir outputs/demo
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from megarl.cli.common import run_cli


def _forward_world(rank, world_size, ckpt, ids):
    from megarl.checkpoint import mcore_io
    from megarl.checkpoint.format import read_meta
    from megarl.models.forward import forward_logits
    from megarl.models.provider import BuildOptions, build_model
    from megarl.models.spec import spec_from_hf_config
    from megarl.parallel.init import destroy_distributed, init_distributed
    from megarl.parallel.layout import ParallelLayout

    layout = ParallelLayout(tp=2, pp=2)
    init_distributed(layout)
    spec = spec_from_hf_config(read_meta(ckpt).hf_config)
    chunks = build_model(spec, layout, BuildOptions(init_weights=False))
    mcore_io.load_model(chunks, ckpt)
    logits = forward_logits(chunks, torch.tensor(ids), spec.vocab_size, micro_batch_size=1)
    destroy_distributed()
    return None if logits is None else logits.tolist()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="outputs/demo")
    args = p.parse_args()

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megarl.checkpoint.convert import convert_hf_to_megatron, convert_megatron_to_hf
    from megarl.data.tokenizer import load_tokenizer
    from megarl.testing.dist import run_world
    from megarl.testing.tiny import make_tiny_model

    out = Path(args.out_dir)
    shutil.rmtree(out, ignore_errors=True)
    hf = make_tiny_model(out / "hf", "llama", num_layers=4, num_heads=4, num_kv_heads=2)
    print(convert_hf_to_megatron(hf, out / "megatron_tp2pp2", tp=2, pp=2, progress=True).line())

    tok = load_tokenizer(hf)
    ids = tok(["The quick brown fox", "Megatron splits the"], padding="max_length", max_length=8)["input_ids"]
    per_rank = run_world(_forward_world, 4, str(out / "megatron_tp2pp2"), ids)
    mcore_logits = torch.tensor(next(r for r in per_rank if r is not None))
    with torch.no_grad():
        hf_logits = AutoModelForCausalLM.from_pretrained(hf).eval()(torch.tensor(ids)).logits
    diff = (mcore_logits - hf_logits).abs().max().item()
    print(f"Megatron TP2xPP2 (4 gloo processes) vs transformers: max |logits diff| = {diff:.2e}")

    print(convert_megatron_to_hf(out / "megatron_tp2pp2", out / "hf_roundtrip", progress=True).line())
    a, b = load_file(hf / "model.safetensors"), load_file(out / "hf_roundtrip" / "model.safetensors")
    exact = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    print(f"round trip HF -> Megatron -> HF bit-exact: {exact} ({len(a)} tensors)")
    ok = exact and diff < 1e-4
    print("demo " + ("passed" if ok else "FAILED") + f"; outputs in {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    run_cli(main)
