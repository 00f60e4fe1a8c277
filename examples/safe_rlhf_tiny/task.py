"""Build the Safe-RLHF toy task offline: the addition task's prompts and policy, and two classifiers whose scores are
known by construction.

    .venv/bin/python examples/safe_rlhf_tiny/task.py        # writes outputs/safe_rlhf_tiny/task

The policy answers ``a+b=`` with one character. The reward model prefers large digits (score ``d / 9`` for digit
``d``, 0 for anything else: the "helpful" direction); the cost model flags odd digits (score 1, else 0: the
"harmful" one). Unconstrained, the policy would learn to say 9 (reward 1, cost 1); under a cost limit it must move
its mass to large even digits (8: reward 0.89, cost 0). Both are Qwen2 sequence classifiers built by hand: every
layer's output projections are zero, so the last token's embedding reaches the final norm unchanged, and the
embedding and score head are set so that the score is the table's value for that token (to 1e-5;
:func:`make_classifier` checks it with transformers).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

from megarl.testing.addition import make_task as make_addition_task
from megarl.testing.addition import make_tokenizer


def reward_of(token: str) -> float:
    return int(token) / 9 if token.isdigit() else 0.0


def cost_of(token: str) -> float:
    return float(token.isdigit() and int(token) % 2 == 1)


def make_classifier(out: str | Path, score: dict[int, float]) -> Path:
    """A Qwen2ForSequenceClassification over the addition tokenizer scoring a sequence ``score[last token id]``
    (each value in [0, 1]; ids missing score 0)."""
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    tokenizer = make_tokenizer(None)
    hidden = 8
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=4, max_position_embeddings=64,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, num_labels=1,
                         use_sliding_window=False, architectures=["Qwen2ForSequenceClassification"])
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream carries the token's embedding through
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = torch.zeros(config.vocab_size, hidden)
        for token_id in range(config.vocab_size):  # a unit vector at angle acos(value) in the first two dimensions
            value = score.get(token_id, 0.0)
            embed[token_id, 0], embed[token_id, 1] = value, math.sqrt(1 - value * value)
        model.model.embed_tokens.weight.copy_(embed)
        model.model.norm.weight.fill_(1.0)  # the norm scales a unit vector by sqrt(hidden)
        model.score.weight.zero_()
        model.score.weight[0, 0] = 1 / math.sqrt(hidden)
    ids = torch.arange(2, config.vocab_size)[:, None]  # each non-special token alone
    got = model(input_ids=ids).logits[:, 0]
    want = torch.tensor([score.get(int(i), 0.0) for i in ids[:, 0]])
    assert torch.allclose(got, want, atol=1e-5), (got, want)
    model.save_pretrained(str(out))
    make_tokenizer(out)
    return Path(out)


def make_task(out_dir: str | Path) -> Path:
    """model/, train.jsonl, val.jsonl (the addition task's), reward_model/ and cost_model/ under ``out_dir``."""
    out_dir = make_addition_task(out_dir, train_rows=512, val_rows=32)
    vocab = make_tokenizer(None).get_vocab()
    make_classifier(out_dir / "reward_model", {i: reward_of(t) for t, i in vocab.items()})
    make_classifier(out_dir / "cost_model", {i: cost_of(t) for t, i in vocab.items()})
    return out_dir


if __name__ == "__main__":
    make_task(sys.argv[1] if len(sys.argv) > 1 else "outputs/safe_rlhf_tiny/task")
