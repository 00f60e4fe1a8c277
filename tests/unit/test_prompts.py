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
