"""Toy tasks built offline: a character tokenizer over exactly a task's characters, a random small causal LM over
that vocabulary, and jsonl prompt files.

A new task's first run should be a toy one: a model of a few layers over a vocabulary of a few dozen characters
learns a small task in a minute on a CPU, so a reward function, a dataset and a config are shown right (or wrong)
before a real model and GPUs are involved (docs/tasks.md). megarl's own tiny examples and trainer tests are built
from these helpers (megarl.testing.addition, megarl.testing.lookup).

- :func:`char_tokenizer`: pad 0, end 1 (the eos: it ends a response), optional special tokens (chat-role markers),
  then one token per character; characters it was not given encode as pad, which the prompt loader counts.
- :func:`tiny_model`: a random Qwen2-shaped causal LM (or a Qwen3-MoE-shaped one) over the tokenizer's vocabulary,
  saved as an HF directory with the tokenizer beside it: ``model.path`` of a run.
- :func:`write_jsonl`: a prompt file (one JSON object per row: the prompt column and whatever the reward reads).

Not for real models: a real task starts from a pretrained HF checkpoint and its own tokenizer. torch, tokenizers
and transformers are imported inside the functions, so ``import megarl.toy`` stays cheap.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD = "<|pad|>"  # id 0: padding, and what a character outside the vocabulary encodes as
END = "<|end|>"  # id 1: the eos token, which ends a response (rollout.stop_at_eos)
HEADS, KV_HEADS = 4, 2  # attention heads of tiny_model (head_dim = hidden_size / 4)


def char_tokenizer(chars: Iterable[str], out_dir: str | Path | None = None, *, specials: Iterable[str] = (),
                   chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: ``<|pad|>`` 0, ``<|end|>`` 1 (eos), then ``specials`` (each one token, e.g.
    ``<|user|>``), then each distinct character of ``chars`` in order of first appearance (a string of every
    prompt and answer will do). Saved to ``out_dir`` when given; megarl loads it as saved
    (:func:`megarl.data.tokenizer.load_tokenizer`; plain ``AutoTokenizer`` makes it a ``Qwen2Tokenizer`` beside a
    Qwen2 ``config.json``, which drops spaces). ``chat_template``: a Jinja chat template (multi-turn tasks need
    one; single-turn toy tasks encode prompts plainly, ``data.apply_chat_template: false``)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = list(specials)
    alphabet = list(dict.fromkeys(chars))
    bad = [c for c in alphabet if len(c) != 1]
    if bad:
        raise ValueError(f"char_tokenizer takes single characters, found {bad[:5]}; pass a string or its characters")
    clash = {PAD, END}.intersection(specials) or set(specials).intersection(alphabet)
    if len(set(specials)) != len(specials) or clash:
        raise ValueError(f"char_tokenizer: specials {specials} repeat, or repeat {PAD}, {END} or a character")
    if not alphabet:
        raise ValueError("char_tokenizer needs at least one character")
    vocab = {t: i for i, t in enumerate([PAD, END, *specials, *alphabet])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    extra = ({"additional_special_tokens": specials} if specials else {}) | (
        {"chat_template": chat_template} if chat_template is not None else {})  # none: no such keys saved
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=END, **extra)
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


def tiny_model(out_dir: str | Path, tokenizer: PreTrainedTokenizerFast, *, hidden_size: int = 64,
               num_layers: int = 2, max_position_embeddings: int = 64, seed: int = 0,
               intermediate_size: int | None = None, num_experts: int = 0, top_k: int = 2,
               init_std: float = 0.02) -> Path:
    """A random Qwen2-shaped causal LM over ``tokenizer``'s vocabulary, saved (float32, with the tokenizer) to
    ``out_dir``, which it returns: a run's ``model.path``. 4 attention heads (2 key-value groups) of
    ``hidden_size / 4``; tied embeddings; pad, bos and eos ids from the tokenizer. ``max_position_embeddings``
    must cover prompt + response tokens. ``num_experts > 0``: a Qwen3-MoE-shaped model instead, every layer
    ``top_k`` of ``num_experts`` experts of width ``intermediate_size`` (default: the hidden size)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3MoeConfig

    if hidden_size % (2 * HEADS) or hidden_size < 2 * HEADS:
        raise ValueError(f"tiny_model: hidden_size={hidden_size} must be a positive multiple of {2 * HEADS} "
                         f"({HEADS} heads of an even head_dim, for rotary embeddings)")
    if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
        raise ValueError("tiny_model needs a tokenizer with a pad and an eos token (megarl.toy.char_tokenizer has)")
    out_dir = Path(out_dir)
    common = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=hidden_size // HEADS,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id, use_sliding_window=False, initializer_range=init_std,
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
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def write_jsonl(path: str | Path, rows: Iterable[Mapping[str, Any]]) -> Path:
    """``rows`` as a jsonl file (one JSON object per line; parent directories made), which it returns: a run's
    ``data.train`` / ``data.val``. Each row holds the prompt (column ``prompt``, ``data.prompt_key``) and the columns
    the reward function reads."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(dict(row)) + "\n" for row in rows))
    return path
