"""The configuration reference (``docs/config.md``), generated from the config tree itself.

Every key of :class:`~megarl.config.train.TrainConfig` with its type, default and the comment written
beside its field in the source, section by section, with each section's docstring. A test keeps the
committed file equal to :func:`render`; regenerate it with ``python -m megarl.config.reference >
docs/config.md``. Pure module.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import io
import re
import sys
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
    for path, cls, default, note in _sections(TrainConfig, TrainConfig(), "", ""):
        out.append(f"\n## `{path}`{note}\n")
        doc = _doc(cls)
        if doc:
            out.append(doc + "\n")
        hints, comments = typing.get_type_hints(cls), _comments(cls)
        rows = [(f.name, _type_name(hints[f.name]), _value(getattr(default, f.name)), comments.get(f.name, ""))
                for f in dataclasses.fields(cls) if not _is_section(hints[f.name])]
        if rows:
            out.append("| key | type | default | meaning |\n|---|---|---|---|")
            out += [f"| `{name}` | {tp} | `{default}` | {text} |" for name, tp, default, text in rows]
    return "\n".join(out) + "\n"


def _sections(cls: type, default: Any, path: str, note: str) -> list[tuple[str, type, Any, str]]:
    """(dotted path, dataclass, its default value there, note) of ``cls`` and every section below it,
    depth first. A section's defaults are those of the instance its parent holds (e.g. training
    sampling draws 4 responses per prompt, validation sampling is greedy)."""
    found = [(path, cls, default, note)] if path else []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        sub = _section_class(tp)
        if sub is None:
            continue
        key = f"{path}.{f.name}" if path else f.name
        value = getattr(default, f.name)
        if typing.get_origin(tp) is dict:
            names = ", ".join(value) or "none"
            found += _sections(sub, sub(), f"{key}.<name>", f" (named entries; default: {names})")
        elif value is None:
            meaning = _comments(cls).get(f.name, "")
            found += _sections(sub, sub(), key, f" (optional, default null{'; ' + meaning if meaning else ''})")
        else:
            found += _sections(sub, value, key, "")
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


@functools.cache
def _comments(cls: type) -> dict[str, str]:
    """Each field's trailing ``# comment`` in the source of ``cls`` and its dataclass bases."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        source = inspect.getsource(klass)
        lines = source.splitlines()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type != tokenize.COMMENT:
                continue
            line = lines[tok.start[0] - 1]
            name = line.strip().split(":", 1)[0]
            if line.startswith("    ") and not line.startswith("     ") and name.isidentifier():
                out[name] = tok.string.lstrip("#").strip().replace("|", "\\|")
    return out


if __name__ == "__main__":
    sys.stdout.write(render())
