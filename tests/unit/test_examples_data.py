"""megarl.data.examples: TRL-format files to token rows, against hand-worked ids.

The tokenizer is :func:`megarl.toy.char_tokenizer` over ``ALPHABET`` with the specials ``<|user|>``,
``<|assistant|>``: its documented vocabulary is pad 0, ``<|end|>`` 1 (eos), ``<|user|>`` 2, ``<|assistant|>`` 3,
then one id per character in order: a 4, b 5, c 6, x 7, y 8, z 9, space 10, Q 11. Every expected id below is
worked out by hand from that table and from TRL 1.16's preparation as the module docstring describes it
(trl/trainer/{sft,dpo,reward,kto}_trainer.py, trl/data_utils.py); none is produced by the code under test.
"""

from __future__ import annotations

import json

import pytest
import torch

from megarl.data.examples import (
    DataFormat,
    Example,
    ExampleKind,
    Truncation,
    example_rows,
    extract_prompt,
    kl_examples,
    load_examples,
)
from megarl.data.prompts import DataError
from megarl.errors import ConfigError
from megarl.toy import char_tokenizer

ALPHABET = "abcxyz Q"
END, USER, ASSISTANT = 1, 2, 3
a, b, c, x, y, z, SP, Q = range(4, 12)
# assistant turns inside {% generation %} (assistant_only_loss); the generation prompt is "<|assistant|>"
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}{{ m['content'] }}"
            "<|end|>{% endgeneration %}{% else %}<|user|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# like Gemma's: the generation prompt alone ends with a "Q" (an empty thought block) that the full chat lacks
QUIRK_TEMPLATE = TEMPLATE.replace("{% if add_generation_prompt %}<|assistant|>{% endif %}",
                                  "{% if add_generation_prompt %}<|assistant|>Q{% endif %}")
SPECIALS = ["<|user|>", "<|assistant|>"]


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer(ALPHABET, specials=SPECIALS, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def quirk_tok():
    return char_tokenizer(ALPHABET, specials=SPECIALS, chat_template=QUIRK_TEMPLATE)


def _write(tmp_path, rows, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text):
    return {"role": "assistant", "content": text}


def _rows(batch):
    return batch["input_ids"].tolist(), batch["attention_mask"].tolist(), batch["response_mask"].tolist()


def test_vocabulary_is_the_documented_one(tok):
    assert tok(text="abcxyz Q<|end|>")["input_ids"] == [a, b, c, x, y, z, SP, Q, END]
    assert tok.eos_token == "<|end|>" and tok.pad_token_id == 0


# ---- SFT ------------------------------------------------------------------------------------------------------


def test_sft_text_appends_eos_once_and_trains_every_token(tmp_path, tok):
    path = _write(tmp_path, [{"text": "ab"}, {"text": "c<|end|>"}])
    examples = load_examples(path, ExampleKind.SFT, tok, max_length=None)
    assert [e.prompt_ids + e.completions[0] for e in examples] == [[a, b, END], [c, END]]
    ids, attention, response = _rows(example_rows(examples, ExampleKind.SFT, pad_token_id=0))
    assert ids == [[a, b, END], [c, END, 0]]
    assert attention == [[1, 1, 1], [1, 1, 0]]
    assert response == [[0, 1, 1], [0, 1, 0]]  # every token but the first, which nothing predicts


def test_sft_prompt_completion_is_completion_only_by_default(tmp_path, tok):
    path = _write(tmp_path, [{"prompt": "ab", "completion": "c"}])
    (example,) = load_examples(path, ExampleKind.SFT, tok, max_length=None)
    assert (example.prompt_ids, example.completions) == ([a, b], ([c, END],))
    assert _rows(example_rows([example], ExampleKind.SFT, 0))[2] == [[0, 0, 1, 1]]
    (full,) = load_examples(path, ExampleKind.SFT, tok, max_length=None, completion_only_loss=False)
    assert _rows(example_rows([full], ExampleKind.SFT, 0))[2] == [[0, 1, 1, 1]]


def test_sft_messages_get_no_eos_and_assistant_only_loss_follows_generation_markers(tmp_path, tok):
    path = _write(tmp_path, [{"messages": [_user("ab"), _assistant("c")]}])
    (example,) = load_examples(path, ExampleKind.SFT, tok, max_length=None)
    chat = [USER, a, b, END, ASSISTANT, c, END]  # the template's own <|end|> closes the turn; no second eos
    assert example.prompt_ids + example.completions[0] == chat
    ids, _, response = _rows(example_rows([example], ExampleKind.SFT, 0))
    assert ids == [chat] and response == [[0, 1, 1, 1, 1, 1, 1]]
    (masked,) = load_examples(path, ExampleKind.SFT, tok, max_length=None, assistant_only_loss=True)
    assert _rows(example_rows([masked], ExampleKind.SFT, 0))[2] == [[0, 0, 0, 0, 0, 1, 1]]


def test_sft_conversational_prompt_completion_splits_after_the_generation_prompt(tmp_path, tok):
    path = _write(tmp_path, [{"prompt": [_user("ab")], "completion": [_assistant("c")]}])
    (example,) = load_examples(path, ExampleKind.SFT, tok, max_length=None)
    assert example.prompt_ids == [USER, a, b, END, ASSISTANT] and example.completions == ([c, END],)
    assert _rows(example_rows([example], ExampleKind.SFT, 0))[2] == [[0, 0, 0, 0, 0, 1, 1]]


def test_sft_truncation_keep_start_keep_end_and_dropping_fully_masked_rows(tmp_path, tok):
    path = _write(tmp_path, [{"prompt": "abcx", "completion": "y"}, {"prompt": "a", "completion": "bc"}])
    # keep_start, 3 tokens: row 0 = a b c, all prompt: dropped; row 1 = a b c of a b c <end>
    (kept,) = load_examples(path, ExampleKind.SFT, tok, max_length=3)
    assert kept.index == 0 and (kept.prompt_ids, kept.completions) == ([a], ([b, c],))
    assert _rows(example_rows([kept], ExampleKind.SFT, 0))[2] == [[0, 1, 1]]
    # keep_end, 3 tokens: row 0 = x y <end> (prompt x), row 1 = b c <end>
    ends = load_examples(path, ExampleKind.SFT, tok, max_length=3, truncation=Truncation.KEEP_END)
    assert [(e.prompt_ids, e.completions) for e in ends] == [([x], ([y, END],)), ([], ([b, c, END],))]
    ids, _, response = _rows(example_rows(ends, ExampleKind.SFT, 0))
    assert ids == [[x, y, END], [b, c, END]] and response == [[0, 1, 1], [0, 1, 1]]
    text = _write(tmp_path, [{"text": "abcxyz"}], "text.jsonl")
    (start,) = load_examples(text, ExampleKind.SFT, tok, max_length=4)
    (end,) = load_examples(text, ExampleKind.SFT, tok, max_length=4, truncation=Truncation.KEEP_END)
    assert start.completions == ([a, b, c, x],) and end.completions == ([x, y, z, END],)


def test_sft_text_tokenization_adds_the_tokenizers_special_tokens(tmp_path):
    """TRL encodes text as ``tokenizer(text=...)``: a tokenizer that prepends a bos gets it once, at the start."""
    from tokenizers.processors import TemplateProcessing

    bos_tok = char_tokenizer(ALPHABET, specials=["<|bos|>"])  # <|bos|> is id 2, a..Q are 3..10
    bos_tok.backend_tokenizer.post_processor = TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 2)])
    path = _write(tmp_path, [{"prompt": "ab", "completion": "c"}])
    (example,) = load_examples(path, ExampleKind.SFT, bos_tok, max_length=None)
    assert (example.prompt_ids, example.completions) == ([2, 3, 4], ([5, END],))


# ---- preference: DPO ------------------------------------------------------------------------------------------


def test_dpo_text_adds_eos_and_interleaves_chosen_and_rejected(tmp_path, tok):
    path = _write(tmp_path, [{"prompt": "ab", "chosen": "c", "rejected": "xy"},
                             {"prompt": "z", "chosen": "a<|end|>", "rejected": "b"}])
    examples = load_examples(path, ExampleKind.PREFERENCE, tok, max_length=None)
    assert [(e.prompt_ids, e.completions) for e in examples] == [
        ([a, b], ([c, END], [x, y, END])), ([z], ([a, END], [b, END]))]
    batch = example_rows(examples, ExampleKind.PREFERENCE, 0)
    ids, attention, response = _rows(batch)
    assert ids == [[a, b, c, END, 0], [a, b, x, y, END], [z, a, END, 0, 0], [z, b, END, 0, 0]]
    assert attention == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]]
    assert response == [[0, 0, 1, 1, 0], [0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [0, 1, 1, 0, 0]]
    assert batch["example_index"].tolist() == [0, 0, 1, 1]
    assert batch["response_mask"].dtype == torch.float32 and batch["input_ids"].dtype == torch.long
    assert "margin" not in batch and "label" not in batch


def test_dpo_implicit_prompt_is_trls_extract_prompt(tmp_path, tok):
    path = _write(tmp_path, [{"chosen": "ab c", "rejected": "ab x"}])
    (example,) = load_examples(path, ExampleKind.PREFERENCE, tok, max_length=None)
    # the common "ab " less the space before the difference: prompt "ab", completions " c", " x"
    assert (example.prompt_ids, example.completions) == ([a, b], ([SP, c, END], [SP, x, END]))


def test_extract_prompt_matches_trls_examples_and_quirks():
    chosen = [_user("What color is the sky?"), _assistant("It is blue.")]
    rejected = [_user("What color is the sky?"), _assistant("It is green.")]
    assert extract_prompt(chosen, rejected) == ([chosen[0]], [chosen[1]], [rejected[1]])  # TRL's docstring example
    # no difference inside the shorter one: TRL's loop ends on its last index, which goes to the completions
    assert extract_prompt("abc", "abcx") == ("ab", "c", "cx")
    # a difference at 0 with chosen ending in a space: TRL steps back to index -1
    assert extract_prompt("ab ", "xy ") == ("ab", " ", " ")


def test_dpo_conversational_prompt_is_the_shortest_common_prefix(tmp_path, quirk_tok):
    """The generation prompt renders "<|assistant|>Q", the full chats "<|assistant|>" + content: a chosen answer
    starting with Q shares the Q, the rejected does not, and the prompt is the shorter common prefix."""
    path = _write(tmp_path, [{"prompt": [_user("ab")], "chosen": [_assistant("Qc")], "rejected": [_assistant("x")]}])
    (example,) = load_examples(path, ExampleKind.PREFERENCE, quirk_tok, max_length=None)
    assert example.prompt_ids == [USER, a, b, END, ASSISTANT]
    assert example.completions == ([Q, c, END], [x, END])


def test_dpo_truncation_drops_long_prompts_and_cuts_rows_at_collation(tmp_path, tok):
    path = _write(tmp_path, [{"prompt": "abcx", "chosen": "y", "rejected": "z"},
                             {"prompt": "ab", "chosen": "cxy", "rejected": "z"}])
    (example,) = load_examples(path, ExampleKind.PREFERENCE, tok, max_length=4)  # prompt of 4 >= 4: dropped
    assert example.index == 0 and example.completions == ([c, x, y, END], [z, END])  # kept whole until collation
    ids, _, response = _rows(example_rows([example], ExampleKind.PREFERENCE, 0, max_length=4))
    assert ids == [[a, b, c, x], [a, b, z, END]] and response == [[0, 0, 1, 1], [0, 0, 1, 1]]
    kept = load_examples(path, ExampleKind.PREFERENCE, tok, max_length=4, truncation=Truncation.KEEP_END)
    assert len(kept) == 2  # keep_end drops nothing
    ids, _, response = _rows(example_rows(kept, ExampleKind.PREFERENCE, 0, max_length=4,
                                          truncation=Truncation.KEEP_END))
    # a b c x y <end> -> c x y <end>; the second pair's chosen row is then all completion (but token 0 predicts nothing)
    assert ids == [[c, x, y, END], [c, x, z, END], [c, x, y, END], [a, b, z, END]]
    assert response == [[0, 0, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1]]


# ---- preference: reward model ---------------------------------------------------------------------------------


def test_reward_model_rows_are_whole_sequences_with_margins(tmp_path, tok):
    path = _write(tmp_path, [{"prompt": "ab", "chosen": "c", "rejected": "xy", "margin": 0.5},
                             {"prompt": "a", "chosen": "z", "rejected": "b", "margin": -1}])
    examples = load_examples(path, ExampleKind.PREFERENCE, tok, max_length=None, for_reward_model=True)
    assert [(e.prompt_ids, e.completions, e.margin) for e in examples] == [
        ([], ([a, b, c, END], [a, b, x, y, END]), 0.5), ([], ([a, z, END], [a, b, END]), -1.0)]
    batch = example_rows(examples, ExampleKind.PREFERENCE, 0)
    assert batch["input_ids"].tolist() == [[a, b, c, END, 0], [a, b, x, y, END], [a, z, END, 0, 0], [a, b, END, 0, 0]]
    assert batch["margin"].tolist() == [0.5, 0.5, -1.0, -1.0]
    # over max_length: the pair is dropped, never cut (the rejected row of pair 0 has 5 tokens)
    (short,) = load_examples(path, ExampleKind.PREFERENCE, tok, max_length=4, for_reward_model=True)
    assert short.index == 0 and short.margin == -1.0


def test_reward_model_does_not_extract_a_prompt(tmp_path, tok):
    path = _write(tmp_path, [{"chosen": "abc", "rejected": "abcx"}])
    (example,) = load_examples(path, ExampleKind.PREFERENCE, tok, max_length=None, for_reward_model=True)
    assert (example.prompt_ids, example.completions) == ([], ([a, b, c, END], [a, b, c, x, END]))
    (dpo,) = load_examples(path, ExampleKind.PREFERENCE, tok, max_length=None)  # extract_prompt: "ab" | "c", "cx"
    assert (dpo.prompt_ids, dpo.completions) == ([a, b], ([c, END], [c, x, END]))


def test_margin_must_be_in_every_row_or_none(tmp_path, tok):
    path = _write(tmp_path, [{"prompt": "a", "chosen": "b", "rejected": "c", "margin": 1.0},
                             {"prompt": "a", "chosen": "b", "rejected": "c"}])
    with pytest.raises(DataError, match=r"data.jsonl:2: column 'margin'"):
        load_examples(path, ExampleKind.PREFERENCE, tok, max_length=None, for_reward_model=True)


# ---- unpaired: KTO --------------------------------------------------------------------------------------------


def test_kto_rows_labels_and_truncation(tmp_path, tok):
    path = _write(tmp_path, [{"prompt": "ab", "completion": "c", "label": True},
                             {"prompt": "abcx", "completion": "y", "label": True},
                             {"prompt": "z", "completion": "xyz", "label": False}])
    examples = load_examples(path, ExampleKind.UNPAIRED, tok, max_length=4)  # prompt "abcx" fills 4: dropped
    assert [(e.index, e.prompt_ids, e.completions, e.label) for e in examples] == [
        (0, [a, b], ([c, END],), True), (1, [z], ([x, y, z, END],), False)]
    batch = example_rows(examples, ExampleKind.UNPAIRED, 0, max_length=4)
    ids, attention, response = _rows(batch)
    assert ids == [[a, b, c, END], [z, x, y, z]] and attention == [[1] * 4, [1] * 4]
    assert response == [[0, 0, 1, 1], [0, 1, 1, 1]]
    assert batch["label"].tolist() == [1.0, 0.0] and batch["example_index"].tolist() == [0, 1]


def test_kto_kl_pairs_rotate_completions_within_each_chunk(tmp_path, tok):
    path = _write(tmp_path, [{"prompt": "a", "completion": "x", "label": True},
                             {"prompt": "b", "completion": "yy", "label": False},
                             {"prompt": "c", "completion": "z", "label": True}])
    examples = load_examples(path, ExampleKind.UNPAIRED, tok, max_length=None)
    kl = kl_examples(examples, chunk_size=2)  # chunks [0, 1], [2]: (x1, y2), (x2, y1), (x3, y3)
    batch = example_rows(kl, ExampleKind.UNPAIRED, 0, max_length=3)
    ids, _, response = _rows(batch)
    assert ids == [[a, y, y], [b, x, END], [c, z, END]]
    assert response == [[0, 1, 1], [0, 1, 1], [0, 1, 1]]
    assert batch["label"].tolist() == [1.0, 0.0, 1.0] and batch["example_index"].tolist() == [0, 1, 2]
    whole = kl_examples(examples)  # one chunk: (x1, y3), (x2, y1), (x3, y2)
    assert [e.prompt_ids + e.completions[0] for e in whole] == [[a, z, END], [b, x, END], [c, y, y, END]]


def test_kto_reads_preference_files_unpaired_chosen_first(tmp_path, tok):
    path = _write(tmp_path, [{"prompt": "a", "chosen": "b", "rejected": "c"},
                             {"chosen": "x y", "rejected": "x z"}], "pairs.jsonl")
    with pytest.raises(DataError, match="pairs.jsonl:2: no column"):  # the first row fixes the format
        load_examples(path, ExampleKind.UNPAIRED, tok, max_length=None)
    path = _write(tmp_path, [{"prompt": "a", "chosen": "b", "rejected": "c"},
                             {"prompt": "x", "chosen": "y", "rejected": "z"}], "pairs.jsonl")
    examples = load_examples(path, ExampleKind.UNPAIRED, tok, max_length=None)
    assert [(e.prompt_ids, e.completions, e.label) for e in examples] == [
        ([a], ([b, END],), True), ([x], ([y, END],), True), ([a], ([c, END],), False), ([x], ([z, END],), False)]


def test_parquet_files_read_like_jsonl(tmp_path, tok):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "kto.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": [_user("a")], "completion": [_assistant("b")], "label": False}]),
                   path)
    (example,) = load_examples(path, ExampleKind.UNPAIRED, tok, max_length=None)
    assert (example.prompt_ids, example.completions, example.label) == (
        [USER, a, END, ASSISTANT], ([b, END],), False)


# ---- errors ---------------------------------------------------------------------------------------------------


def test_unknown_columns_name_the_file_the_columns_and_the_formats(tmp_path, tok):
    path = _write(tmp_path, [{"question": "a", "answer": "b"}])
    with pytest.raises(ConfigError) as info:
        load_examples(path, ExampleKind.PREFERENCE, tok, max_length=None)
    message = str(info.value)
    assert str(path) in message and "['answer', 'question']" in message
    assert "{prompt, chosen, rejected}" in message and "{chosen, rejected}" in message
    both = _write(tmp_path, [{"text": "a", "prompt": "a", "completion": "b"}], "both.jsonl")
    with pytest.raises(ConfigError, match="more than one sft format"):
        load_examples(both, ExampleKind.SFT, tok, max_length=None)


def test_bad_rows_and_settings_are_clear_errors(tmp_path, tok):
    mixed = _write(tmp_path, [{"prompt": "a", "completion": "b"}, {"prompt": [_user("a")], "completion": "b"}])
    with pytest.raises(DataError, match=r"data.jsonl:2: column 'prompt' must be a text string"):
        load_examples(mixed, ExampleKind.SFT, tok, max_length=None)
    label = _write(tmp_path, [{"prompt": "a", "completion": "b", "label": 1}], "label.jsonl")
    with pytest.raises(DataError, match="'label' must be true or false"):
        load_examples(label, ExampleKind.UNPAIRED, tok, max_length=None)
    chat = _write(tmp_path, [{"messages": [_user("a")]}], "chat.jsonl")
    with pytest.raises(ConfigError, match="no chat template"):
        load_examples(chat, ExampleKind.SFT, char_tokenizer(ALPHABET), max_length=None)
    with pytest.raises(ConfigError, match=r"\{% generation %\} markers"):
        load_examples(chat, ExampleKind.SFT, char_tokenizer(ALPHABET, chat_template="{{ messages[0]['content'] }}"),
                      max_length=None, assistant_only_loss=True)
    text = _write(tmp_path, [{"text": "a"}], "text.jsonl")
    with pytest.raises(ConfigError, match="completion_only_loss needs prompt/completion"):
        load_examples(text, ExampleKind.SFT, tok, max_length=None, completion_only_loss=True)
    with pytest.raises(ConfigError, match="keep_end"):
        load_examples(text, ExampleKind.UNPAIRED, tok, max_length=8, truncation=Truncation.KEEP_END)
    with pytest.raises(ConfigError, match="unknown extension"):
        load_examples(tmp_path / "data.csv", ExampleKind.SFT, tok, max_length=None)
    with pytest.raises(DataError, match="no example left"):
        load_examples(_write(tmp_path, [{"prompt": "abc", "completion": "x", "label": True}], "long.jsonl"),
                      ExampleKind.UNPAIRED, tok, max_length=2)


def test_example_rows_refuses_examples_of_another_kind():
    sft = Example(0, [a], ([b],), loss_mask=[0, 1])
    with pytest.raises(ValueError, match="not preference examples"):
        example_rows([sft], ExampleKind.PREFERENCE, 0)
    with pytest.raises(ValueError, match="not unpaired examples"):
        example_rows([sft], ExampleKind.UNPAIRED, 0)


def test_format_columns():
    assert DataFormat.PAIRED.columns == ("prompt", "chosen", "rejected")


def test_bpe_rows_equal_those_recorded_from_trl(tmp_path):
    """Ids recorded from TRL 1.16's own ``DPOTrainer._prepare_dataset`` + ``DataCollatorForPreference`` and
    ``SFTTrainer._prepare_dataset`` + ``DataCollatorForLanguageModeling`` (trl 1.16.0, transformers 5.24) on these
    rows with :func:`megarl.testing.tiny.make_tokenizer`'s byte-level BPE and chat template."""
    from megarl.testing.tiny import make_tokenizer

    bpe = make_tokenizer()
    pairs = [{"prompt": "the sky is", "chosen": " blue.", "rejected": " green."},
             {"prompt": "the sun is", "chosen": " in the sky.", "rejected": " in the sea."}]
    prompt0, prompt1 = [88, 263, 225, 87, 79, 93, 225, 280], [88, 263, 225, 87, 89, 82, 225, 280]
    trl_rows = [prompt0 + [272, 80, 89, 73, 18, 1], prompt0 + [225, 75, 283, 278, 18, 1],
                prompt1 + [225, 264, 294, 225, 87, 79, 93, 18, 1], prompt1 + [225, 264, 294, 225, 87, 73, 69, 18, 1]]
    examples = load_examples(_write(tmp_path, pairs), ExampleKind.PREFERENCE, bpe, max_length=None)
    batch = example_rows(examples, ExampleKind.PREFERENCE, bpe.pad_token_id)
    assert batch["input_ids"].tolist() == [r + [0] * (17 - len(r)) for r in trl_rows]
    assert batch["response_mask"].tolist() == [[0] * 8 + [1] * (len(r) - 8) + [0] * (17 - len(r)) for r in trl_rows]
    chat = [{"prompt": [_user("what is up?")], "completion": [_assistant("the sky.")]}]
    (example,) = load_examples(_write(tmp_path, chat, "chat.jsonl"), ExampleKind.SFT, bpe, max_length=None)
    assert example.prompt_ids + example.completions[0] == [
        2, 91, 76, 69, 88, 225, 280, 225, 89, 84, 35, 1, 3, 88, 263, 225, 87, 79, 93, 18, 1]
    assert example.loss_mask == [0] * 13 + [1] * 8  # TRL's labels != -100
