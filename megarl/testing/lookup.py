"""The tiny hidden-digit task for multi-turn rollouts, built offline: a character tokenizer with a chat template,
a random Qwen2-shaped model (megarl.testing.addition's) and prompt files. The environment that goes with it is
``examples/multiturn_lookup_tiny/env.py`` (a user's file, given by path in the example's config).

A conversation: the user says ``?``; whatever the model answers, the environment replies with a digit it drew for
this conversation alone; the model's next turn earns 1 if its first digit is that one. The digit is nowhere before
the reply, so a model that ignores the observation earns at most 1/10 on average; learning to copy it is the curve
GRPO has to climb.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>"]
CHARS = list("0123456789? ")
# user turns run into the next <|assistant|>; the model's turns end with <|end|>, its eos
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|end|>"
                 "{% else %}<|user|>{{ m['content'] }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_tokenizer(out_dir: str | Path | None = None):
    """Character-level tokenizer with the chat template: pad 0, end 1, <|user|> 2, <|assistant|> 3, then the
    characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIALS + CHARS)}, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|end|>",
                                   additional_special_tokens=SPECIALS[2:], chat_template=CHAT_TEMPLATE)
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


def make_dataset(path: str | Path, n: int) -> Path:
    """``n`` rows ``{"prompt": "?", "id": i}`` (jsonl)."""
    path = Path(path)
    path.write_text("".join(json.dumps({"prompt": "?", "id": i}) + "\n" for i in range(n)))
    return path


def make_task(out_dir: str | Path, *, train_rows: int = 256, val_rows: int = 32, seed: int = 0, **model_kwargs) -> Path:
    """model/, train.jsonl and val.jsonl under ``out_dir`` (the model skipped when already there)."""
    from megarl.testing.addition import make_model

    out_dir = Path(out_dir)
    if not (out_dir / "model" / "config.json").is_file():
        make_model(out_dir / "model", seed=seed, tokenizer=make_tokenizer, **model_kwargs)
    make_dataset(out_dir / "train.jsonl", train_rows)
    make_dataset(out_dir / "val.jsonl", val_rows)
    return out_dir
