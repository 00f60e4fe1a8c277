"""Where the offline parity's residual differences come from (issue #44): one SFT step's gradients of the 31.5 M
model, megarl's (the Megatron engine in fp32, TP1) and transformers' in fp32 (what TRL computes), each against
transformers in float64, the truth, tensor by tensor.

    .venv/bin/python benchmarks/offline_gradients.py [--work outputs/offline_gradients] [--results FILE]

If megarl's gradients are as close to the truth as transformers' fp32 ones, tensor by tensor, what
benchmarks/offline_parity.py finds between megarl and TRL after several steps beyond TRL-against-itself is two
independent fp32 implementations' rounding (each ~1e-6 from the truth in its own direction, where TRL against
itself shares its kernels), grown by the steps, not a difference of method. Writes
benchmarks/results/offline_gradients-<date>.md.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
from pathlib import Path

import torch


def gradients(work: Path) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.algos.config import AlgorithmConfig
    from megarl.algos.offline import SFTObjective
    from megarl.data.examples import ExampleKind, example_rows, load_examples
    from megarl.models import mapping
    from megarl.models.provider import global_named_parameters
    from megarl.models.spec import load_hf_config, spec_from_hf_config
    from megarl.testing.addition import make_model, make_offline_datasets
    from megarl.testing.dist import sgd_policy

    hf = work / "model30m"
    if not (hf / "config.json").exists():
        make_model(hf, hidden_size=512, num_layers=8, intermediate_size=2048, max_position_embeddings=128)
    make_offline_datasets(work / "data")
    tok = AutoTokenizer.from_pretrained(hf)
    examples = load_examples(work / "data" / "sft.jsonl", ExampleKind.SFT, tok, max_length=None)[:8]
    rows = example_rows(examples, ExampleKind.SFT, tok.pad_token_id or 0)
    ids, attn, resp = rows["input_ids"], rows["attention_mask"], rows["response_mask"]

    def hf_grads(dtype):
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=dtype)
        logits = model(ids, attention_mask=attn).logits
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(lp * resp[:, 1:].to(dtype)).sum() / resp.sum()
        loss.backward()
        return {n: p.grad.double() for n, p in model.named_parameters()}, loss.item()

    spec = spec_from_hf_config(load_hf_config(hf))

    def to_mcore(g):
        return {m.mcore: mapping.to_mcore(m, spec, [g[n] for n in m.hf], spec.padded_vocab_size(1))
                for m in mapping.tensor_maps(spec)}

    (g64, l64), (g32, l32) = hf_grads(torch.float64), hf_grads(torch.float32)
    truth, hf32 = to_mcore(g64), to_mcore(g32)
    policy = sgd_policy(hf, work / "mc", AlgorithmConfig(), max_tokens=100_000, max_size=64)
    result = policy.train(rows, SFTObjective())
    ours = {n: p.main_grad.double() for c in policy.engine.chunks for n, p in global_named_parameters(c)}
    per_tensor = {}
    for name, t in truth.items():
        norm = t.norm().item()
        per_tensor[name] = ((hf32[name] - t).norm().item() / norm, (ours[name][: t.shape[0]] - t).norm().item() / norm)
    total = sum(t.norm() ** 2 for t in truth.values()) ** 0.5
    whole = {"transformers fp32": (sum((hf32[n] - t).norm() ** 2 for n, t in truth.items()) ** 0.5 / total).item(),
             "megarl fp32": (sum((ours[n][: t.shape[0]] - t).norm() ** 2 for n, t in truth.items()) ** 0.5
                             / total).item(),
             "loss float64": l64, "loss transformers fp32": l32, "loss megarl": result.loss}
    return per_tensor, whole


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="outputs/offline_gradients")
    parser.add_argument("--results", default=None)
    args = parser.parse_args()
    per_tensor, whole = gradients(Path(args.work))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    day = datetime.date.today().isoformat()
    ratio = sorted(per_tensor.items(), key=lambda kv: -kv[1][1] / max(kv[1][0], 1e-30))
    lines = [f"# One SFT step's gradients against float64: megarl and transformers fp32, {day}", "",
             f"- megarl commit {commit}; {platform.processor() or platform.machine()}, torch {torch.__version__}",
             "- command: `.venv/bin/python benchmarks/offline_gradients.py`", "",
             "31.5 M Qwen2-shaped model (hidden 512, 8 layers), the first 8 rows of the addition task's SFT data, "
             "one SFT step (NLL over the completion tokens); relative Frobenius error of each gradient against "
             "transformers in float64.", "",
             "| | value |", "|---|---|"]
    lines += [f"| {k} | {v:.10g} |" if k.startswith("loss") else f"| whole model, {k} | {v:.2e} |"
              for k, v in whole.items()]
    lines += ["", "Tensors where megarl is furthest from the truth relative to transformers fp32 (first 10), and "
              "the largest errors of each:", "", "| tensor | transformers fp32 | megarl | megarl / transformers |",
              "|---|---|---|---|"]
    for name, (a, b) in ratio[:10]:
        lines.append(f"| {name} | {a:.2e} | {b:.2e} | {b / max(a, 1e-30):.2f} |")
    worst_hf = max(per_tensor.items(), key=lambda kv: kv[1][0])
    worst_ours = max(per_tensor.items(), key=lambda kv: kv[1][1])
    lines += ["", f"Largest: transformers fp32 {worst_hf[1][0]:.2e} ({worst_hf[0]}), megarl {worst_ours[1][1]:.2e} "
              f"({worst_ours[0]})."]
    out = Path(args.results or f"benchmarks/results/offline_gradients-{day}.md")
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
