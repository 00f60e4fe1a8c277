"""Prompt datasets: read ``.jsonl`` / ``.parquet`` rows, tokenize prompts, sample them by epoch.

Owns the path from a file of rows to :class:`PromptRecord`s (prompt, its token ids, and the row's
other columns, which travel unchanged to the reward function) and :class:`PromptSampler`, the
seeded, resumable order in which prompts are drawn. The prompt column holds either a text string
or a list of chat messages (``{"role", "content"}``). With ``apply_chat_template`` (and a tokenizer
that has a template) a text prompt becomes one user message and is tokenized by the chat template
with the generation prompt appended; otherwise text is encoded plainly. Prompts longer than
``max_prompt_length`` tokens are dropped and counted (``PromptDataset.num_filtered``), never
truncated. Prompts the tokenizer cannot represent are counted and warned about, and above
``max_unknown_token_share`` of the prompts loading fails: those whose tokens include the tokenizer's pad or
unknown id (e.g. letters for a digits-only character vocabulary; all prompts, ``PromptDataset.num_unknown``)
and those whose text does not survive a round trip through the tokenizer (``decode(encode(text))``, on an
evenly spread sample of up to :data:`ROUND_TRIP_SAMPLE` prompts, every message of a chat prompt: a tokenizer
that silently drops characters produces no unknown id). Given the model's vocabulary size, a prompt holding
a token id the model cannot embed fails loading. A malformed file or row raises :class:`DataError` naming
the file, the row and what was expected; a bad setting raises :class:`ConfigError`.

Pure module: torch for the sampler's permutations; the tokenizer is passed in; pyarrow is imported
only to read parquet. Must not import Ray, vLLM, torch.distributed or megarl layers above ``data``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from megarl.data.tokenizer import RoundTrip, describe_characters, round_trips
from megarl.errors import ConfigError, MegarlError, MissingDependencyError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

Messages = list[dict[str, Any]]  # [{"role": ..., "content": ...}, ...]
ROUND_TRIP_SAMPLE = 1024  # prompts whose text is round-tripped through the tokenizer at load, evenly spread


class DataError(MegarlError, ValueError):
    """A dataset file or row that megarl cannot use; the message names the file and the row."""


@dataclasses.dataclass(frozen=True)
class PromptConfig:
    """How rows become prompts (``data:`` in a run's YAML extends it with the files and batching)."""

    prompt_key: str = "prompt"  # the column holding a text prompt or a list of chat messages
    max_prompt_length: int = 512  # tokens (after the chat template); longer prompts are dropped and counted
    apply_chat_template: bool = True  # false: encode text prompts plainly (chat-message prompts then fail)
    # prompts the tokenizer cannot represent (pad/unknown token ids, or text that changes in a decode(encode(p))
    # round trip): warned up to this share, an error above; ids outside the model's vocabulary are always an error
    max_unknown_token_share: float = 0.05

    def __post_init__(self) -> None:
        if self.max_prompt_length < 1:
            raise ConfigError(f"max_prompt_length must be >= 1 token, found {self.max_prompt_length}")
        if not 0.0 <= self.max_unknown_token_share <= 1.0:  # NaN fails too
            raise ConfigError(f"max_unknown_token_share is a share of prompts in [0, 1], "
                              f"found {self.max_unknown_token_share}")


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    index: int  # position in the loaded (filtered) dataset
    prompt: str | Messages  # as the file holds it
    text: str  # the text prompt, or a chat prompt's last user message: what a reward function sees
    input_ids: list[int]  # the tokens the policy is prompted with
    row: dict[str, Any]  # every other column, passed to the reward function


class PromptDataset:
    """Loaded, tokenized and length-filtered prompts; ``num_filtered`` counts the dropped ones,
    ``num_unknown`` the loaded ones holding pad/unknown token ids."""

    def __init__(self, records: Sequence[PromptRecord], num_filtered: int, path: str, num_unknown: int = 0) -> None:
        self.records = list(records)
        self.num_filtered = num_filtered
        self.path = path
        self.num_unknown = num_unknown

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> PromptRecord:
        return self.records[index]

    def select(self, indices: Sequence[int]) -> list[PromptRecord]:
        return [self.records[i] for i in indices]


@runtime_checkable
class RowAdapter(Protocol):
    """Maps a raw dataset row to megarl's form (a prompt column + extra columns for the reward), e.g.
    GSM8K's ``{"question", "answer"}`` -> ``{"prompt": [...messages...], "answer": ...}``. Given in a
    config as ``data.row_adapter: path/to/file.py:function``."""

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]: ...


def load_row_adapter(spec: str) -> RowAdapter:
    from megarl.config.user_code import load_function

    return load_function(spec, "row adapter", ({},), "(row: dict) -> dict")


def load_prompts(path: str, cfg: PromptConfig, tokenizer: PreTrainedTokenizerBase,
                 adapter: RowAdapter | None = None, vocab_size: int | None = None) -> PromptDataset:
    """Read the file ``path`` (each row through ``adapter`` first, when given), validate and tokenize every
    row, drop (and count) over-long prompts, check that the tokenizer represents the prompts (pad/unknown ids,
    round trips: see the module docstring) and, given the model's ``vocab_size``, that it embeds every id."""
    rows = read_rows(path)
    if adapter is not None:
        rows = [(where, _adapt(adapter, row, where)) for where, row in rows]
    use_template = cfg.apply_chat_template and getattr(tokenizer, "chat_template", None) is not None
    if cfg.apply_chat_template and not use_template:
        logger.info("tokenizer has no chat template: text prompts from %s are encoded plainly", path)
    records: list[PromptRecord] = []
    wheres: list[str] = []  # each record's row location
    num_filtered = 0
    suspect = unknown_token_ids(tokenizer)
    unknown: list[int] = []  # records holding suspect ids
    for where, row in rows:
        prompt = _parse_prompt(row, cfg.prompt_key, where)
        if not isinstance(prompt, str) and not use_template:
            reason = "the tokenizer has no chat template" if cfg.apply_chat_template else "apply_chat_template is false"
            raise ConfigError(f"{where}: column {cfg.prompt_key!r} holds chat messages, but {reason}; "
                              "use text prompts or a tokenizer with a chat template")
        input_ids = encode_prompt(prompt, tokenizer, use_template)
        if len(input_ids) > cfg.max_prompt_length:
            num_filtered += 1
            continue
        extra = {k: v for k, v in row.items() if k != cfg.prompt_key}
        records.append(PromptRecord(len(records), prompt, _reward_text(prompt), input_ids, extra))
        wheres.append(where)
        if not suspect.keys().isdisjoint(input_ids):
            unknown.append(len(records) - 1)
    if num_filtered:
        logger.warning("%s: dropped %d of %d prompts longer than max_prompt_length=%d tokens",
                       path, num_filtered, len(rows), cfg.max_prompt_length)
    if not records:
        raise DataError(f"{path}: no prompts left: all {len(rows)} rows are longer than "
                        f"max_prompt_length={cfg.max_prompt_length} tokens; raise it or shorten the prompts")
    if vocab_size is not None:
        _check_id_range(path, records, wheres, tokenizer, vocab_size)
    _check_representable(path, cfg, records, wheres, unknown, suspect, tokenizer)
    logger.info("loaded %d prompts from %s", len(records), path)
    return PromptDataset(records, num_filtered, path, num_unknown=len(unknown))


def unknown_token_ids(tokenizer: PreTrainedTokenizerBase) -> dict[int, str]:
    """``{id: description}`` of the ids whose presence in a prompt means text the tokenizer could not
    represent: its unknown id and its pad id (a vocabulary without an unknown token often maps unknown
    characters to pad, as the demo's character tokenizer does). An id that is also the bos or eos id is
    left out: tokenizers that reuse eos as pad (Qwen2.5 base: ``<|endoftext|>``) or bos as pad have it
    inserted legitimately by their chat template or post-processor."""
    legitimate = {tokenizer.bos_token_id, tokenizer.eos_token_id} - {None}
    out: dict[int, str] = {}
    for kind in ("unk", "pad"):
        token_id = getattr(tokenizer, f"{kind}_token_id", None)
        if token_id is None or token_id in legitimate:
            continue
        token_id = int(token_id)
        name = f"{kind} {getattr(tokenizer, f'{kind}_token')!r}"
        out[token_id] = f"{out[token_id]}, {name}" if token_id in out else name
    return out


def _check_id_range(path: str, records: Sequence[PromptRecord], wheres: Sequence[str],
                    tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
    """Every prompt token id must be one the model embeds: an id at or above its ``vocab_size`` is not an
    unknown word but a tokenizer that is not the model's."""
    bad = [r.index for r in records if max(r.input_ids, default=0) >= vocab_size]
    if not bad:
        return
    first = records[bad[0]]
    ids = sorted({i for i in first.input_ids if i >= vocab_size})
    named = ", ".join(f"{i} ({tokenizer.convert_ids_to_tokens(i)!r})" for i in ids[:10])
    raise DataError(f"{path}: {len(bad)} of {len(records)} prompts hold token ids the model cannot embed (its "
                    f"config.json has vocab_size={vocab_size}); the first, {wheres[first.index]}, holds {named}: "
                    f"{_short(first.text)}. The tokenizer ({_tokenizer_name(tokenizer)}, {len(tokenizer)} tokens) is "
                    "not the one the model was built with: set model.tokenizer to a directory holding only the "
                    "model's own tokenizer files")


def _check_representable(path: str, cfg: PromptConfig, records: Sequence[PromptRecord], wheres: Sequence[str],
                         unknown: Sequence[int], suspect: Mapping[int, str],
                         tokenizer: PreTrainedTokenizerBase) -> None:
    """Warn about prompts holding ``suspect`` ids (all prompts) and prompts whose text a round trip through the
    tokenizer changes (a sample); raise when either share is above ``max_unknown_token_share``."""
    sample = _spread(len(records), ROUND_TRIP_SAMPLE)
    owners = [i for i in sample for _ in _texts(records[i].prompt)]
    texts = [t for i in sample for t in _texts(records[i].prompt)]
    changed: dict[int, RoundTrip] = {}  # record -> its first changed text
    for i, trip in zip(owners, round_trips(tokenizer, texts), strict=True):
        if not trip.exact:
            changed.setdefault(i, trip)
    if not unknown and not changed:
        return
    limit = cfg.max_unknown_token_share
    found = []
    if unknown:
        record = records[unknown[0]]
        ids = ", ".join(f"{name} (id {i})" for i, name in suspect.items())
        num_bad = sum(i in suspect for i in record.input_ids)
        found.append(f"{len(unknown)} of {len(records)} prompts ({len(unknown) / len(records):.1%}) hold pad/unknown "
                     f"token ids ({ids}), i.e. text the tokenizer cannot represent; the first, {wheres[record.index]}, "
                     f"has {num_bad} such ids among its {len(record.input_ids)} tokens: {_short(record.text)}")
    if changed:
        i, trip = next(iter(changed.items()))
        first = "the same prompt" if unknown and unknown[0] == i else f"the first, {wheres[i]}, {_short(trip.text)}"
        lost = list(dict.fromkeys(c for t in changed.values() for c in t.lost))
        found.append(f"{len(changed)} of {len(sample)} prompts checked ({len(changed) / len(sample):.1%}) change in a "
                     f"round trip through the tokenizer, decode(encode(text)) != text ({first} comes back as "
                     f"{_short(trip.decoded)})" + (f"; characters lost: {describe_characters(lost)}" if lost else ""))
    message = f"{path}: " + "; ".join(found) + f" (tokenizer {_tokenizer_name(tokenizer)})"
    if max(len(unknown) / len(records), len(changed) / len(sample)) > limit:
        raise DataError(f"{message}. That is above data.max_unknown_token_share={limit} ({limit:.1%}): use a "
                        "tokenizer that covers the text, fix the data, or raise data.max_unknown_token_share. A "
                        "tokenizer that is not the model's own shows as this too: set model.tokenizer to a directory "
                        "holding only the model's tokenizer files; a tokenizer built for the task (a character "
                        "vocabulary) must be rebuilt to cover these characters")
    logger.warning("%s; they train as the tokenizer encodes them (allowed up to max_unknown_token_share=%s)",
                   message, limit)


def _spread(n: int, k: int) -> list[int]:
    """Up to ``k`` indices of ``range(n)``, evenly spread (all of them when ``n <= k``)."""
    return list(range(n)) if n <= k else [i * n // k for i in range(k)]


def _texts(prompt: str | Messages) -> list[str]:
    """The text a prompt's writer wrote: the prompt, or every message's content (not the chat template's)."""
    return [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]


def _tokenizer_name(tokenizer: PreTrainedTokenizerBase) -> str:
    source = getattr(tokenizer, "name_or_path", "")
    return f"{type(tokenizer).__name__} from {source}" if source else type(tokenizer).__name__


def _adapt(adapter: RowAdapter, row: dict[str, Any], where: str) -> dict[str, Any]:
    try:
        out = adapter(dict(row))
    except Exception as e:
        raise DataError(f"{where}: the row adapter raised {type(e).__name__}: {e} (row: {_short(row)})") from e
    if not isinstance(out, dict):
        raise DataError(f"{where}: the row adapter returned a {type(out).__name__}, expected a dict of columns")
    return out


def encode_prompt(prompt: str | Messages, tokenizer: PreTrainedTokenizerBase, use_template: bool) -> list[int]:
    """Token ids of a prompt: through the chat template (generation prompt appended) or plainly."""
    if not use_template:
        if not isinstance(prompt, str):
            raise ConfigError("chat-message prompts need a chat template")
        return list(tokenizer.encode(prompt))
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding; 4.x returns the list of ids
    ids = out["input_ids"] if isinstance(out, Mapping) else out
    return [int(i) for i in ids]


def read_rows(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """``(location, row)`` for every row of a ``.jsonl`` or ``.parquet`` file; ``location`` names the
    file and the row (``file.jsonl:3`` is line 3; ``file.parquet row 2`` is the 0-based row index)."""
    path = Path(path)
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise ConfigError(f"prompt file {str(path)!r}: unknown extension {path.suffix!r}; "
                          f"expected one of {sorted(_READERS)}")
    if not path.is_file():
        raise ConfigError(f"prompt file {str(path)!r} does not exist")
    rows = reader(path)
    if not rows:
        raise DataError(f"prompt file {str(path)!r} holds no rows")
    return rows


def _read_jsonl(path: Path) -> list[tuple[str, dict[str, Any]]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno}); "
                                "expected one JSON object per line") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object per line, found {type(row).__name__}")
            rows.append((where, row))
    return rows


def _read_parquet(path: Path) -> list[tuple[str, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise MissingDependencyError("reading .parquet prompt files needs pyarrow: pip install pyarrow") from e
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises its own ArrowInvalid / OSError family
        raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from e
    return [(f"{path} row {i}", row) for i, row in enumerate(table.to_pylist())]


_READERS: dict[str, Callable[[Path], list[tuple[str, dict[str, Any]]]]] = {
    ".jsonl": _read_jsonl,
    ".parquet": _read_parquet,
}


def _parse_prompt(row: Mapping[str, Any], key: str, where: str) -> str | Messages:
    if key not in row:
        raise DataError(f"{where}: no prompt column {key!r}; found columns {sorted(row)}; set prompt_key")
    prompt = row[key]
    if isinstance(prompt, str):
        if not prompt:
            raise DataError(f"{where}: column {key!r} is an empty string; expected a prompt")
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise DataError(f"{where}: column {key!r} must be a text string or a non-empty list of chat messages "
                        f"{{'role', 'content'}}, found {_short(prompt)} ({type(prompt).__name__})")
    for i, message in enumerate(prompt):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise DataError(f"{where}: column {key!r} message {i} must be a dict with string 'role' and "
                            f"'content', found {_short(message)}")
    return prompt


def _reward_text(prompt: str | Messages) -> str:
    if isinstance(prompt, str):
        return prompt
    user = [m["content"] for m in prompt if m["role"] == "user"]
    return user[-1] if user else prompt[-1]["content"]


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class PromptSampler:
    """Seeded order of prompt indices, epoch by epoch; resumable to the exact position.

    Epoch ``e`` visits the indices in the permutation drawn by ``torch.Generator`` seeded with
    ``seed + e`` (identity order when ``shuffle`` is false). A batch never crosses an epoch boundary:
    when fewer than ``batch_size`` indices are left, they are skipped (drop-last) and the batch starts
    the next epoch. So a batch never holds the same prompt twice, and since every epoch has a new
    permutation, the skipped tail differs from epoch to epoch. :meth:`state_dict` holds
    ``(epoch, offset)``; a sampler loaded from it yields exactly the batches the saved one would have.
    """

    def __init__(self, num_samples: int, seed: int = 0, shuffle: bool = True) -> None:
        if num_samples < 1:
            raise ConfigError(f"a prompt sampler needs at least one prompt, found {num_samples}")
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0  # indices of ``epoch`` already handed out
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, permutation) cache

    def batches_per_epoch(self, batch_size: int) -> int:
        return self.num_samples // batch_size

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The permutation of ``range(num_samples)`` that epoch ``epoch`` visits."""
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))
            else:
                order = torch.arange(self.num_samples)
            self._order = (epoch, order)
        return self._order[1]

    def next_batch(self, batch_size: int) -> list[int]:
        """The next ``batch_size`` prompt indices (all distinct, from one epoch)."""
        if not 1 <= batch_size <= self.num_samples:
            raise ConfigError(f"batch size must lie in [1, {self.num_samples}] (the number of prompts), "
                              f"found {batch_size}")
        if self.offset + batch_size > self.num_samples:
            self.epoch, self.offset = self.epoch + 1, 0
        batch = self.epoch_order(self.epoch)[self.offset : self.offset + batch_size].tolist()
        self.offset += batch_size
        return batch

    def state_dict(self) -> dict[str, int | bool]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed,
                "num_samples": self.num_samples, "shuffle": self.shuffle}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state``'s position; its seed, dataset size and shuffle flag must match this sampler's."""
        expected = self.state_dict()
        if set(state) != set(expected):
            raise ConfigError(f"sampler state has keys {sorted(state)}, expected {sorted(expected)}")
        for key in ("seed", "num_samples", "shuffle"):
            if state[key] != expected[key]:
                raise ConfigError(f"sampler state was saved with {key}={state[key]!r}, this sampler has "
                                  f"{key}={expected[key]!r}: resuming would not continue the same sequence")
        if not (state["epoch"] >= 0 and 0 <= state["offset"] <= self.num_samples):
            raise ConfigError(f"sampler state position epoch={state['epoch']}, offset={state['offset']} "
                              f"is outside a dataset of {self.num_samples} prompts")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
