"""vLLM's CPU build against transformers in float32 on the whole random Qwen2.5-0.5B, without megarl in the loop:
the log-prob of every token of a few random sequences (vLLM's ``prompt_logprobs``), each against transformers'
float32 and float64 forwards of the same HF files (issue #47 item 2; the bound of
tests/scale/test_qwen05b_training.py::test_grpo_vllm).

    .venv/bin/python benchmarks/vllm_logprob_gap.py [--results FILE]

The rounding control is transformers float32 against float64: what float32 arithmetic alone costs on this model.
Writes benchmarks/results/vllm_logprob_gap-<date>.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (8, 12, 10, 6, 16, 9)


def _write_model(path: Path) -> int:
    from transformers import AutoConfig

    from megarl.bench.rehearse import LOGIT_STD
    from megarl.planner.presets import PRESETS
    from megarl.testing.addition import make_tokenizer
    from megarl.testing.tiny import write_random_hf

    config = AutoConfig.for_model(**PRESETS["qwen2.5-0.5b"])
    params, _ = write_random_hf(path, config, tokenizer=False, vocab_std=LOGIT_STD / config.hidden_size ** 0.5)
    make_tokenizer().save_pretrained(str(path))
    return params


def _vllm(path: Path, seqs: list[list[int]]) -> list[list[float]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(path), dtype="float32", enforce_eager=True, max_model_len=64, seed=0,
              kv_cache_memory_bytes=64 << 20)
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs],
                        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0))
    return [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], s[1:], strict=True)]
            for s, o in zip(seqs, outs, strict=True)]


def _transformers(path: Path, seqs: list[list[int]], dtype) -> list[list[float]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            lp = torch.log_softmax(model(torch.tensor([s])).logits[0, :-1].double(), -1)
            out.append(lp.gather(-1, torch.tensor(s[1:])[:, None])[:, 0].tolist())
    return out


def _gap(a: list[list[float]], b: list[list[float]]) -> tuple[float, float, int]:
    d = [abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(d) / len(d), max(d), len(d)


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path,
                        default=ROOT / "benchmarks" / "results" / f"vllm_logprob_gap-{datetime.date.today()}.md")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(20, 151_000, (n,), generator=g).tolist() for n in LENGTHS]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        params = _write_model(path)
        vllm = _vllm(path, seqs)
        fp32 = _transformers(path, seqs, torch.float32)
        fp64 = _transformers(path, seqs, torch.float64)
    import transformers
    import vllm as vllm_module

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    rows = [("vLLM float32 vs transformers float32", _gap(vllm, fp32)),
            ("vLLM float32 vs transformers float64", _gap(vllm, fp64)),
            ("transformers float32 vs float64 (the rounding control)", _gap(fp32, fp64))]
    lines = [f"# vLLM CPU log-prob gap on the random Qwen2.5-0.5B ({datetime.date.today()})", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; commit {commit}; "
             f"vLLM {vllm_module.__version__}, transformers {transformers.__version__}, torch {torch.__version__}.",
             "", f"Model: Qwen2.5-0.5B's published config, random weights ({params:,} parameters, logits of std ~4), "
             f"{len(seqs)} random sequences of {', '.join(map(str, LENGTHS))} tokens; every token's log-prob after "
             "the first. vLLM: eager, float32, TP1, `prompt_logprobs`.", "",
             "| pair | mean abs gap | max abs gap | tokens |", "|---|---|---|---|"]
    lines += [f"| {name} | {mean:.3g} | {mx:.3g} | {n} |" for name, (mean, mx, n) in rows]
    args.results.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
