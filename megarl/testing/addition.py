"""The tiny single-digit addition task, built offline with megarl.toy's helpers: a character tokenizer, a random
Qwen2-shaped model (or, with ``num_experts``, a Qwen3-MoE-shaped one) and ``a+b=`` prompt datasets with their
answers (``a + b <= 9``). Used by ``make demo`` (examples/grpo_addition_tiny), the MoE variant
(examples/grpo_addition_moe), the end-to-end trainer tests and the CPU GRPO benchmark; ``make_reward_model``: a
random sequence classifier over the task's tokenizer (the reward-model tests).

A random policy answers correctly a few percent of the time; learning to emit one digit and stop,
then the right digit, is the curve GRPO has to climb.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megarl.toy import END, PAD, char_tokenizer, tiny_model, write_jsonl

logger = logging.getLogger(__name__)
SPECIALS = [PAD, END]
CHARS = list("0123456789+= ")


def make_tokenizer(out_dir: str | Path | None = None):
    """Character-level tokenizer (:func:`megarl.toy.char_tokenizer`): pad 0, end 1, then the characters."""
    return char_tokenizer(CHARS, out_dir)


def make_model(out_dir: str | Path, *, hidden_size: int = 64, num_layers: int = 2, seed: int = 0,
               intermediate_size: int | None = None, max_position_embeddings: int = 64, num_experts: int = 0,
               top_k: int = 2, tokenizer: Callable[[str | Path | None], Any] | None = None,
               init_std: float = 0.02) -> Path:
    """A random Qwen2-shaped causal LM over the addition vocabulary, with the tokenizer beside it
    (:func:`megarl.toy.tiny_model`; ``tokenizer``: another task's character tokenizer maker, whose vocabulary the
    model then has). ``max_position_embeddings`` must cover prompt + response (the benchmark's 64-token responses
    need 128). ``num_experts > 0``: a Qwen3-MoE-shaped model instead, every layer ``top_k`` of ``num_experts``
    experts of width ``intermediate_size`` (default: the hidden size)."""
    return tiny_model(out_dir, (tokenizer or make_tokenizer)(None), hidden_size=hidden_size, num_layers=num_layers,
                      max_position_embeddings=max_position_embeddings, seed=seed,
                      intermediate_size=intermediate_size, num_experts=num_experts, top_k=top_k, init_std=init_std)


def make_dataset(path: str | Path, n: int, seed: int) -> Path:
    """``n`` rows ``{"prompt": "a+b=", "answer": "a+b"}`` with ``a + b <= 9`` (jsonl)."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10) for b in range(10) if a + b <= 9]
    rows = [rng.choice(pairs) for _ in range(n)]
    return write_jsonl(path, ({"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in rows))


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


def make_reward_model(out: str | Path, seed: int = 3,
                      tokenizer: Callable[[str | Path | None], Any] | None = None) -> Path:
    """A random Qwen2ForSequenceClassification (one label) over the addition task's tokenizer (``tokenizer``:
    another task's character tokenizer maker, e.g. :func:`megarl.testing.lookup.make_tokenizer`, whose vocabulary
    the model then has and whose files are saved beside it)."""
    import torch
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    from megarl.testing.tiny import randomize_

    make = tokenizer or make_tokenizer
    config = Qwen2Config(
        vocab_size=len(make(None)), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, num_labels=1, use_sliding_window=False,
        architectures=["Qwen2ForSequenceClassification"],
    )
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    randomize_(model, seed)  # norms, biases and the score head random too
    model.save_pretrained(str(out))
    make(out)
    return out


def make_offline_datasets(out_dir: str | Path, n: int = 256, seed: int = 0) -> Path:
    """The task as TRL-format offline data under ``out_dir``: ``sft.jsonl`` (``prompt``, ``completion``: the sum),
    ``pairs.jsonl`` and held-out ``pairs_val.jsonl`` (``prompt``, ``chosen``: the sum, ``rejected``: another digit)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sums = [(a, b) for a in range(10) for b in range(10) if a + b <= 9]

    def pairs(k: int, s: int):
        rng = random.Random(s)
        for a, b in (rng.choice(sums) for _ in range(k)):
            wrong = rng.choice([d for d in range(10) if d != a + b])
            yield {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(wrong)}

    rng = random.Random(seed)
    write_jsonl(out_dir / "sft.jsonl", ({"prompt": f"{a}+{b}=", "completion": str(a + b)}
                                        for a, b in (rng.choice(sums) for _ in range(n))))
    write_jsonl(out_dir / "pairs.jsonl", pairs(n, seed + 1))
    write_jsonl(out_dir / "pairs_val.jsonl", pairs(64, seed + 2))
    return out_dir
