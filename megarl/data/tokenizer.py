"""Tokenizers as they were saved, and whether a text survives a round trip through one.

:func:`load_tokenizer` is the one way megarl loads a tokenizer (the policy's, a reward model's, a teacher's).
``transformers.AutoTokenizer`` does not always return what was saved: transformers 5 replaces the class that
``tokenizer_config.json`` names by the one it registers for the ``model_type`` of a ``config.json`` in the same
directory when that model type is on its list of hub repositories with a wrong class (``qwen2`` is). A
``PreTrainedTokenizerFast`` / ``TokenizersBackend`` saved beside a Qwen2 config (a character vocabulary, say)
then comes back as a ``Qwen2Tokenizer``, which rebuilds a byte-level BPE pipeline around the saved vocabulary:
characters it cannot spell in that vocabulary (spaces included) vanish without an unknown id, and its default
``<|endoftext|>`` is added past the model's vocabulary. A generic class (``PreTrainedTokenizerFast``,
``TokenizersBackend``) means "exactly the pipeline in ``tokenizer.json``", so it is loaded as that class;
every other tokenizer (model-specific classes such as ``Qwen2Tokenizer``, sentencepiece files, remote code,
no ``tokenizer_config.json``) goes through ``AutoTokenizer`` as before, keeping its corrections of hub
repositories that name a wrong model-specific class.

:func:`round_trips` decodes the plain encoding of texts and names the characters a tokenizer loses, so
prompts a tokenizer would rewrite are refused before training (``megarl.data.prompts``).

Pure module: transformers is imported only inside :func:`load_tokenizer`; no Ray, vLLM or torch.distributed.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from megarl.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Classes that stand for the tokenizers library's own pipeline, saved whole in tokenizer.json.
GENERIC_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
# A directory holds a tokenizer when it has one of these (transformers 5 builds an empty Qwen2Tokenizer from a
# config.json alone, without complaint).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model",
                   "vocab.txt", "tekken.json")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in the directory ``path``, as its ``tokenizer_config.json`` names it (see the module
    docstring); :class:`ConfigError` naming the directory when none can be loaded."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # the latter is TokenizersBackend in 5.x

    path = Path(path)
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"no tokenizer in {path}: none of {', '.join(TOKENIZER_FILES)} is there; point "
                          "model.tokenizer at the directory holding the model's tokenizer files")
    saved = saved_tokenizer_class(path)
    try:
        if saved in GENERIC_CLASSES and (path / "tokenizer.json").is_file():
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"no tokenizer could be loaded from {path} ({type(e).__name__}: {e}); point model.tokenizer "
                          "at a directory holding tokenizer.json / tokenizer_config.json") from e
    logger.debug("tokenizer %s: %s (saved as %s)", path, type(tokenizer).__name__, saved)
    return tokenizer


def saved_tokenizer_class(path: str | Path) -> str | None:
    """``tokenizer_class`` of the directory's ``tokenizer_config.json`` (None: no file, no such key, remote code)."""
    file = Path(path) / "tokenizer_config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or "auto_map" in config:
        return None
    name = config.get("tokenizer_class")
    return name if isinstance(name, str) else None


@dataclasses.dataclass(frozen=True)
class RoundTrip:
    """``decoded`` is ``decode(encode(text))`` (no special tokens added, none skipped); ``lost`` the characters of
    ``text`` missing from it, each once, in order. Equal means equal after NFKC normalisation and with leading
    and trailing whitespace ignored: tokenizers normalise Unicode (Qwen's NFC) and sentencepiece decoders drop
    the leading space they prepend; byte-level BPE (Qwen2.5, Llama-3) round-trips exactly."""

    text: str
    decoded: str
    lost: tuple[str, ...] = ()

    @property
    def exact(self) -> bool:
        return _canonical(self.text) == _canonical(self.decoded)


def round_trips(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[RoundTrip]:
    """The round trip of each text through ``tokenizer``'s plain encoding (one batched encode and decode)."""
    if not texts:
        return []
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    decoded = tokenizer.batch_decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    specials = [t for t in tokenizer.all_special_tokens if t]
    out = []
    for text, back in zip(texts, decoded, strict=True):
        trip = RoundTrip(text, back)
        if not trip.exact:
            # an unknown/pad token standing for a character is one placeholder, not its letters ('<|pad|>' has an 'a')
            for token in specials:
                if token not in text:
                    back = back.replace(token, "\ufffd")
            trip = dataclasses.replace(trip, lost=lost_characters(text, back))
        out.append(trip)
    return out


def lost_characters(text: str, decoded: str) -> tuple[str, ...]:
    """Characters of ``text`` that the alignment with ``decoded`` deletes or replaces, each once, in order."""
    a, b = _canonical(text), _canonical(decoded)
    lost: dict[str, None] = {}
    for op, i1, i2, _, _ in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op in ("delete", "replace"):
            lost.update(dict.fromkeys(a[i1:i2]))
    return tuple(lost)


def describe_characters(chars: Sequence[str], limit: int = 20) -> str:
    """``' ' (space), 'a', '\\t' (tab)``: each character quoted, whitespace and invisible ones named."""
    parts = [_describe(c) for c in chars[:limit]]
    if len(chars) > limit:
        parts.append(f"and {len(chars) - limit} more")
    return ", ".join(parts)


_NAMES = {" ": "space", "\n": "newline", "\t": "tab", "\r": "carriage return"}


def _describe(char: str) -> str:
    if char in _NAMES:
        return f"{char!r} ({_NAMES[char]})"
    if char.isspace() or not char.isprintable():
        return f"{char!r} ({unicodedata.name(char, f'U+{ord(char):04X}')})"
    return repr(char)


def _canonical(text: str) -> str:
    return unicodedata.normalize("NFKC", text).strip()
