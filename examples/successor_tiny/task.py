"""Build the successor task of docs/tasks.md offline: "after 3 comes" -> "4" (the next digit, 9 -> 0).

    .venv/bin/python examples/successor_tiny/task.py            # writes outputs/successor_tiny/task
    megarl train examples/successor_tiny/config.yaml            # then train it

It writes the ten prompts (train.jsonl; val.jsonl the same ten, answered greedily), a character tokenizer over
exactly the characters the task uses and a random 1-layer model over it (model/); with --chat, the tokenizer
also has chat-role tokens and a chat template, for the multi-turn version (env.py, multiturn.yaml).
"""

from __future__ import annotations

import sys
from pathlib import Path

from megarl.toy import char_tokenizer, tiny_model, write_jsonl

CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|end|>"
                 "{% else %}<|user|>{{ m['content'] }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_task(out_dir: str | Path, chat: bool = False) -> Path:
    out_dir = Path(out_dir)
    rows = [{"prompt": f"after {d} comes", "target": str((d + 1) % 10)} for d in range(10)]
    write_jsonl(out_dir / "train.jsonl", rows)
    write_jsonl(out_dir / "val.jsonl", rows)
    chars = "".join(row["prompt"] + row["target"] for row in rows)  # every character a prompt or answer uses
    if chat:
        tokenizer = char_tokenizer(chars, specials=["<|user|>", "<|assistant|>"], chat_template=CHAT_TEMPLATE)
    else:
        tokenizer = char_tokenizer(chars)
    tiny_model(out_dir / "model", tokenizer, hidden_size=64, num_layers=1, max_position_embeddings=64)
    return out_dir


if __name__ == "__main__":
    chat = "--chat" in sys.argv[1:]
    make_task("outputs/successor_tiny/" + ("task_chat" if chat else "task"), chat=chat)
