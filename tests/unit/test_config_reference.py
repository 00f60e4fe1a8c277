"""docs/config.md against the config sources: every key's description is its field's whole comment.

The comments are read here from the source files themselves (``ast`` for the fields, ``tokenize`` for the
comments), apart from the generator (:mod:`megarl.config.reference`), by the rule its docstring states: a
field's comment is the block of comment lines right above it, its trailing comment and the comment lines
right below that continue it (a block between two fields continues the upper one's trailing comment when
that is left open, an unclosed parenthesis or a final ``, ; : -``, or when no field follows; otherwise it
belongs to the lower field); a commentless enum field takes its enum's docstring summary. Two checks do not
depend on that rule: no comment line next to a field is lost (each lands in exactly one description of its
class), and the cases issue #40 found cut are pinned by hand. That the file is current (equal to what the
generator writes) is ``tests/unit/test_config_schema.py::test_config_reference_is_current``. CPU only, ~1 s.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import io
import re
import tokenize
import typing
from pathlib import Path

import pytest

from megarl.config.train import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "config.md"

# Keys whose field has no comment in its source yet (the reference shows an empty description): may only shrink.
KNOWN_UNDOCUMENTED: dict[str, str] = {}


# ------------------------------------------------------------------------------------ docs/config.md


def _unescape(text: str) -> str:
    return re.sub(r"\\([|<])", r"\1", text)


@functools.cache
def documented() -> dict[str, tuple[list[str], dict[str, str]]]:
    """Section path -> (its text lines, {key: description}) as docs/config.md states them."""
    sections: dict[str, tuple[list[str], dict[str, str]]] = {}
    text: list[str] = []
    keys: dict[str, str] = {}
    for line in DOC.read_text().splitlines():
        heading = re.match(r"## `([^`]+)`", line)
        if heading:
            text, keys = [], {}
            sections[heading.group(1)] = (text, keys)
        elif line.startswith("| `"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            keys[cells[0].strip("`")] = _unescape(cells[3])
        elif line and not line.startswith("|"):
            text.append(_unescape(line))
    return sections


# ------------------------------------------------------------------------------------ the config tree


def _section_type(tp: typing.Any) -> tuple[type | None, str]:
    """The dataclass a field of type ``tp`` nests (plain, optional or as dict values) and its path suffix."""
    if dataclasses.is_dataclass(tp):
        return tp, ""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    suffix = ""
    if typing.get_origin(tp) is dict:
        args, suffix = args[1:], ".<name>"
    if len(args) == 1 and dataclasses.is_dataclass(args[0]):
        return args[0], suffix
    return None, ""


def walk(cls: type = TrainConfig, path: str = "") -> list[tuple[str, type, str, str]]:
    """(kind "key" or "section", section path, the dataclass declaring the field, field name) of the tree."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        sub, suffix = _section_type(hints[f.name])
        if sub is None:
            out.append(("key", path, cls, f.name))
            continue
        child = (f"{path}.{f.name}" if path else f.name) + suffix
        out.append(("section", child, cls, f.name))
        out += walk(sub, child)
    return out


# ------------------------------------------------------------------------------------ the sources


@functools.cache
def _module(path: str) -> tuple[list[str], ast.Module, dict[int, tuple[int, str]]]:
    """A source file's lines, its syntax tree and its comments: line -> (column, text)."""
    source = Path(path).read_text()
    comments = {t.start[0]: (t.start[1], t.string.lstrip("#").strip())
                for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}
    return source.splitlines(), ast.parse(source), comments


@dataclasses.dataclass
class ClassComments:
    fields: list[tuple[str, int, int]]  # name, first line, last line
    trailing: dict[str, list[str]]  # a field's comments on its own lines
    blocks: list[list[tuple[int, str]]]  # runs of comment-only lines at the body's indentation


def class_comments(klass: type) -> ClassComments:
    lines, module, comments = _module(inspect.getsourcefile(klass))
    node = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == klass.__name__)
    fields = [(s.target.id, s.lineno, s.end_lineno) for s in node.body
              if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    indent = node.body[0].col_offset
    trailing = {name: [comments[n][1] for n in range(a, b + 1) if n in comments] for name, a, b in fields}
    blocks: list[list[tuple[int, str]]] = []
    number = node.body[0].lineno
    while number <= len(lines):  # the body, and comment lines after its last statement
        line = lines[number - 1]
        if line.strip() and len(line) - len(line.lstrip()) < indent:
            break
        if line.strip().startswith("#") and comments[number][0] == indent:
            if blocks and blocks[-1][-1][0] == number - 1:
                blocks[-1].append((number, comments[number][1]))
            else:
                blocks.append([(number, comments[number][1])])
        number += 1
    return ClassComments(fields, trailing, blocks)


def expected_descriptions(klass: type) -> dict[str, str]:
    """Field -> its whole comment, for the fields ``klass`` declares itself."""
    c = class_comments(klass)
    above: dict[str, list[str]] = {name: [] for name, _, _ in c.fields}
    below: dict[str, list[str]] = {name: [] for name, _, _ in c.fields}
    for block in c.blocks:
        first, last = block[0][0], block[-1][0]
        upper = [name for name, _, end in c.fields if end == first - 1]
        lower = [name for name, start, _ in c.fields if start == last + 1]
        own = " ".join(c.trailing[upper[0]]) if upper else ""
        left_open = own.count("(") > own.count(")") or own.endswith((",", ";", ":", "-"))
        if upper and (not lower or left_open):
            below[upper[0]] += [text for _, text in block]
        elif lower:
            above[lower[0]] += [text for _, text in block]
    out = {}
    for name, _, _ in c.fields:
        head, tail = " ".join(above[name]), " ".join(c.trailing[name] + below[name])
        if head and tail:
            out[name] = head + (" " if re.search(r"[.;:!?]\)?$", head) else ". ") + tail
        else:
            out[name] = head or tail
    return out


def expected(cls: type, name: str) -> str:
    """The description of field ``name`` of ``cls`` (declared there or in a dataclass base)."""
    text = ""
    for klass in cls.__mro__:
        if dataclasses.is_dataclass(klass) and name in klass.__dict__.get("__annotations__", {}):
            text = expected_descriptions(klass)[name]
            break
    tp = typing.get_type_hints(cls)[name]
    if not text and isinstance(tp, type) and issubclass(tp, enum.Enum) and tp.__dict__.get("__doc__"):
        summary = inspect.cleandoc(tp.__dict__["__doc__"]).split("\n\n")[0].replace("\n", " ")
        text = re.sub(r":\w+:`~?([\w.]+)`", r"`\1`", summary.replace("``", "`"))
    return text


# ------------------------------------------------------------------------------------ tests


def test_every_key_is_documented_with_its_whole_comment():
    docs = documented()
    wrong, undocumented = [], set()
    for kind, path, cls, name in walk():
        want = expected(cls, name)
        if kind == "section":
            text = docs[path][0]
            if want and (not text or text[0] != want):
                wrong.append(f"{path}: section text {text[:1]} != comment {want!r}")
            continue
        key = f"{path}.{name}"
        got = docs[path][1].get(name)
        if got != want:
            wrong.append(f"{key}:\n  docs:   {got!r}\n  source: {want!r}")
        if not want:
            undocumented.add(key)
    assert not wrong, "docs/config.md disagrees with the source comments:\n" + "\n".join(wrong)
    assert undocumented <= set(KNOWN_UNDOCUMENTED), (
        f"config keys without a comment in their source: {sorted(undocumented - set(KNOWN_UNDOCUMENTED))}; "
        "write one beside the field and run `python -m megarl.config.reference > docs/config.md`")
    # the walk and the parser saw the same tree: every section, every key
    assert set(docs) == {path for kind, path, _, _ in walk() if kind == "section"}
    assert sum(len(keys) for _, keys in docs.values()) == sum(kind == "key" for kind, _, _, _ in walk()) > 150


def test_every_comment_line_next_to_a_field_is_in_one_description():
    """Whatever block a comment belongs to, none of its lines is cut: each comment line touching a field (in
    the block right above or below it, or beside it) appears in exactly one description of its class."""
    docs = documented()
    descriptions: dict[type, dict[str, str]] = {}
    for kind, path, cls, name in walk():
        klass = next(k for k in cls.__mro__
                     if dataclasses.is_dataclass(k) and name in k.__dict__.get("__annotations__", {}))
        text = (docs[path][0] or [""])[0] if kind == "section" else docs[path][1][name]
        descriptions.setdefault(klass, {})[name] = text
    lost = []
    for klass, texts in descriptions.items():
        c = class_comments(klass)
        starts, ends = {a for _, a, _ in c.fields}, {b for _, _, b in c.fields}
        lines = [t for own in c.trailing.values() for t in own]
        lines += [t for block in c.blocks if block[0][0] - 1 in ends or block[-1][0] + 1 in starts for _, t in block]
        lost += [f"{klass.__name__}: {line!r}" for line in lines if sum(line in t for t in texts.values()) != 1]
    assert not lost, "comment lines missing from docs/config.md (or in several descriptions):\n" + "\n".join(lost)


@pytest.mark.parametrize("key, starts, ends", [
    # issue #40: these were cut after the first line or empty
    ("rollout.schedule", "sync | one_step_off | async (both overlap generation and training; they need "
     "cluster.placement.rollout on a pool of its own", "algorithm.rollout_correction weighting them)"),
    ("rollout.asynchronous.partial_chunk_tokens", "partial rollouts: tokens per generation call; a weight push "
     "lands between calls", "null: whole responses per call (a push waits for them)"),
    ("rollout.engine.prefix_cache_mb", "embedded engine: MB of finished rows' KV kept between calls",
     "vLLM keeps its own prefix cache in kv_cache_mb"),
    ("algorithm.policy_loss.aggregation", "How a `[batch, response_len]` loss matrix becomes a scalar", ""),
    # a block between two fields: the lower one's when the upper one's comment is complete
    ("algorithm.kl_estimator", "of KL(policy || reference): kl (k1), abs, mse (k2), low_var_kl (k3)", "(k3)"),
    ("algorithm.kl_clamp", "low_var_kl clamps its log-ratio to +-20", "false: unclamped k3 (TRL)"),
    ("algorithm.recompute_old_log_probs", "A training-model forward after each rollout",
     "null: only where needed (see above); true: always"),
])
def test_descriptions_cut_before_are_whole(key, starts, ends):
    path, name = key.rsplit(".", 1)
    got = documented()[path][1][name]
    assert got.startswith(starts) and got.endswith(ends), got
