"""Rule-based scorers (GSM8K, boxed math, integer answers) and the registry of built-in scorers.

Owns how a final answer is extracted from a response and from a ground truth, and how the two are
compared. Each scorer is a frozen dataclass whose fields are its options (the ground-truth column,
the scores); it reads its ground truth from ``row[answer_key]``. A ground truth that cannot be read
is an error (raised, so :func:`megarl.rewards.score_samples` reports the sample); a response without
an answer simply scores 0.

:data:`BUILTIN_REWARDS` maps exact keys to scorer classes; :func:`builtin_reward` builds one and
lists the valid keys for an unknown one. Pure module: standard library only.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import re
from collections.abc import Mapping
from typing import Any

from megarl.errors import ConfigError

# A number as written in prose: optional sign and currency, thousands separators, decimals.
_NUMBER = re.compile(r"-?\$?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")
_GSM8K_MARKER = "####"
_INTEGER = re.compile(r"-?\d+")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# Spacing / sizing commands and dollar signs that do not change a math answer's meaning.
_MATH_NOISE = re.compile(r"\\left(?![a-zA-Z])|\\right(?![a-zA-Z])|\\[,!;: ]|\$|\s")
_FRAC_VARIANTS = re.compile(r"\\[dt]frac(?![a-zA-Z])")


def parse_number(text: str) -> float:
    """``"$1,234."`` -> 1234.0: drop ``$``, thousands commas and a trailing period."""
    cleaned = text.strip().replace("$", "").replace(",", "").rstrip(".")
    return float(cleaned)


def extract_gsm8k_answer(text: str) -> str | None:
    """The number after the last ``####`` if there is one, else the last number in ``text``."""
    if _GSM8K_MARKER in text:
        match = _NUMBER.search(text.rsplit(_GSM8K_MARKER, 1)[1])
        if match:
            return match.group()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def extract_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces matched; None if absent
    or unbalanced."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, begin = 1, starts[-1]
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
    return None


def normalize_math(answer: str) -> str:
    """Remove whitespace, ``\\left``/``\\right``, thin spaces, ``$`` and a trailing period; read
    ``\\dfrac``/``\\tfrac`` as ``\\frac``."""
    return _FRAC_VARIANTS.sub(r"\\frac", _MATH_NOISE.sub("", answer)).rstrip(".")


def _ground_truth(row: Mapping[str, Any], key: str, scorer: str) -> Any:
    if key not in row:
        raise KeyError(f"{scorer} reads the ground truth from column {key!r}, but the row has only {sorted(row)}")
    return row[key]


@dataclasses.dataclass(frozen=True)
class GSM8KReward:
    """GSM8K: the response's final number (after ``####``, else its last number) equals the ground
    truth's (which carries ``#### 72`` itself, or is a bare number). ``format_score`` is given to a
    wrong answer that still used the ``####`` marker."""

    answer_key: str = "answer"
    correct_score: float = 1.0
    format_score: float = 0.0

    def __call__(self, prompt: str, response: str, row: Mapping[str, Any]) -> float:
        truth_text = str(_ground_truth(row, self.answer_key, "gsm8k"))
        truth = extract_gsm8k_answer(truth_text)
        if truth is None:
            raise ValueError(f"ground truth {truth_text[-80:]!r} in column {self.answer_key!r} holds no number")
        answer = extract_gsm8k_answer(response)
        if answer is None:
            return 0.0
        if math.isclose(parse_number(answer), parse_number(truth), rel_tol=1e-9, abs_tol=1e-9):
            return self.correct_score
        return self.format_score if _GSM8K_MARKER in response else 0.0


@dataclasses.dataclass(frozen=True)
class MathBoxedReward:
    """Exact match of the last ``\\boxed{...}`` against the ground truth, both normalised by
    :func:`normalize_math`. A ground truth that is itself a solution with ``\\boxed{}`` is reduced to
    its boxed part. ``format_score`` is given to a wrong answer that was boxed."""

    answer_key: str = "answer"
    correct_score: float = 1.0
    format_score: float = 0.0

    def __call__(self, prompt: str, response: str, row: Mapping[str, Any]) -> float:
        truth_text = str(_ground_truth(row, self.answer_key, "math_boxed"))
        truth = extract_boxed(truth_text)
        truth = normalize_math(truth_text if truth is None else truth)
        if not truth:
            raise ValueError(f"ground truth {truth_text[-80:]!r} in column {self.answer_key!r} is empty")
        answer = extract_boxed(response)
        if answer is None:
            return 0.0
        return self.correct_score if normalize_math(answer) == truth else self.format_score


class IntegerMatch(enum.Enum):
    """Which integer of a response :class:`IntegerAnswerReward` compares with the answer."""

    FIRST = "first"  # the first integer anywhere ("the answer is 7" and "7 because" both give 7): the default
    START = "start"  # the integer the response starts with (leading whitespace skipped), else no answer
    LAST = "last"  # the last integer anywhere: the final answer after any reasoning


@dataclasses.dataclass(frozen=True)
class IntegerAnswerReward:
    """The response's integer equals the row's integer answer (an int or a string like "7").

    ``match`` picks the integer (:class:`IntegerMatch`): ``first`` (default) anywhere, ``start`` only at the
    start of the response, ``last`` the final one. An integer is ``-?\\d+`` taken whole ("17" is not 7)."""

    answer_key: str = "answer"
    correct_score: float = 1.0
    match: IntegerMatch | str = IntegerMatch.FIRST

    def __post_init__(self) -> None:
        valid = [m.value for m in IntegerMatch]
        if not isinstance(self.match, IntegerMatch) and self.match not in valid:
            raise ConfigError(f"integer_answer option match={self.match!r}: expected one of {valid} (first: the "
                              "first integer anywhere, start: the one the response starts with, last: the final one)")
        object.__setattr__(self, "match", IntegerMatch(self.match))  # a YAML string as its member

    def __call__(self, prompt: str, response: str, row: Mapping[str, Any]) -> float:
        truth = _ground_truth(row, self.answer_key, "integer_answer")
        if isinstance(truth, bool) or not isinstance(truth, int | str):
            raise TypeError(f"column {self.answer_key!r}: expected an integer answer, found {truth!r}")
        expected = int(truth)  # a non-integer string raises ValueError, naming it
        if self.match is IntegerMatch.START:
            found = _INTEGER.match(response.lstrip())
            answer = found.group() if found else None
        else:
            answers = _INTEGER.findall(response)
            answer = (answers[0] if self.match is IntegerMatch.FIRST else answers[-1]) if answers else None
        return self.correct_score if answer is not None and int(answer) == expected else 0.0


BUILTIN_REWARDS: dict[str, type] = {
    "gsm8k": GSM8KReward,
    "math_boxed": MathBoxedReward,
    "integer_answer": IntegerAnswerReward,
}


def builtin_reward(key: str, **options: Any):
    """The built-in scorer registered as ``key``, built with ``options`` (its dataclass fields)."""
    if key not in BUILTIN_REWARDS:
        near = difflib.get_close_matches(str(key), list(BUILTIN_REWARDS), n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"unknown reward function {key!r}{hint}; built-in reward functions: "
                          f"{sorted(BUILTIN_REWARDS)}, or give 'path/to/file.py:function'")
    cls = BUILTIN_REWARDS[key]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ConfigError(f"reward function {key!r} has no options {unknown}; its options: {sorted(fields)}")
    return cls(**options)
