"""megarl.data.prompts: jsonl/parquet loading, tokenization, filtering, error messages, the sampler.

Token ids are checked against an independent path (the chat template rendered to text, then encoded
without special tokens); sampler orders against ``torch.randperm`` seeded as documented.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from megarl.data.prompts import (
    DataError,
    PromptConfig,
    PromptSampler,
    load_prompts,
)
from megarl.errors import ConfigError
from megarl.testing.tiny import make_tokenizer

TEXT_ROWS = [
    {"prompt": "What is 1 + 1?", "answer": "2", "level": 1},
    {"prompt": "The quick brown fox jumps over the lazy dog. How many words?", "answer": "9", "level": 2},
    {"prompt": "12 * 3 = ?", "answer": "36", "level": 1},
]
CHAT_ROWS = [
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3 = ?"}], "answer": "5"},
    {"prompt": [{"role": "user", "content": "def add(a, b):"}], "answer": "return a + b"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def _reference_ids(tokenizer, prompt):
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _check_records(dataset, rows, tokenizer):
    assert len(dataset) == len(rows) and dataset.num_filtered == 0
    for i, (record, row) in enumerate(zip(dataset.records, rows, strict=True)):
        assert record.index == i
        assert record.prompt == row["prompt"]
        assert record.row == {k: v for k, v in row.items() if k != "prompt"}
        assert record.input_ids == _reference_ids(tokenizer, row["prompt"])


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_round_trip_text_and_chat(tmp_path, tokenizer, fmt):
    write = _write_jsonl if fmt == "jsonl" else _write_parquet
    text = load_prompts(str(write(tmp_path / f"text.{fmt}", TEXT_ROWS)), PromptConfig(), tokenizer)
    _check_records(text, TEXT_ROWS, tokenizer)
    assert text[0].text == "What is 1 + 1?"
    assert text.records[1].row == {"answer": "9", "level": 2}  # extra columns pass through, types kept
    # the template wraps a text prompt as one user message and appends the generation prompt
    assert tokenizer.decode(text[0].input_ids) == "<|user|>What is 1 + 1?<|end|><|assistant|>"
    chat = load_prompts(str(write(tmp_path / f"chat.{fmt}", CHAT_ROWS)), PromptConfig(), tokenizer)
    _check_records(chat, CHAT_ROWS, tokenizer)
    assert [r.text for r in chat.records] == ["2 + 3 = ?", "def add(a, b):"]  # the last user message
    assert chat.select([1, 0])[0].row == {"answer": "return a + b"}


def test_jsonl_mixes_text_and_chat(tmp_path, tokenizer):
    rows = [TEXT_ROWS[0], CHAT_ROWS[0]]
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")  # blank lines are skipped
    _check_records(load_prompts(str(path), PromptConfig(), tokenizer), rows, tokenizer)


def test_plain_encoding_without_template(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "p.jsonl", TEXT_ROWS)
    dataset = load_prompts(str(path), PromptConfig(apply_chat_template=False), tokenizer)
    assert [r.input_ids for r in dataset.records] == [tokenizer.encode(r["prompt"]) for r in TEXT_ROWS]
    no_template = make_tokenizer()
    no_template.chat_template = None
    dataset = load_prompts(str(path), PromptConfig(), no_template)
    assert dataset[2].input_ids == tokenizer.encode(TEXT_ROWS[2]["prompt"])
    chat = _write_jsonl(tmp_path / "c.jsonl", [TEXT_ROWS[0], CHAT_ROWS[0]])
    with pytest.raises(ConfigError, match=r"c\.jsonl:2: column 'prompt' holds chat messages, but apply_chat_template"):
        load_prompts(str(chat), PromptConfig(apply_chat_template=False), tokenizer)
    with pytest.raises(ConfigError, match="c.jsonl:2: .*the tokenizer has no chat template"):
        load_prompts(str(chat), PromptConfig(), no_template)


def test_custom_prompt_key(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "q.jsonl", [{"question": "1 + 1 =", "prompt": "not the prompt"}])
    dataset = load_prompts(str(path), PromptConfig(prompt_key="question"), tokenizer)
    assert dataset[0].text == "1 + 1 =" and dataset[0].row == {"prompt": "not the prompt"}


def test_filtering_is_counted(tmp_path, tokenizer, caplog):
    lengths = [len(_reference_ids(tokenizer, r["prompt"])) for r in TEXT_ROWS]
    limit = sorted(lengths)[1]  # keeps the two shortest (no ties among these prompts)
    assert len(set(lengths)) == 3
    path = _write_jsonl(tmp_path / "p.jsonl", TEXT_ROWS)
    with caplog.at_level(logging.WARNING, logger="megarl.data.prompts"):
        dataset = load_prompts(str(path), PromptConfig(max_prompt_length=limit), tokenizer)
    kept = [r["prompt"] for r, n in zip(TEXT_ROWS, lengths, strict=True) if n <= limit]
    assert [r.prompt for r in dataset.records] == kept and dataset.num_filtered == 1
    assert [r.index for r in dataset.records] == [0, 1]
    assert f"dropped 1 of 3 prompts longer than max_prompt_length={limit}" in caplog.text
    with pytest.raises(DataError, match=r"no prompts left: all 3 rows are longer than max_prompt_length=2"):
        load_prompts(str(path), PromptConfig(max_prompt_length=2), tokenizer)


@pytest.mark.parametrize(
    "bad_line, pattern",
    [
        ('{"question": "hi", "answer": 1}', r"bad\.jsonl:2: no prompt column 'prompt'; found columns \['answer', 'q"),
        ('{"prompt": 5}', r"bad\.jsonl:2: column 'prompt' must be a text string or a non-empty list .*found 5 \(int\)"),
        ('{"prompt": []}', r"bad\.jsonl:2: column 'prompt' must be .*found \[\] \(list\)"),
        ('{"prompt": ""}', r"bad\.jsonl:2: column 'prompt' is an empty string"),
        ('{"prompt": [{"role": "user"}]}', r"bad\.jsonl:2: column 'prompt' message 0 must be a dict with string"),
        ('{"prompt": "hi"', r"bad\.jsonl:2: invalid JSON .*expected one JSON object per line"),
        ('["hi"]', r"bad\.jsonl:2: expected a JSON object per line, found list"),
    ],
)
def test_malformed_jsonl_rows(tmp_path, tokenizer, bad_line, pattern):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(TEXT_ROWS[0]) + "\n" + bad_line + "\n")
    with pytest.raises(DataError, match=pattern):
        load_prompts(str(path), PromptConfig(), tokenizer)


def test_malformed_parquet_and_files(tmp_path, tokenizer):
    rows = [{"prompt": "fine", "answer": "1"}, {"prompt": None, "answer": "2"}]
    path = _write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(DataError, match=r"bad\.parquet row 1: column 'prompt' must be .*found None"):
        load_prompts(str(path), PromptConfig(), tokenizer)
    with pytest.raises(ConfigError, match=r"unknown extension '\.csv'; expected one of \['\.jsonl', '\.parquet'\]"):
        load_prompts(str(tmp_path / "data.csv"), PromptConfig(), tokenizer)
    with pytest.raises(ConfigError, match="missing.jsonl' does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"), PromptConfig(), tokenizer)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="holds no rows"):
        load_prompts(str(tmp_path / "empty.jsonl"), PromptConfig(), tokenizer)
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="junk.parquet: not a readable parquet file"):
        load_prompts(str(tmp_path / "junk.parquet"), PromptConfig(), tokenizer)
    with pytest.raises(ConfigError, match="max_prompt_length must be >= 1"):
        PromptConfig(max_prompt_length=0)


# ---- sampler ------------------------------------------------------------------------------------


def _randperm(n, seed):
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def test_sampler_epochs_are_seeded_permutations():
    n, bs, seed = 10, 3, 7
    sampler = PromptSampler(n, seed=seed)
    assert sampler.batches_per_epoch(bs) == 3
    batches = [sampler.next_batch(bs) for _ in range(9)]  # three epochs; the last index of each is dropped
    for epoch in range(3):
        expected = _randperm(n, seed + epoch)
        got = [i for b in batches[3 * epoch : 3 * epoch + 3] for i in b]
        assert got == expected[:9]
        assert sorted(sampler.epoch_order(epoch).tolist()) == list(range(n))
    assert _randperm(n, seed) != _randperm(n, seed + 1)
    assert all(len(set(b)) == len(b) == bs for b in batches)
    assert PromptSampler(n, seed=seed).next_batch(bs) == batches[0]  # deterministic
    assert PromptSampler(n, seed=seed + 1).next_batch(bs) != batches[0]
    ordered = PromptSampler(4, shuffle=False)
    assert [ordered.next_batch(3) for _ in range(2)] == [[0, 1, 2], [0, 1, 2]]


def test_sampler_resume_equals_uninterrupted():
    sizes = [3, 3, 4, 2, 3, 5, 1, 3, 3, 4, 4, 2]  # changing sizes cross epoch ends at odd offsets
    uninterrupted = PromptSampler(11, seed=3)
    reference = [uninterrupted.next_batch(s) for s in sizes]
    for k in range(len(sizes)):
        first = PromptSampler(11, seed=3)
        head = [first.next_batch(s) for s in sizes[:k]]
        state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it
        resumed = PromptSampler(11, seed=3)
        resumed.load_state_dict(state)
        assert head + [resumed.next_batch(s) for s in sizes[k:]] == reference, f"resume after {k} batches"


def test_sampler_errors():
    with pytest.raises(ConfigError, match="at least one prompt"):
        PromptSampler(0)
    sampler = PromptSampler(5, seed=1)
    with pytest.raises(ConfigError, match=r"batch size must lie in \[1, 5\].*found 6"):
        sampler.next_batch(6)
    state = sampler.state_dict()
    with pytest.raises(ConfigError, match="saved with seed=1, this sampler has seed=2"):
        PromptSampler(5, seed=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="saved with num_samples=5, this sampler has num_samples=6"):
        PromptSampler(6, seed=1).load_state_dict(state)
    with pytest.raises(ConfigError, match="expected"):
        PromptSampler(5, seed=1).load_state_dict({"epoch": 0})
    with pytest.raises(ConfigError, match="outside a dataset of 5 prompts"):
        PromptSampler(5, seed=1).load_state_dict(state | {"offset": 9})


# ---- row adapters (extension point) ---------------------------------------------------------------


def test_row_adapter_contract(tmp_path):
    from megarl.data.prompts import RowAdapter, load_row_adapter

    (tmp_path / "adapt.py").write_text(
        "def gsm8k(row):\n"
        "    return {'prompt': [{'role': 'user', 'content': row['question']}], 'answer': row['answer'], 'src': 'g'}\n"
        "def broken(row):\n    return row['missing']\n"
        "def not_a_dict(row):\n    return [row]\n"
    )
    data = tmp_path / "raw.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?", "answer": "#### 4"}\n')
    tok = make_tokenizer()
    adapter = load_row_adapter(f"{tmp_path / 'adapt.py'}:gsm8k")
    assert isinstance(adapter, RowAdapter)
    ds = load_prompts(str(data), PromptConfig(), tok, adapter)
    assert [r.text for r in ds.records] == ["1+1?", "2+2?"]
    assert ds.records[1].row == {"answer": "#### 4", "src": "g"}
    expected = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True,
                                       tokenize=False)
    assert ds.records[1].input_ids == tok.encode(expected)
    with pytest.raises(DataError, match=r"raw.jsonl:1: the row adapter raised KeyError"):
        load_prompts(str(data), PromptConfig(), tok, load_row_adapter(f"{tmp_path / 'adapt.py'}:broken"))
    with pytest.raises(DataError, match="returned a list, expected a dict"):
        load_prompts(str(data), PromptConfig(), tok, load_row_adapter(f"{tmp_path / 'adapt.py'}:not_a_dict"))
    with pytest.raises(ConfigError, match="cannot be called as"):
        (tmp_path / "two.py").write_text("def f(a, b):\n    return a\n")
        load_row_adapter(f"{tmp_path / 'two.py'}:f")


# ---- prompts holding pad/unknown token ids ---------------------------------------------------------

WORDS = ["one", "two", "three", "plus", "is"]


def _word_tokenizer(specials, model_unk, post=None, **special_tokens):
    """Whitespace word-level tokenizer: ``specials`` first (ids 0, 1, ...), then WORDS; words outside the
    vocabulary map to ``model_unk``; ``post``: a template such as ``"<s> $A </s>"`` wrapped around every text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=model_unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if post is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=post, special_tokens=[(t, vocab[t]) for t in specials if t in post.split()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, **special_tokens)


@pytest.fixture(scope="module")
def demo_like():
    """Like the demo's character tokenizer: no unknown token, the vocabulary maps unknown words to pad (id 0)."""
    return _word_tokenizer(["<pad>", "</s>"], "<pad>", pad_token="<pad>", eos_token="</s>")


# 5 rows; unknown words: "four" in line 2 (1 of its 5 tokens), "five" and "six" in line 5 (2 of 3)
UNKNOWN_ROWS = ["one plus two", "two plus two is four", "three", "one plus one", "five plus six"]


def _rows(tmp_path, prompts, name="p.jsonl"):
    return str(_write_jsonl(tmp_path / name, [{"prompt": p, "answer": "x"} for p in prompts]))


def test_unknown_ids_are_counted_and_warned(tmp_path, demo_like, caplog):
    path = _rows(tmp_path, UNKNOWN_ROWS)
    assert demo_like.encode("five plus six") == [0, 5, 0]
    for limit in (0.5, 0.4):  # 2 of 5 = 0.4: at the limit still loads
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megarl.data.prompts"):
            data = load_prompts(path, PromptConfig(apply_chat_template=False, max_unknown_token_share=limit), demo_like)
        assert len(data) == 5 and data.num_unknown == 2 and data.num_filtered == 0
        [warning] = [r.getMessage() for r in caplog.records]
        assert "p.jsonl: 2 of 5 prompts (40.0%) hold pad/unknown token ids (pad '<pad>' (id 0))" in warning
        assert "p.jsonl:2, has 1 such ids among its 5 tokens: 'two plus two is four'" in warning
        assert f"max_unknown_token_share={limit}" in warning
    # over-long prompts are dropped before counting: line 2 (5 tokens) goes, 1 of the 4 left is bad
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megarl.data.prompts"):
        data = load_prompts(path, PromptConfig(apply_chat_template=False, max_prompt_length=4,
                                               max_unknown_token_share=0.25), demo_like)
    assert len(data) == 4 and data.num_filtered == 1 and data.num_unknown == 1
    assert "1 of 4 prompts (25.0%)" in caplog.text and "p.jsonl:5, has 2 such ids among its 3 tokens" in caplog.text


def test_unknown_share_above_the_limit_fails(tmp_path, demo_like):
    path = _rows(tmp_path, UNKNOWN_ROWS)
    with pytest.raises(DataError, match=r"p\.jsonl: 2 of 5 prompts \(40\.0%\) hold pad/unknown token ids .*"
                                        r"above data\.max_unknown_token_share=0\.3 \(30\.0%\): use a tokenizer that "
                                        r"covers the text, fix the data, or raise data\.max_unknown_token_share"):
        load_prompts(path, PromptConfig(apply_chat_template=False, max_unknown_token_share=0.3), demo_like)
    with pytest.raises(DataError, match=r"max_unknown_token_share=0\.05 \(5\.0%\)"):  # the default
        load_prompts(path, PromptConfig(apply_chat_template=False), demo_like)


def test_clean_prompts_do_not_warn(tmp_path, demo_like, caplog):
    path = _rows(tmp_path, ["one plus two", "three is three"])
    with caplog.at_level(logging.WARNING, logger="megarl.data.prompts"):
        data = load_prompts(path, PromptConfig(apply_chat_template=False, max_unknown_token_share=0.0), demo_like)
    assert data.num_unknown == 0 and caplog.records == []


def test_pad_equal_to_bos_or_eos_is_not_counted(tmp_path, caplog):
    specials = ["<unk>", "<s>", "</s>"]
    pad_is_eos = _word_tokenizer(specials, "<unk>", "<s> $A </s>", unk_token="<unk>", bos_token="<s>",
                                 eos_token="</s>", pad_token="</s>")
    pad_is_bos = _word_tokenizer(specials, "<unk>", "<s> $A", unk_token="<unk>", bos_token="<s>",
                                 eos_token="</s>", pad_token="<s>")
    assert pad_is_eos.encode("one seven") == [1, 3, 0, 2] and pad_is_bos.encode("one") == [1, 3]
    path = _rows(tmp_path, ["one plus two", "one plus seven", "two"])  # "seven" is unknown
    for tok, pad_at in ((pad_is_eos, -1), (pad_is_bos, 0)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megarl.data.prompts"):
            data = load_prompts(path, PromptConfig(apply_chat_template=False, max_unknown_token_share=0.5), tok)
        assert all(r.input_ids[pad_at] == tok.pad_token_id for r in data.records)  # pad in every prompt...
        assert data.num_unknown == 1  # ...but only the unknown word counts
        assert "1 of 3 prompts (33.3%) hold pad/unknown token ids (unk '<unk>' (id 0))" in caplog.text
        assert "p.jsonl:2, has 1 such ids among its" in caplog.text
        with pytest.raises(DataError, match=r"1 of 3 prompts \(33\.3%\).*max_unknown_token_share=0\.0 "):
            load_prompts(path, PromptConfig(apply_chat_template=False, max_unknown_token_share=0.0), tok)


def test_unknown_ids_through_the_chat_template(tmp_path, tokenizer, caplog):
    # the template's own special tokens (<|user|>, <|end|> = eos, <|assistant|>) are not counted; a literal
    # pad token in the text is
    path = _rows(tmp_path, [r["prompt"] for r in TEXT_ROWS] + ["say <|pad|> twice <|pad|>"])
    with caplog.at_level(logging.WARNING, logger="megarl.data.prompts"):
        data = load_prompts(path, PromptConfig(max_unknown_token_share=0.25), tokenizer)
    assert data.num_unknown == 1
    assert "1 of 4 prompts (25.0%) hold pad/unknown token ids (pad '<|pad|>' (id 0))" in caplog.text
    assert "p.jsonl:4, has 2 such ids among its" in caplog.text


def test_max_unknown_token_share_is_validated():
    for bad in (-0.01, 1.5, float("nan")):
        with pytest.raises(ConfigError, match=rf"max_unknown_token_share is a share of prompts in \[0, 1\], "
                                              rf"found {bad}"):
            PromptConfig(max_unknown_token_share=bad)
    assert PromptConfig(max_unknown_token_share=0.0).max_unknown_token_share == 0.0
    assert PromptConfig(max_unknown_token_share=1.0).max_unknown_token_share == 1.0


# ---- prompts the tokenizer rewrites without an unknown id; ids the model cannot embed -------------------------


def _char_tokenizer(chars, *, normalizer=None):
    """A character tokenizer as the demo's (pad 0 standing for unknown characters, eos 1), optionally with a
    normalizer that rewrites text before it is split (``Replace(" ", "")`` drops spaces: no unknown id)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(["<pad>", "</s>", *chars])}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    if normalizer is not None:
        tok.normalizer = normalizer
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")


def test_prompts_a_tokenizer_silently_rewrites_are_refused(tmp_path, caplog):
    """Spaces dropped by the tokenizer make no unknown id; the round trip finds them and names them."""
    from tokenizers import normalizers

    drops_spaces = _char_tokenizer("0123456789+= ", normalizer=normalizers.Replace(" ", ""))
    assert drops_spaces.encode("1 + 2 =") == drops_spaces.encode("1+2=")  # the ids hide it
    path = _rows(tmp_path, ["1+2=", "1 + 2 =", "3+4=", "5+1="])
    with pytest.raises(DataError) as e:
        load_prompts(path, PromptConfig(apply_chat_template=False), drops_spaces)
    assert str(e.value).startswith(f"{path}: 1 of 4 prompts checked (25.0%) change in a round trip through the "
                                   f"tokenizer, decode(encode(text)) != text (the first, {path}:2, '1 + 2 =' comes "
                                   f"back as '1+2='); characters lost: ' ' (space) (tokenizer "
                                   f"{type(drops_spaces).__name__})")
    assert "above data.max_unknown_token_share=0.05 (5.0%)" in str(e.value)
    assert "set model.tokenizer to a directory holding only the model's tokenizer files" in str(e.value)
    with caplog.at_level(logging.WARNING, logger="megarl.data.prompts"):  # within the share: warned, loaded
        data = load_prompts(path, PromptConfig(apply_chat_template=False, max_unknown_token_share=0.25), drops_spaces)
    assert len(data) == 4 and data.num_unknown == 0
    [warning] = [r.getMessage() for r in caplog.records]
    assert "1 of 4 prompts checked (25.0%)" in warning and "allowed up to max_unknown_token_share=0.25" in warning
    keeps_spaces = _char_tokenizer("0123456789+= ")  # the same vocabulary, no normalizer: loads silently
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megarl.data.prompts"):
        load_prompts(path, PromptConfig(apply_chat_template=False, max_unknown_token_share=0.0), keeps_spaces)
    assert caplog.records == []


def test_unknown_characters_are_named(tmp_path):
    """Characters outside a character vocabulary become pad ids (counted) and are named as lost (the pad token's
    own letters do not hide an 'a' or a 'd')."""
    tok = _char_tokenizer("0123456789+= ")
    path = _rows(tmp_path, ["after 5 comes", "1+2="])
    with pytest.raises(DataError) as e:
        load_prompts(path, PromptConfig(apply_chat_template=False), tok)
    message = str(e.value)
    assert f"{path}: 1 of 2 prompts (50.0%) hold pad/unknown token ids (pad '<pad>' (id 0))" in message
    assert ("1 of 2 prompts checked (50.0%) change in a round trip through the tokenizer, decode(encode(text)) != "
            "text (the same prompt comes back as '<pad><pad><pad><pad><pad> 5 <pad><pad><pad><pad><pad>'); "
            "characters lost: 'a', 'f', 't', 'e', 'r', 'c', 'o', 'm', 's'") in message


def test_chat_messages_are_round_tripped_each(tmp_path):
    """Every message's own text is checked, not the chat template's: a system message the vocabulary cannot
    spell fails, though the user's message is clean."""
    tok = _char_tokenizer("0123456789+= ?")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = _write_jsonl(tmp_path / "chat.jsonl", [
        {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2=?"}]},
        {"prompt": [{"role": "user", "content": "3 + 4 = ?"}]}])
    with pytest.raises(DataError, match=r"the first, .*chat\.jsonl:1, .* \(the same prompt comes back as '<pad><pad> "
                                        r"<pad><pad><pad><pad><pad>'\); characters lost: 'b', 'e', 'r', 'i', 'f'"):
        load_prompts(str(path), PromptConfig(max_unknown_token_share=0.4), tok)


def test_round_trip_checks_an_even_sample(tmp_path, monkeypatch, caplog):
    import megarl.data.prompts as prompts

    monkeypatch.setattr(prompts, "ROUND_TRIP_SAMPLE", 2)
    from tokenizers import normalizers

    drops_spaces = _char_tokenizer("0123456789+= ", normalizer=normalizers.Replace(" ", ""))
    path = _rows(tmp_path, ["1+2=", "1 + 2 =", "3 + 4 =", "5+1=", "6+1="])  # rows 0 and 2 of 5 are checked
    with caplog.at_level(logging.WARNING, logger="megarl.data.prompts"):
        load_prompts(path, PromptConfig(apply_chat_template=False, max_unknown_token_share=0.5), drops_spaces)
    assert f"1 of 2 prompts checked (50.0%) change in a round trip through the tokenizer, decode(encode(text)) != " \
           f"text (the first, {path}:3, '3 + 4 ='" in caplog.text


def test_ids_the_model_cannot_embed_are_refused(tmp_path, demo_like):
    """``vocab_size`` (the model's config.json): an id at or above it is an error however few prompts hold one."""
    path = _rows(tmp_path, ["one two", "one plus two", "two"])  # plus is id 5
    assert demo_like.encode("one plus two") == [2, 5, 3]
    with pytest.raises(DataError) as e:
        load_prompts(path, PromptConfig(apply_chat_template=False, max_unknown_token_share=1.0), demo_like,
                     vocab_size=5)
    assert str(e.value) == (
        f"{path}: 1 of 3 prompts hold token ids the model cannot embed (its config.json has vocab_size=5); the first, "
        f"{path}:2, holds 5 ('plus'): 'one plus two'. The tokenizer ({type(demo_like).__name__}, 7 tokens) is not the "
        "one the model was built with: set model.tokenizer to a directory holding only the model's own tokenizer files")
    assert len(load_prompts(path, PromptConfig(apply_chat_template=False), demo_like, vocab_size=6)) == 3
