"""Benchmark multi-turn rollouts: the same conversations with and without reusing each conversation's earlier turns.

    .venv/bin/python benchmarks/multiturn.py [--repeats 3] [--conversations 64] [--turns 4] [--turn-tokens 32]
        [--obs-words 24] [--env-ms 20] [--results FILE]

A random Llama (hidden 512, 6 layers, 4 heads of 128, vocabulary 300: ~19M parameters) with a ChatML tokenizer,
``--conversations`` conversations (16 prompts x n) of ``--turns`` model turns of ``--turn-tokens`` tokens each
(the random model does not stop early), a scripted environment answering every turn with a user message of
``--obs-words`` words after sleeping ``--env-ms`` (a tool's latency; 32 calls in flight). Each variant runs
megarl's loop (``megarl.multiturn.rollout.run_conversations``), one engine call per turn:

- ``vllm-prefix-cache``: vLLM (CPU build, eager), prefix caching on (megarl's setting): a turn prefills only the
  new observation and decodes;
- ``vllm-from-scratch``: the same with prefix caching off: every turn prefills the whole conversation again;
- ``embedded-kept``: megarl's embedded engine keeping each finished row's KV between calls
  (``prefix_cache_bytes``, 1 GiB; what ``rollout.multi_turn`` turns on): a turn prefills only the new tokens;
- ``embedded-from-scratch``: the embedded engine keeping nothing (prefills the whole conversation each turn).

Reported per variant (medians over ``--repeats`` rounds after a warm-up round): wall seconds, generated tokens per
second of the whole rollout, the prompt tokens the engine was handed (what a from-scratch engine prefills) and the
share of them it did not compute again (the engine's own count: vLLM's ``num_cached_tokens``, the embedded engine's
kept prefixes), and the share of the rollout spent waiting on the environment. Writes a Markdown table to
benchmarks/results/multiturn-<date>.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from megarl.testing.dist import run_world

VARIANTS = ("vllm-prefix-cache", "vllm-from-scratch", "embedded-kept", "embedded-from-scratch")
PROMPTS = 16


class Scripted:
    """Replies with a fixed sentence of ``words`` words after ``delay_s``; never ends the episode early."""

    def __init__(self, words: int, delay_s: float) -> None:
        self.words, self.delay_s, self.k = words, delay_s, 0

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        from megarl.multiturn import Step

        time.sleep(self.delay_s)
        self.k += 1
        return Step([{"role": "user", "content": " ".join(["answer"] * self.words) + f" {self.k}"}])


def _build(root: Path) -> Path:
    from megarl.testing.tiny import CHATML_SPECIAL_TOKENS, CHATML_TOOLS_TEMPLATE, make_tiny_model, make_tokenizer

    model = make_tiny_model(root / "model", "llama", hidden_size=512, intermediate_size=1024, num_layers=6,
                            num_heads=4, num_kv_heads=4, vocab_size=300, max_positions=2048, with_tokenizer=False)
    make_tokenizer(model, special_tokens=CHATML_SPECIAL_TOKENS, chat_template=CHATML_TOOLS_TEMPLATE,
                   eos_token="<|im_end|>")
    return model


def _variant(rank, world_size, model_dir, variant, args, rounds):
    """One engine in a world of one, several rounds of the same rollout; per round: seconds, tokens, env share."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from megarl.data.tokenizer import load_tokenizer
    from megarl.multiturn import ChatRenderer, MultiTurnConfig
    from megarl.multiturn.rollout import run_conversations
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.rollout.base import SamplingParams

    init_distributed(ParallelLayout())
    tok = load_tokenizer(model_dir)
    weights = load_file(f"{model_dir}/model.safetensors")
    if variant.startswith("embedded"):
        from megarl.rollout.embedded import EmbeddedEngine

        engine = EmbeddedEngine(AutoConfig.from_pretrained(model_dir), pad_token_id=tok.pad_token_id,
                                max_batch_size=args.conversations,
                                prefix_cache_bytes=(1 << 30) if variant == "embedded-kept" else 0)
    else:
        from megarl.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(model_dir, tp=1, dtype=torch.float32, seed=0, max_model_len=2048, enforce_eager=True,
                            kv_cache_bytes=1 << 30, prefix_caching=variant == "vllm-prefix-cache")
    handed = [0, 0]  # prompt tokens handed to the engine, of which it did not compute again

    def generate(prompts, params):
        handed[0] += sum(len(p) for p in prompts)
        out = engine.generate(prompts, params)
        handed[1] += int(out.cached_tokens.sum()) if out.cached_tokens is not None else 0
        return list(zip(out.token_lists(), out.log_prob_lists(), strict=True))

    config = MultiTurnConfig(max_turns=args.turns, max_turn_tokens=args.turn_tokens, max_total_tokens=100_000,
                             env_workers=32)
    rows = [{"prompt": f"Question {i}: what is the answer?"} for i in range(PROMPTS)]
    params = SamplingParams(temperature=1.0, max_new_tokens=1, seed=7)
    out = []
    for _ in range(rounds):
        engine.update_weights(weights.items())  # each round as a training step's: fresh weights, nothing kept
        engine.finish_weight_update()
        handed[:] = [0, 0]
        start = time.perf_counter()
        result = run_conversations(rows, args.conversations // PROMPTS, lambda: Scripted(args.obs_words,
                                                                                        args.env_ms / 1000),
                                   ChatRenderer(tok), generate, params, config)
        seconds = time.perf_counter() - start
        tokens = sum(sum(t.kind == "model" and len(t.ids) or 0 for t in c.trajectory.segments)
                     for c in result.conversations)
        out.append({"s": seconds, "tokens": tokens, "handed": handed[0], "reused": handed[1] / handed[0],
                    "env_share": result.metrics["multiturn/env_wait_share"]})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--obs-words", type=int, default=24)
    parser.add_argument("--env-ms", type=float, default=20.0)
    parser.add_argument("--results", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with tempfile.TemporaryDirectory(prefix="mrl_multiturn_") as tmp:
        model = _build(Path(tmp))
        runs = {v: run_world(_variant, 1, str(model), v, args, args.repeats + 1, timeout_s=1800)[0][1:]
                for v in VARIANTS}  # the first round of each warms up
    lines = [f"# Multi-turn rollouts: reusing earlier turns ({datetime.date.today()})", "",
             f"`benchmarks/multiturn.py --repeats {args.repeats} --conversations {args.conversations} --turns "
             f"{args.turns} --turn-tokens {args.turn_tokens} --obs-words {args.obs_words} --env-ms {args.env_ms:g}`; "
             f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}; "
             "random Llama, hidden 512, 6 layers, vocabulary 300; fp32; medians of the rounds after a warm-up.", "",
             "| variant | wall s | generated tokens | tokens/s | prompt tokens handed to the engine | of them reused "
             "| env wait share |", "|---|---|---|---|---|---|---|"]
    for v, rs in runs.items():
        s = statistics.median(r["s"] for r in rs)
        tokens = rs[0]["tokens"]
        lines.append(f"| {v} | {s:.2f} | {tokens} | {tokens / s:.0f} | {rs[0]['handed']} | {rs[0]['reused']:.2f} | "
                     f"{statistics.median(r['env_share'] for r in rs):.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    path = args.results or Path(__file__).parent / "results" / f"multiturn-{datetime.date.today()}.md"
    path.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
