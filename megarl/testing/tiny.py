"""Tiny HF models and tokenizers built offline (no hub): for tests, the demo and benchmarks.

Weights are random but not HF's default init: norms and biases get random values too, so a
conversion that swapped or dropped any tensor changes the logits.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Reinforcement learning from human feedback trains a policy with a reward model.",
    "Megatron splits the model with tensor and pipeline parallelism.",
    "1 + 1 = 2. 2 + 3 = 5. 12 * 3 = 36. The answer is 42.",
    "def add(a, b):\n    return a + b\n",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
# ChatML with tools in the style of Qwen2.5 / Hermes (written for tests: tool schemas in a system turn, calls as
# <tool_call> JSON in the assistant's text, each tool result a user turn wrapped in <tool_response>)
CHATML_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call functions. Their signatures:\n<tools>\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    "Call one with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(out_dir: str | Path | None = None, vocab_size: int = 300, *,
                   special_tokens: list[str] | None = None, chat_template: str = CHAT_TEMPLATE,
                   eos_token: str = "<|end|>"):
    """A byte-level BPE tokenizer with a chat template; saved to ``out_dir`` when given. ``special_tokens`` (the
    first is the pad token), ``chat_template`` and ``eos_token`` replace the defaults (e.g. ChatML's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens or SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=(special_tokens or SPECIAL_TOKENS)[0], eos_token=eos_token,
        chat_template=chat_template)
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


def tiny_config(
    family: str = "llama",
    *,
    vocab_size: int = 300,
    hidden_size: int = 64,
    intermediate_size: int = 96,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    tied: bool = False,
    rope_scaling: bool = False,
    scalar_head: bool = False,
    max_positions: int | None = None,
    num_experts: int = 4,
    top_k: int = 2,
    moe_intermediate_size: int = 32,
    norm_topk_prob: bool = True,
):
    """An HF config of the given family ("llama", "qwen2", "qwen3", "qwen3_moe"); ``scalar_head``: a
    ``*ForSequenceClassification`` with one label (reward model / critic). ``num_experts``, ``top_k``,
    ``moe_intermediate_size`` and ``norm_topk_prob`` shape the MoE layers of "qwen3_moe"."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        # llama3 rope scaling in megatron-core assumes an original context of 8192
        max_position_embeddings=max_positions or (16384 if rope_scaling else 256),
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    if family == "llama":
        rope = {"rope_type": "default", "rope_theta": 50000.0}
        if rope_scaling:
            rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        cls, name = LlamaConfig, "Llama"
    elif family == "qwen2":
        cls, name, rope = Qwen2Config, "Qwen2", {"rope_type": "default", "rope_theta": 1e6}
    elif family == "qwen3":
        cls, name, rope = Qwen3Config, "Qwen3", {"rope_type": "default", "rope_theta": 1e6}
    elif family == "qwen3_moe":
        cls, name, rope = Qwen3MoeConfig, "Qwen3Moe", {"rope_type": "default", "rope_theta": 1e6}
    else:
        raise ValueError(f"unknown family {family!r}; choose llama, qwen2, qwen3 or qwen3_moe")
    arch = f"{name}ForSequenceClassification" if scalar_head else f"{name}ForCausalLM"
    extra = {"num_labels": 1} if scalar_head else {}
    if family == "qwen3_moe":
        extra.update(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_intermediate_size,
                     norm_topk_prob=norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])
    return cls(**common, rope_parameters=rope, architectures=[arch], **extra)


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights everywhere, including norms and biases."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def make_tiny_model(
    out_dir: str | Path,
    family: str = "llama",
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    with_tokenizer: bool = True,
    **config_kwargs,
) -> Path:
    """Write a random tiny HF causal LM (+ tokenizer) to ``out_dir`` and return the path."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    out_dir = Path(out_dir)
    config = tiny_config(family, **config_kwargs)
    torch.manual_seed(seed)
    auto = AutoModelForSequenceClassification if config_kwargs.get("scalar_head") else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    model.to(dtype).save_pretrained(str(out_dir))
    if with_tokenizer:
        make_tokenizer(out_dir, vocab_size=min(config.vocab_size, 300))
    return out_dir


def write_random_model(
    out_dir: str | Path, family: str = "llama", *, dtype: torch.dtype = torch.float32, seed: int = 0,
    shard_bytes: int = 2**30, **config_kwargs,
) -> tuple[int, int]:
    """A random HF model of any size written shard by shard (never whole in memory), with an index
    and a tiny tokenizer; returns (parameters, bytes). For benchmarks of 0.5B-1B models."""
    return write_random_hf(out_dir, tiny_config(family, **config_kwargs), dtype=dtype, seed=seed,
                           shard_bytes=shard_bytes)


def write_random_hf(out_dir: str | Path, config, *, dtype: torch.dtype = torch.float32, seed: int = 0,
                    shard_bytes: int = 2**30, tokenizer: bool = True, vocab_std: float = 0.5) -> tuple[int, int]:
    """:func:`write_random_model` for any transformers ``config`` (a published model's, layers cut: issue #47's
    rehearsals): tensors are drawn one at a time in checkpoint (hub) layout, MoE experts one by one, so the peak
    is one shard; returns (parameters, bytes). ``vocab_std``: the standard deviation of the embedding and output
    layer (after the final norm the logits' is about ``vocab_std * sqrt(hidden)``)."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    with torch.device("meta"):  # names and shapes only
        meta = dict(AutoModelForCausalLM.from_config(config).named_parameters())
    moe_ffn = getattr(config, "moe_intermediate_size", None)
    shapes = {n: t.shape for n, t in (per_expert(meta, moe_ffn) if moe_ffn else meta).items()}
    shards, size, itemsize = [[]], 0, torch.empty((), dtype=dtype).element_size()
    for name, shape in shapes.items():
        if shards[-1] and size + shape.numel() * itemsize > shard_bytes:
            shards, size = [*shards, []], 0
        shards[-1].append(name)
        size += shape.numel() * itemsize
    out_dir.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for names, fname in zip(shards, files, strict=True):
        tensors = {}
        for name in names:
            t = torch.randn(shapes[name], generator=gen, dtype=dtype)
            scale = vocab_std if "embed" in name or "lm_head" in name else shapes[name][-1] ** -0.5
            tensors[name] = 1.0 + 0.1 * t if "norm" in name else t * scale
        save_file(tensors, str(out_dir / fname), metadata={"format": "pt"})
        del tensors
    nbytes = sum(s.numel() for s in shapes.values()) * itemsize
    weight_map = {n: f for names, f in zip(shards, files, strict=True) for n in names}
    index = {"metadata": {"total_size": nbytes}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config.dtype = dtype
    config.save_pretrained(str(out_dir))
    if tokenizer:
        make_tokenizer(out_dir, vocab_size=300)
    return sum(s.numel() for s in shapes.values()), nbytes


_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def per_expert(tensors: Mapping[str, torch.Tensor], moe_intermediate_size: int) -> dict[str, torch.Tensor]:
    """Checkpoint-format (hub) tensors from transformers' in-memory ones: each fused expert tensor of an MoE layer
    (``mlp.experts.gate_up_proj [E, 2I, H]``, gate rows first, and ``mlp.experts.down_proj [E, H, I]``) becomes the
    per-expert ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`` views; everything else is passed through.
    Works on parameters and on their gradients alike."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        m = _FUSED_EXPERTS.match(name)
        if m is None:
            out[name] = t
            continue
        for e in range(t.shape[0]):
            if m["kind"] == "down_proj":
                out[f"{m['prefix']}.{e}.down_proj.weight"] = t[e]
            else:
                out[f"{m['prefix']}.{e}.gate_proj.weight"] = t[e, :moe_intermediate_size]
                out[f"{m['prefix']}.{e}.up_proj.weight"] = t[e, moe_intermediate_size:]
    return out
