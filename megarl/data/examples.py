"""Offline training examples in TRL's column conventions, tokenized exactly as TRL 1.16's trainers prepare them.

Owns the path from a ``.jsonl`` / ``.parquet`` file to :class:`Example`s (the token ids TRL's ``_prepare_dataset``
leaves, filtered as it filters) and from examples to right-padded token rows (:func:`example_rows`: what TRL's
collators build, preference pairs interleaved), plus KTO's mismatched KL rows (:func:`kl_examples`). The format is
read from the first row's columns (:class:`DataFormat`); every column is text, or every one chat messages
(``[{"role", ...}]``, rendered by the tokenizer's chat template with the row's ``tools`` / ``chat_template_kwargs``).
Text is encoded as ``tokenizer(text=...)`` (special tokens added), a chat as ``apply_chat_template(...,
tokenize=True, return_dict=True)``; ``tokenizer.eos_token`` is appended to a text completion / chosen / rejected /
``text`` that does not already end with it (never to chat messages: the template ends turns).

- SFT (``SFTTrainer._prepare_dataset``): ``text`` -> ids of text+eos; ``messages`` -> the chat; ``prompt`` +
  ``completion`` -> ids of prompt+completion, the prompt being the first ``common_prefix_length(ids(prompt),
  ids(prompt + completion))`` tokens (a chat prompt with the generation prompt). Loss on every token, except
  ``completion_only_loss`` (default: on for prompt+completion) and ``assistant_only_loss`` (a template with
  ``{% generation %}`` markers). Then cut to ``max_length`` (keep_start or keep_end) and, when cut, dropped if no
  token is left in the loss.
- Preference, DPO (``DPOTrainer._prepare_dataset`` + ``DataCollatorForPreference``): without a ``prompt`` column
  the prompt is TRL's ``extract_prompt`` (the common leading characters / messages of chosen and rejected); ids of
  prompt, prompt+chosen, prompt+rejected; the prompt keeps ``min`` of the two common-prefix lengths. Pairs whose
  prompt has ``>= max_length`` tokens are dropped (keep_start); rows are cut to ``max_length`` at collation.
- Preference, reward model (``for_reward_model``; ``RewardTrainer``): no prompt extraction and no split:
  ``prompt_ids`` is empty and the completions are the whole ids of prompt+chosen / prompt+rejected (the same ids
  as DPO's rows); pairs with either row over ``max_length`` are dropped, never cut; an optional ``margin`` column.
  Its score is read where ``*ForSequenceClassification`` reads it (the last token that is not ``pad_token_id``),
  not from ``response_mask``.
- Unpaired, KTO (``KTOTrainer._prepare_dataset`` + ``DataCollatorForUnpairedPreference``): ``prompt`` /
  ``completion`` / ``label`` split like DPO's; a preference file is first given a prompt (as DPO) and unpaired
  as ``unpair_preference_dataset`` does through ``datasets.map``: per chunk of :data:`DATASETS_MAP_BATCH` rows,
  every chosen (label true), then every rejected. Examples whose prompt has ``>= max_length`` tokens are dropped;
  rows are cut (keep_start) to ``max_length`` at collation.
- KTO's KL rows: TRL rotates completions by one inside each chunk of ``per_device_train_batch_size`` consecutive
  examples of the prepared (filtered) dataset, counted from its start: ``(x_1, y_1) .. (x_n, y_n)`` gives the KL
  pairs ``(x_1, y_n), (x_2, y_1), .., (x_n, y_{n-1})`` (the last chunk may be shorter). It does so at preparation,
  with ``dataset_num_proc=None``, and trains on the dataset in order (``train_sampling_strategy="sequential"``).
  :func:`kl_examples` builds them; each KL row is ``x_i``'s prompt ids + ``y_{i-1}``'s completion ids, cut to
  ``max_length`` from the end, the completion in the loss.

Not reproduced: ``formatting_func``, ShareGPT ``conversations``, already-tokenized files (``input_ids`` /
``chosen_ids`` columns), packing, ``dataset_text_field`` other than ``text``, the ``eos_token`` setting (set
``tokenizer.eos_token``), TRL's substitute training templates for ``assistant_only_loss`` (the template must
carry generation markers), vision data, and ``datasets``' Arrow schema merge (a message key missing in one row
is not filled with null). Pure module: torch for the rows; the tokenizer is passed in. Must not import Ray,
vLLM, torch.distributed or megarl layers above ``data``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megarl.data.batch import Batch
from megarl.data.prompts import DataError, read_rows
from megarl.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DATASETS_MAP_BATCH = 1000  # datasets.Dataset.map's default batch size: the chunks TRL's KTO unpairs preference rows in
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")  # trl.chat_template_utils.has_generation_markers


class ExampleKind(enum.Enum):
    SFT = "sft"
    PREFERENCE = "preference"  # DPO and reward model: prompt, chosen, rejected
    UNPAIRED = "unpaired"  # KTO: prompt, completion, label


class Truncation(enum.Enum):
    KEEP_START = "keep_start"  # TRL's default; the only mode of KTO
    KEEP_END = "keep_end"  # SFT and DPO only (deprecated in TRL 1.16)


class DataFormat(enum.Enum):
    """TRL's dataset formats, by the columns that make them (value: the columns, comma-separated)."""

    LANGUAGE_MODELING = "text"
    MESSAGES = "messages"
    PROMPT_COMPLETION = "prompt, completion"
    PAIRED = "prompt, chosen, rejected"
    PAIRED_IMPLICIT_PROMPT = "chosen, rejected"
    UNPAIRED = "prompt, completion, label"

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(self.value.split(", "))


FORMATS: dict[ExampleKind, tuple[DataFormat, ...]] = {
    ExampleKind.SFT: (DataFormat.LANGUAGE_MODELING, DataFormat.MESSAGES, DataFormat.PROMPT_COMPLETION),
    ExampleKind.PREFERENCE: (DataFormat.PAIRED, DataFormat.PAIRED_IMPLICIT_PROMPT),
    ExampleKind.UNPAIRED: (DataFormat.UNPAIRED, DataFormat.PAIRED, DataFormat.PAIRED_IMPLICIT_PROMPT),
}
_TEXT_COLUMNS = ("text", "messages", "prompt", "completion", "chosen", "rejected")


@dataclasses.dataclass(frozen=True)
class Example:
    """One example's token ids. A row is ``prompt_ids + completion`` for each completion (chosen then rejected for
    preference); the loss counts the completion's tokens, or, when ``loss_mask`` is given (SFT), the tokens where it
    is 1 (TRL's ``labels != -100``), over ``prompt_ids + completions[0]``."""

    index: int  # position among the loaded (filtered) examples
    prompt_ids: list[int]
    completions: tuple[list[int], ...]
    label: bool | None = None  # KTO: desirable
    margin: float | None = None  # reward model: the pair's ``margin`` column
    loss_mask: list[int] | None = None  # SFT

    def rows(self) -> list[tuple[list[int], list[int]]]:
        """``(token ids, 0/1 loss mask)`` of each row, untruncated."""
        if self.loss_mask is not None:
            return [(self.prompt_ids + self.completions[0], list(self.loss_mask))]
        return [(self.prompt_ids + c, [0] * len(self.prompt_ids) + [1] * len(c)) for c in self.completions]


def load_examples(path: str | Path, kind: ExampleKind, tokenizer: PreTrainedTokenizerBase, *,
                  max_length: int | None, truncation: Truncation = Truncation.KEEP_START,
                  completion_only_loss: bool | None = None, assistant_only_loss: bool = False,
                  for_reward_model: bool = False) -> list[Example]:
    """The examples of the file ``path`` as TRL 1.16's trainer for ``kind`` prepares them (module docstring).
    ``completion_only_loss`` / ``assistant_only_loss``: SFT's settings (None: on for prompt+completion data);
    ``for_reward_model``: RewardTrainer's preparation instead of DPOTrainer's."""
    _check_settings(kind, max_length, truncation, completion_only_loss, assistant_only_loss, for_reward_model)
    rows = read_rows(path)
    fmt = detect_format(str(path), rows[0][1], kind)
    chat = any(isinstance(rows[0][1][c], list) for c in fmt.columns if c in _TEXT_COLUMNS)
    _check_chat_settings(str(path), fmt, chat, tokenizer, completion_only_loss, assistant_only_loss)
    if kind is ExampleKind.SFT and completion_only_loss is None:
        completion_only_loss = fmt is DataFormat.PROMPT_COMPLETION
    for where, row in rows:
        _check_row(where, row, fmt, chat)
    eos = None if chat else _eos_token(tokenizer)
    if kind is ExampleKind.UNPAIRED and fmt is not DataFormat.UNPAIRED:
        rows = _unpair([(w, _with_prompt(r, fmt)) for w, r in rows])
    if kind is ExampleKind.PREFERENCE and for_reward_model:
        _check_margins(rows)
    examples: list[Example] = []
    for where, row in rows:
        if kind is ExampleKind.SFT:
            example = _sft_example(where, row, fmt, tokenizer, eos, completion_only_loss, assistant_only_loss,
                                   max_length, truncation)
        elif kind is ExampleKind.PREFERENCE and for_reward_model:
            example = _reward_example(row, fmt, tokenizer, eos, max_length)
        elif kind is ExampleKind.PREFERENCE:
            example = _split_example(_with_prompt(row, fmt), ("chosen", "rejected"), tokenizer, eos, max_length,
                                     truncation)
        else:
            example = _split_example(row, ("completion",), tokenizer, eos, max_length, truncation, row["label"])
        if example is not None:
            examples.append(dataclasses.replace(example, index=len(examples)))
    if len(examples) < len(rows):
        logger.warning("%s: dropped %d of %d examples at max_length=%s, as TRL's trainer drops them",
                       path, len(rows) - len(examples), len(rows), max_length)
    if not examples:
        raise DataError(f"{path}: no example left: all {len(rows)} are dropped at max_length={max_length}; "
                        "raise max_length or shorten the prompts")
    return examples


def detect_format(path: str, row: Mapping[str, Any], kind: ExampleKind) -> DataFormat:
    """The format of ``kind`` whose columns the row holds (of two, the one with more columns: an explicit prompt)."""
    found = [f for f in FORMATS[kind] if all(c in row for c in f.columns)]
    found = [f for f in found if not any(set(f.columns) < set(g.columns) for g in found)]
    if len(found) == 1:
        return found[0]
    expected = " or ".join(f"{{{f.value}}}" for f in FORMATS[kind])
    what = "no" if not found else "more than one"
    raise ConfigError(f"{path}: {what} {kind.value} format matches the columns found, {sorted(row)}; expected the "
                      f"columns {expected} (TRL's {kind.value} formats): rename the file's columns")


def example_rows(examples: Sequence[Example], kind: ExampleKind, pad_token_id: int, *, max_length: int | None = None,
                 truncation: Truncation = Truncation.KEEP_START) -> Batch:
    """Right-padded rows of ``examples`` (preference: row ``2k`` chosen and ``2k+1`` rejected of example ``k``), each
    cut to ``max_length`` as TRL's collator cuts it (pass what :func:`load_examples` got): ``input_ids`` and
    ``attention_mask`` [B, S] long, ``response_mask`` [B, S] float (1 on a token whose log-prob is in the loss;
    never position 0), ``example_index`` [B] long; unpaired: ``label`` [B] (1.0 desirable); preference with margins:
    ``margin`` [B] (the pair's, on both rows)."""
    if not examples:
        raise ValueError("example_rows needs at least one example")
    width = 2 if kind is ExampleKind.PREFERENCE else 1
    bad = [e.index for e in examples if len(e.completions) != width or (kind is ExampleKind.UNPAIRED) != (
        e.label is not None)]
    if bad:
        raise ValueError(f"examples {bad[:5]} are not {kind.value} examples ({width} completion(s), a label for "
                         "unpaired only): load them with that kind")
    rows = [(_cut(ids, max_length, truncation), _cut(mask, max_length, truncation), e) for e in examples
            for ids, mask in e.rows()]
    size = max(len(ids) for ids, _, _ in rows)
    input_ids = torch.full((len(rows), size), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(rows), size), dtype=torch.long)
    response = torch.zeros((len(rows), size), dtype=torch.float32)
    for i, (ids, mask, _) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention[i, : len(ids)] = 1
        response[i, 1 : len(ids)] = torch.tensor(mask[1:], dtype=torch.float32)  # token 0 is predicted from nothing
    tensors = {"input_ids": input_ids, "attention_mask": attention, "response_mask": response,
               "example_index": torch.tensor([e.index for _, _, e in rows], dtype=torch.long)}
    if kind is ExampleKind.UNPAIRED:
        tensors["label"] = torch.tensor([float(bool(e.label)) for _, _, e in rows])
    margins = [e.margin for _, _, e in rows]
    if any(m is not None for m in margins):
        if any(m is None for m in margins):
            raise ValueError("some examples have a margin and some do not; a batch is all one or the other")
        tensors["margin"] = torch.tensor(margins, dtype=torch.float32)
    return Batch.from_dict(tensors)


def kl_examples(examples: Sequence[Example], chunk_size: int | None = None) -> list[Example]:
    """KTO's mismatched pairs: in each chunk of ``chunk_size`` consecutive examples (all of them when None),
    example ``i`` keeps its prompt and label and takes example ``i - 1``'s completion (the first takes the last's);
    TRL's chunks are ``per_device_train_batch_size`` examples of the loaded list from its start. Rows of the result
    (:func:`example_rows` with kind UNPAIRED and the same ``max_length``) are TRL's ``KL_input_ids`` /
    ``KL_attention_mask`` / ``KL_completion_mask``."""
    size = chunk_size or len(examples)
    if size < 1:
        raise ValueError(f"chunk_size must be >= 1, found {chunk_size}")
    out = []
    for start in range(0, len(examples), size):
        chunk = list(examples[start : start + size])
        for example, other in zip(chunk, [chunk[-1], *chunk[:-1]], strict=True):
            out.append(dataclasses.replace(example, completions=other.completions, loss_mask=None))
    return out


def extract_prompt(chosen: str | list, rejected: str | list) -> tuple[Any, Any, Any]:
    """TRL's ``extract_prompt``, quirks included: the prompt is the leading items (characters or messages) chosen
    and rejected share, less a space before the first difference; when neither differs within the shorter one,
    its last item still goes to the completions. Returns (prompt, chosen, rejected)."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def common_prefix_length(ids: Sequence[int], other: Sequence[int]) -> int:
    """Number of leading tokens ``ids`` and ``other`` share (TRL's ``common_prefix_length``)."""
    n = 0
    for a, b in zip(ids, other, strict=False):
        if a != b:
            break
        n += 1
    return n


def _sft_example(where: str, row: Mapping[str, Any], fmt: DataFormat, tokenizer: PreTrainedTokenizerBase,
                 eos: str | None, completion_only: bool, assistant_only: bool, max_length: int | None,
                 truncation: Truncation) -> Example | None:
    masks: list[list[int]] = []
    prompt_len = 0
    if fmt is DataFormat.PROMPT_COMPLETION:
        prompt, completion = row["prompt"], _with_eos(row["completion"], eos)
        prompt_ids, _ = _tokenize(tokenizer, prompt, row, generation_prompt=True)
        ids, assistant = _tokenize(tokenizer, prompt + completion, row, assistant_mask=assistant_only)
        prompt_len = common_prefix_length(prompt_ids, ids)
        if completion_only:
            masks.append([0] * prompt_len + [1] * (len(ids) - prompt_len))
    else:
        column = "text" if fmt is DataFormat.LANGUAGE_MODELING else "messages"
        ids, assistant = _tokenize(tokenizer, _with_eos(row[column], eos), row, assistant_mask=assistant_only)
    if assistant is not None:
        if 1 not in assistant:
            raise DataError(f"{where}: assistant_only_loss is on, but the chat template marks no token of this row "
                            "as the assistant's; check its {% generation %} markers or turn assistant_only_loss off")
        masks.append(assistant)
    mask = [int(all(bits)) for bits in zip(*masks, strict=False)] if masks else [1] * len(ids)
    if max_length is not None:
        start = max(len(ids) - max_length, 0) if truncation is Truncation.KEEP_END else 0
        ids, mask = ids[start : start + max_length], mask[start : start + max_length]
        prompt_len = min(max(prompt_len - start, 0), len(ids))
        if not any(mask):  # TRL drops examples truncation leaves without a label (it counts position 0 too)
            return None
    return Example(0, ids[:prompt_len], (ids[prompt_len:],), loss_mask=mask)


def _split_example(row: Mapping[str, Any], columns: tuple[str, ...], tokenizer: PreTrainedTokenizerBase,
                   eos: str | None, max_length: int | None, truncation: Truncation,
                   label: bool | None = None) -> Example | None:
    """DPO (chosen, rejected) and KTO (completion): prompt and completions split at the common prefix."""
    prompt = row["prompt"]
    prompt_ids, _ = _tokenize(tokenizer, prompt, row, generation_prompt=True)
    full = [_tokenize(tokenizer, prompt + _with_eos(row[c], eos), row)[0] for c in columns]
    prompt_len = min(common_prefix_length(prompt_ids, ids) for ids in full)
    if max_length is not None and truncation is Truncation.KEEP_START and prompt_len >= max_length:
        return None
    return Example(0, prompt_ids[:prompt_len], tuple(ids[prompt_len:] for ids in full), label=label)


def _reward_example(row: Mapping[str, Any], fmt: DataFormat, tokenizer: PreTrainedTokenizerBase, eos: str | None,
                    max_length: int | None) -> Example | None:
    prompt = row["prompt"] if fmt is DataFormat.PAIRED else row["chosen"][:0]
    full = [_tokenize(tokenizer, prompt + _with_eos(row[c], eos), row)[0] for c in ("chosen", "rejected")]
    if max_length is not None and max(len(ids) for ids in full) > max_length:
        return None
    margin = float(row["margin"]) if "margin" in row else None
    return Example(0, [], tuple(full), margin=margin)


def _tokenize(tokenizer: PreTrainedTokenizerBase, value: str | list, row: Mapping[str, Any], *,
              generation_prompt: bool = False, assistant_mask: bool = False) -> tuple[list[int], list[int] | None]:
    """TRL's ``_tokenize``: text through ``tokenizer(text=...)``, a chat through its template with the row's
    ``tools`` and ``chat_template_kwargs``. Returns the ids and, when asked for, the assistant-token mask."""
    if isinstance(value, str):
        return [int(i) for i in tokenizer(text=value)["input_ids"]], None
    tools = row.get("tools")
    kwargs: dict[str, Any] = {"tools": json.loads(tools) if isinstance(tools, str) else tools,
                              **(row.get("chat_template_kwargs") or {})}
    if generation_prompt:
        kwargs["add_generation_prompt"] = True
    if assistant_mask:
        kwargs["return_assistant_tokens_mask"] = True
    out = tokenizer.apply_chat_template(value, tokenize=True, return_dict=True, **kwargs)
    mask = out.get("assistant_masks") if assistant_mask else None
    return [int(i) for i in out["input_ids"]], None if mask is None else [int(m) for m in mask]


def _with_eos(value: str | list, eos: str | None) -> str | list:
    if eos is None or not isinstance(value, str) or value.endswith(eos):
        return value
    return value + eos


def _with_prompt(row: Mapping[str, Any], fmt: DataFormat) -> dict[str, Any]:
    """The row with a prompt: its own ``prompt`` column, or, in an implicit-prompt file, TRL's ``extract_prompt``."""
    if fmt is not DataFormat.PAIRED_IMPLICIT_PROMPT:
        return dict(row)
    prompt, chosen, rejected = extract_prompt(row["chosen"], row["rejected"])
    return {**row, "prompt": prompt, "chosen": chosen, "rejected": rejected}


def _unpair(rows: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """``unpair_preference_dataset`` through ``datasets.map(batched=True)``: per chunk, every chosen, then every
    rejected."""
    out = []
    for start in range(0, len(rows), DATASETS_MAP_BATCH):
        chunk = rows[start : start + DATASETS_MAP_BATCH]
        for column, label in (("chosen", True), ("rejected", False)):
            out += [(f"{w} ({column})", {**r, "completion": r[column], "label": label}) for w, r in chunk]
    return out


def _check_settings(kind: ExampleKind, max_length: int | None, truncation: Truncation,
                    completion_only_loss: bool | None, assistant_only_loss: bool, for_reward_model: bool) -> None:
    if max_length is not None and max_length < 1:
        raise ConfigError(f"max_length must be >= 1 token or None (no truncation), found {max_length}")
    if kind is not ExampleKind.SFT and (completion_only_loss is not None or assistant_only_loss):
        raise ConfigError(f"completion_only_loss / assistant_only_loss are SFT settings; {kind.value} examples take "
                          "the loss on the completion: leave them unset")
    if for_reward_model and kind is not ExampleKind.PREFERENCE:
        raise ConfigError(f"for_reward_model reads preference data; found kind {kind.value}")
    if truncation is Truncation.KEEP_END and (kind is ExampleKind.UNPAIRED or for_reward_model):
        raise ConfigError("truncation keep_end: TRL's KTO trainer keeps the start and its reward trainer drops "
                          "over-long pairs; use keep_start")


def _check_chat_settings(path: str, fmt: DataFormat, chat: bool, tokenizer: PreTrainedTokenizerBase,
                         completion_only_loss: bool | None, assistant_only_loss: bool) -> None:
    if completion_only_loss and fmt is not DataFormat.PROMPT_COMPLETION:
        raise ConfigError(f"{path}: completion_only_loss needs prompt/completion columns, found the {fmt.value!r} "
                          "format; leave it unset (loss on every token) or rewrite the data as prompt/completion")
    template = getattr(tokenizer, "chat_template", None)
    if chat and template is None:
        raise ConfigError(f"{path}: the rows hold chat messages, but the tokenizer has no chat template; use a "
                          "tokenizer with one or rewrite the data as text")
    if assistant_only_loss:
        if not chat:
            raise ConfigError(f"{path}: assistant_only_loss needs chat-message rows, found text; turn it off")
        if isinstance(template, dict):
            template = template.get("default", "")
        if not _GENERATION_MARKER.search(template):
            raise ConfigError(f"{path}: assistant_only_loss needs a chat template with {{% generation %}} markers "
                              "around the assistant's turns; this tokenizer's has none (TRL would substitute a "
                              "training template, megarl does not): add the markers or turn assistant_only_loss off")


def _check_row(where: str, row: Mapping[str, Any], fmt: DataFormat, chat: bool) -> None:
    missing = [c for c in fmt.columns if c not in row]
    if missing:
        raise DataError(f"{where}: no column {missing}; found {sorted(row)}; every row of a {fmt.value!r} file needs "
                        "those columns")
    for column in (c for c in fmt.columns if c in _TEXT_COLUMNS):
        value = row[column]
        ok = (isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)) if chat else (
            isinstance(value, str))
        if not ok:
            expected = "a list of chat messages {'role', 'content'}" if chat else "a text string"
            raise DataError(f"{where}: column {column!r} must be {expected} like the first row's, found "
                            f"{type(value).__name__} {str(value)[:80]!r}; make every column text or every one chat")
    if fmt is DataFormat.UNPAIRED and not isinstance(row["label"], bool):
        raise DataError(f"{where}: column 'label' must be true or false, found {row['label']!r}")


def _check_margins(rows: Sequence[tuple[str, Mapping[str, Any]]]) -> None:
    """The reward model's ``margin`` column: a number in every row, or in none."""
    has = "margin" in rows[0][1]
    for where, row in rows:
        margin = row.get("margin")
        if ("margin" in row) != has or (has and (isinstance(margin, bool) or not isinstance(margin, int | float))):
            raise DataError(f"{where}: column 'margin' must hold a number in every row or be absent from all (the "
                            f"first row {'has' if has else 'has none'}), found {margin!r}")


def _eos_token(tokenizer: PreTrainedTokenizerBase) -> str:
    eos = getattr(tokenizer, "eos_token", None)
    if not eos:
        raise ConfigError("the tokenizer has no eos_token, which TRL appends to text completions; set "
                          "tokenizer.eos_token")
    return eos


def _cut(values: list[int], max_length: int | None, truncation: Truncation) -> list[int]:
    if max_length is None:
        return values
    return values[-max_length:] if truncation is Truncation.KEEP_END else values[:max_length]
