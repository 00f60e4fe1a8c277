"""The configuration reference (``docs/config.md``), generated from the config tree itself.

Every key of :class:`~megarl.config.train.TrainConfig` with its type, default and the whole comment written
with its field in the source, section by section, with each section's docstring. A field's comment is, in
source order: the block of comment lines right above it, its trailing comment, and the comment lines right
below that continue the trailing comment. A block between two fields continues the upper field's trailing
comment when that comment is left open (an unclosed parenthesis, a final ``,`` ``;`` ``:`` or ``-``) or no
field follows the block, and belongs to the lower field otherwise. A field without a comment whose type is an
enum takes its enum's docstring summary. A blank line ends a block; comments inside methods belong to no field.
Fields that are not init arguments (``init=False``) are not config keys and are left out. Tests keep the
committed file equal to :func:`render` and each description equal to its source comment; regenerate it with
``python -m megarl.config.reference > docs/config.md``. Pure module.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from typing import Any

from megarl.config.train import TrainConfig

HEADER = """# Configuration reference

Generated from the config dataclasses by `python -m megarl.config.reference > docs/config.md`; do not
edit by hand (a test fails when this file and the code differ). A run reads a YAML file of these keys
plus `key.path=value` overrides (`megarl train CONFIG [key=value ...]`); an unknown key is an error
naming the nearest valid one. `null` where a field allows it means "megarl decides": the decision is
written to `<output_dir>/config.yaml` (see `megarl/config/resolve.py`).
"""


def render() -> str:
    out = [HEADER]
    for path, cls, default, note, meaning in _sections(TrainConfig, TrainConfig(), "", "", ""):
        out.append(f"\n## `{path}`{note}\n")
        if meaning:
            out.append(_markdown(meaning) + "\n")
        doc = _doc(cls)
        if doc:
            out.append(doc + "\n")
        hints, comments = typing.get_type_hints(cls), _comments(cls)
        rows = [(f.name, _type_name(hints[f.name]), _value(getattr(default, f.name)), _cell(comments.get(f.name, "")))
                for f in _keys(cls) if not _is_section(hints[f.name])]
        if rows:
            out.append("| key | type | default | meaning |\n|---|---|---|---|")
            out += [f"| `{name}` | {tp} | `{default}` | {text} |" for name, tp, default, text in rows]
    return "\n".join(out) + "\n"


def _keys(cls: type) -> list[dataclasses.Field]:
    """The fields a config file may set (``init=False`` ones are computed, not keys)."""
    return [f for f in dataclasses.fields(cls) if f.init]


def _sections(cls: type, default: Any, path: str, note: str, meaning: str) -> list[tuple[str, type, Any, str, str]]:
    """(dotted path, dataclass, its default value there, note, the comment of its field) of ``cls`` and every
    section below it, depth first. A section's defaults are those of the instance its parent holds (e.g.
    training sampling draws 4 responses per prompt, validation sampling is greedy)."""
    found = [(path, cls, default, note, meaning)] if path else []
    hints, comments = typing.get_type_hints(cls), _comments(cls)
    for f in _keys(cls):
        tp = hints[f.name]
        sub = _section_class(tp)
        if sub is None:
            continue
        key = f"{path}.{f.name}" if path else f.name
        value, text = getattr(default, f.name), comments.get(f.name, "")
        if typing.get_origin(tp) is dict:
            names = ", ".join(value) or "none"
            found += _sections(sub, sub(), f"{key}.<name>", f" (named entries; default: {names})", text)
        elif value is None:
            found += _sections(sub, sub(), key, " (optional, default null)", text)
        else:
            found += _sections(sub, value, key, "", text)
    return found


def _section_class(tp: Any) -> type | None:
    if dataclasses.is_dataclass(tp):
        return tp
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is dict:
        args = args[1:]
    if typing.get_origin(tp) in (dict, typing.Union, types.UnionType) and len(args) == 1:
        return args[0] if dataclasses.is_dataclass(args[0]) else None
    return None


def _is_section(tp: Any) -> bool:
    return _section_class(tp) is not None


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " \\| ".join(f"`{m.value}`" for m in tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin in (dict, list, tuple):
        return f"{origin.__name__}[{', '.join('...' if a is Ellipsis else _type_name(a) for a in args)}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return str(list(value))
    if isinstance(value, str):
        return repr(value).replace("'", '"')
    return str(value)


def _doc(cls: type) -> str:
    own = cls.__dict__.get("__doc__")
    if not own or own.startswith(cls.__name__ + "("):  # dataclasses' generated signature
        return ""
    return re.sub(r":\w+:`~?([\w.]+)`", r"`\1`", inspect.cleandoc(own).replace("``", "`"))


def _markdown(text: str) -> str:
    """A comment as Markdown text: ``<`` escaped, or ``<output_dir>`` would read as an HTML tag."""
    return text.replace("<", "\\<")


def _cell(text: str) -> str:
    return _markdown(text).replace("|", "\\|")


@functools.cache
def _comments(cls: type) -> dict[str, str]:
    """Each field's whole comment (see the module docstring) in the source of ``cls`` and its dataclass
    bases, a subclass's own comment replacing its base's; for a field without one whose type is an enum,
    that enum's docstring summary."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            out.update(_class_comments(klass))
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if not out.get(f.name) and isinstance(tp, type) and issubclass(tp, enum.Enum):
            out[f.name] = _doc(tp).split("\n\n")[0].replace("\n", " ")
    return {name: text for name, text in out.items() if text}


def _class_comments(klass: type) -> dict[str, str]:
    """The comments of the fields ``klass`` declares in its own body."""
    source = textwrap.dedent(inspect.getsource(klass))
    lines = source.splitlines()
    body = ast.parse(source).body[0].body
    fields = [(s.target.id, s.lineno, s.end_lineno) for s in body
              if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    if not fields:
        return {}
    indent = body[0].col_offset
    trailing: dict[int, str] = {}
    blocks: list[list[int]] = []  # runs of comment-only lines at the body's indentation
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        line = tok.start[0]
        if lines[line - 1].strip().startswith("#"):
            if tok.start[1] != indent:
                continue
            if blocks and blocks[-1][-1] == line - 1:
                blocks[-1].append(line)
            else:
                blocks.append([line])
        else:
            trailing[line] = _text(tok.string)
    above: dict[str, list[str]] = {}
    below: dict[str, list[str]] = {}
    own = {name: [trailing[n] for n in range(first, last + 1) if n in trailing] for name, first, last in fields}
    for block in blocks:
        upper = next((name for name, _, last in fields if last == block[0] - 1), None)
        lower = next((name for name, first, _ in fields if first == block[-1] + 1), None)
        texts = [_text(lines[n - 1].strip()) for n in block]
        if upper is not None and (lower is None or _left_open(" ".join(own[upper]))):
            below.setdefault(upper, []).extend(texts)
        elif lower is not None:
            above.setdefault(lower, []).extend(texts)
    return {name: _joined(" ".join(above.get(name, [])), " ".join(own[name] + below.get(name, [])))
            for name, _, _ in fields}


def _text(comment: str) -> str:
    return comment.lstrip("#").strip()


def _left_open(comment: str) -> bool:
    """Whether a trailing comment goes on in the comment lines below it."""
    return comment.count("(") > comment.count(")") or comment.endswith((",", ";", ":", "-"))


def _joined(above: str, beside: str) -> str:
    if not above or not beside:
        return above or beside
    return f"{above} {beside}" if re.search(r"[.;:!?]\)?$", above) else f"{above}. {beside}"


if __name__ == "__main__":
    sys.stdout.write(render())
