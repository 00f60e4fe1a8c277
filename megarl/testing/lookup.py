"""The tiny hidden-digit task for multi-turn rollouts, built offline with megarl.toy's helpers: a character tokenizer
with a chat template, a random Qwen2-shaped model (megarl.testing.addition's) and prompt files. The environment that
goes with it is ``examples/multiturn_lookup_tiny/env.py`` (a user's file, given by path in the example's config).

A conversation: the user says ``?``; whatever the model answers, the environment replies with a digit it drew for
this conversation alone; the model's next turn earns 1 if its first digit is that one. The digit is nowhere before
the reply, so a model that ignores the observation earns at most 1/10 on average; learning to copy it is the curve
GRPO has to climb.
"""

from __future__ import annotations

from pathlib import Path

from megarl.toy import END, PAD, char_tokenizer, write_jsonl

SPECIALS = [PAD, END, "<|user|>", "<|assistant|>"]
CHARS = list("0123456789? ")
# user turns run into the next <|assistant|>; the model's turns end with <|end|>, its eos
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|end|>"
                 "{% else %}<|user|>{{ m['content'] }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_tokenizer(out_dir: str | Path | None = None):
    """Character-level tokenizer with the chat template (:func:`megarl.toy.char_tokenizer`): pad 0, end 1,
    <|user|> 2, <|assistant|> 3, then the characters."""
    return char_tokenizer(CHARS, out_dir, specials=SPECIALS[2:], chat_template=CHAT_TEMPLATE)


def make_dataset(path: str | Path, n: int) -> Path:
    """``n`` rows ``{"prompt": "?", "id": i}`` (jsonl)."""
    return write_jsonl(path, ({"prompt": "?", "id": i} for i in range(n)))


def make_task(out_dir: str | Path, *, train_rows: int = 256, val_rows: int = 32, seed: int = 0, **model_kwargs) -> Path:
    """model/, train.jsonl and val.jsonl under ``out_dir`` (the model skipped when already there)."""
    from megarl.testing.addition import make_model

    out_dir = Path(out_dir)
    if not (out_dir / "model" / "config.json").is_file():
        make_model(out_dir / "model", seed=seed, tokenizer=make_tokenizer, **model_kwargs)
    make_dataset(out_dir / "train.jsonl", train_rows)
    make_dataset(out_dir / "val.jsonl", val_rows)
    return out_dir
