#!/usr/bin/env python
"""Export a megarl LoRA checkpoint's adapters in HF peft's format (adapter_config.json + adapter_model.safetensors).

    python tools/export_peft.py --mcore-dir CKPT --out-dir DIR [--base-model NAME_OR_PATH]

Load it onto the HF model the run started from: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE),
DIR). No base weight is written; tools/convert_megatron_to_hf.py writes the merged model instead (and is the way for
adapters on MoE experts, which peft cannot target in transformers 5).
"""

import argparse

from megarl.checkpoint import cpu_only
from megarl.cli.common import run_cli


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mcore-dir", required=True, help="a LoRA run's training checkpoint (e.g. .../step_000100/policy)")
    p.add_argument("--out-dir", required=True, help="new directory for the peft adapter")
    p.add_argument("--base-model", default=None,
                   help="HF model id or directory recorded as base_model_name_or_path (for AutoPeftModelForCausalLM)")
    args = p.parse_args()

    cpu_only.hide_cuda()  # before anything queries CUDA: the export runs in host memory
    from megarl.checkpoint.lora_export import export_peft

    print(export_peft(args.mcore_dir, args.out_dir, base_model=args.base_model).line())
    return 0


if __name__ == "__main__":
    run_cli(main)
