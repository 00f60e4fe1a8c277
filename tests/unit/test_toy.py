"""megarl.toy: the character tokenizer's ids and round trip (through megarl's loader, beside a Qwen2 config.json),
the random model's shape and vocabulary (read back by transformers), the jsonl writer; bad arguments refused.
References: the ids written out by hand from the documented layout, transformers' own loading of the saved model."""

from __future__ import annotations

import json

import pytest
import torch

from megarl.toy import char_tokenizer, tiny_model, write_jsonl


def test_char_tokenizer_ids_are_pad_end_specials_then_characters_in_order():
    tok = char_tokenizer("ba ab", specials=["<|user|>"])
    assert tok.get_vocab() == {"<|pad|>": 0, "<|end|>": 1, "<|user|>": 2, "b": 3, "a": 4, " ": 5}
    assert (tok.pad_token_id, tok.eos_token_id, len(tok)) == (0, 1, 6)
    assert tok.encode("a b") == [4, 5, 3] and tok.encode("ax") == [4, 0]  # an unknown character: pad
    assert tok.decode([4, 5, 3, 1], skip_special_tokens=True) == "a b"


def test_saved_beside_a_qwen2_model_it_loads_as_itself(tmp_path):
    from megarl.data.tokenizer import load_tokenizer

    tok = char_tokenizer("after comes 0123456789", specials=["<|user|>", "<|assistant|>"],
                         chat_template="{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}<|assistant|>")
    model_dir = tiny_model(tmp_path / "model", tok, hidden_size=16, num_layers=1, seed=3)
    loaded = load_tokenizer(model_dir)
    text = "after 3 comes"
    assert loaded.encode(text) == tok.encode(text) and loaded.decode(loaded.encode(text)) == text  # spaces kept
    assert loaded.get_vocab() == tok.get_vocab()
    chat = loaded.apply_chat_template([{"role": "user", "content": text}], tokenize=False)
    assert chat == "<|user|>after 3 comes<|assistant|>"
    assert loaded.encode(chat)[0] == 2 and loaded.encode(chat)[-1] == 3  # the role markers are one token each


def test_tiny_model_is_a_qwen2_lm_over_the_tokenizers_vocabulary(tmp_path):
    from transformers import AutoModelForCausalLM

    tok = char_tokenizer("0123456789+=")
    out = tiny_model(tmp_path / "m", tok, hidden_size=32, num_layers=1, max_position_embeddings=24, seed=5)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["vocab_size"] == len(tok) == 14
    assert (config["hidden_size"], config["num_hidden_layers"], config["max_position_embeddings"]) == (32, 1, 24)
    assert (config["pad_token_id"], config["eos_token_id"]) == (0, 1) and config["tie_word_embeddings"]
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert model(torch.tensor([tok.encode("1+2=")])).logits.shape == (1, 4, 14)
    again = tiny_model(tmp_path / "again", tok, hidden_size=32, num_layers=1, max_position_embeddings=24, seed=5)
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()  # the seed fixes it
    moe = json.loads((tiny_model(tmp_path / "moe", tok, hidden_size=16, num_layers=1, num_experts=4) /
                      "config.json").read_text())
    assert moe["architectures"] == ["Qwen3MoeForCausalLM"] and moe["num_local_experts"] == 4


def test_write_jsonl_round_trips(tmp_path):
    rows = [{"prompt": "after 3 comes", "target": "4"}, {"prompt": "x", "extra": [1, 2]}]
    path = write_jsonl(tmp_path / "new" / "rows.jsonl", rows)
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows


@pytest.mark.parametrize(("call", "message"), [
    (lambda: char_tokenizer(["ab"]), "single characters"),
    (lambda: char_tokenizer(""), "at least one character"),
    (lambda: char_tokenizer("ab", specials=["<|end|>"]), "repeat"),
    (lambda: char_tokenizer("ab", specials=["a"]), "repeat"),
    (lambda: tiny_model("unused", char_tokenizer("ab"), hidden_size=20), "multiple of 8"),
])
def test_bad_arguments_are_refused_with_what_to_change(call, message):
    with pytest.raises(ValueError, match=message):
        call()
