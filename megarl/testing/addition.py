"""The tiny single-digit addition task, built offline: a character tokenizer, a random Qwen2-shaped
model (or, with ``num_experts``, a Qwen3-MoE-shaped one) and ``a+b=`` prompt datasets with their answers
(``a + b <= 9``). Used by ``make demo`` (examples/grpo_addition_tiny), the MoE variant
(examples/grpo_addition_moe), the end-to-end trainer tests and the CPU GRPO benchmark.

A random policy answers correctly a few percent of the time; learning to emit one digit and stop,
then the right digit, is the curve GRPO has to climb.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)
SPECIALS = ["<|pad|>", "<|end|>"]
CHARS = list("0123456789+= ")


def make_tokenizer(out_dir: str | Path | None = None):
    """Character-level tokenizer: pad 0, end 1, then the characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|end|>")
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


def make_model(out_dir: str | Path, *, hidden_size: int = 64, num_layers: int = 2, seed: int = 0,
               intermediate_size: int | None = None, max_position_embeddings: int = 64, num_experts: int = 0,
               top_k: int = 2, tokenizer: Callable[[str | Path | None], Any] | None = None) -> Path:
    """A random Qwen2-shaped causal LM over the addition vocabulary, with the tokenizer beside it (``tokenizer``:
    another task's character tokenizer maker, whose vocabulary the model then has).
    ``max_position_embeddings`` must cover prompt + response (the benchmark's 64-token responses need 128).
    ``num_experts > 0``: a Qwen3-MoE-shaped model instead, every layer ``top_k`` of ``num_experts`` experts of
    width ``intermediate_size`` (default: the hidden size)."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3MoeConfig

    out_dir = Path(out_dir)
    tokenizer = tokenizer or make_tokenizer
    vocab = len(tokenizer(None))
    common = dict(
        vocab_size=vocab, hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=hidden_size // 4, max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=1,
        use_sliding_window=False,
    )
    if num_experts:
        config = Qwen3MoeConfig(**common, intermediate_size=2 * hidden_size, num_experts=num_experts,
                                num_experts_per_tok=top_k, moe_intermediate_size=intermediate_size or hidden_size,
                                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                architectures=["Qwen3MoeForCausalLM"])
    else:
        config = Qwen2Config(**common, intermediate_size=intermediate_size or 2 * hidden_size,
                             architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(out_dir))
    tokenizer(out_dir)
    return out_dir


def make_dataset(path: str | Path, n: int, seed: int) -> Path:
    """``n`` rows ``{"prompt": "a+b=", "answer": "a+b"}`` with ``a + b <= 9`` (jsonl)."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10) for b in range(10) if a + b <= 9]
    rows = [rng.choice(pairs) for _ in range(n)]
    path = Path(path)
    path.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a, b in rows))
    return path


def make_task(out_dir: str | Path, *, train_rows: int = 512, val_rows: int = 32, seed: int = 0, **model_kwargs) -> Path:
    """model/, train.jsonl and val.jsonl under ``out_dir`` (skipped when already there)."""
    out_dir = Path(out_dir)
    if not (out_dir / "model" / "config.json").is_file():
        make_model(out_dir / "model", seed=seed, **model_kwargs)
    make_dataset(out_dir / "train.jsonl", train_rows, seed)
    make_dataset(out_dir / "val.jsonl", val_rows, seed + 1)
    return out_dir


def run_example(config: str | Path, task_dir: str | Path, overrides: list[str], **model_kwargs) -> int:
    """What the addition examples' ``run.py`` do: build the task under ``task_dir``, train with ``config``
    and ``key.path=value`` overrides, log the reward curve."""
    from megarl.config.train import load_config
    from megarl.trainer.trainer import run

    make_task(task_dir, **model_kwargs)
    history = run(load_config(config, overrides))
    task_reward = [m.get("reward/function_mean", m["reward/mean"]) for m in history]  # distillation: weight 0
    logger.info("mean task reward per step: %s", " ".join(f"{r:.2f}" for r in task_reward))
    return 0
