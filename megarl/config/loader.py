"""Strict dataclass loading from plain data (parsed YAML, dicts).

Unknown keys are errors that name the nearest valid key (a dataclass's ``REPLACED_KEYS`` class attribute maps a key
of an earlier release to what to write instead, its ``REFUSED_KEYS`` a key that a similar class takes but that does
nothing here to why, e.g. a frozen role's ``engine.optim``); values are checked against the field
types (int, float, str, bool, enums, Optional, nested dataclasses, ``dict[str, X]``, ``list[X]``);
defaults live only in the dataclass fields. Validation raises, it never rewrites. Pure module.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from megarl.errors import ConfigError

T = TypeVar("T")


def read_data(path: str | Path | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The plain data of YAML file ``path`` (or nothing) with ``a.b.c=value`` overrides applied (values parsed
    as YAML scalars), not yet checked against any dataclass."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError as e:
            raise ConfigError(f"config file {path} does not exist.") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path}: expected a mapping of sections (model:, data:, ...), "
                              f"found {type(data).__name__} {data!r:.80}.")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key.path=value (e.g. policy.optim.lr=1e-5).")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section.")
        node[parts[-1]] = yaml.safe_load(raw) if raw else ""
    return data


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; ``path`` prefixes error messages (e.g. ``placement.pools``)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or cls.__name__}: expected a mapping for {cls.__name__}, found {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    replaced = getattr(cls, "REPLACED_KEYS", {})  # keys of earlier releases -> what to write instead
    refused = getattr(cls, "REFUSED_KEYS", {})  # keys that would do nothing here -> why
    for key in data:
        if key in replaced:
            raise ConfigError(f"config key {_join(path, key)!r} was replaced: {replaced[key]}")
        if key in refused:
            given = _leaf_keys(data[key], _join(path, key))
            raise ConfigError(f"config key{'s' if len(given) > 1 else ''} {', '.join(map(repr, given))}: "
                              f"{refused[key]}.")
        if key not in fields:
            near = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else f"; valid keys: {sorted(fields)}"
            raise ConfigError(f"unknown config key {_join(path, key)!r}{hint}")
    kwargs = {key: _convert(hints[key], value, _join(path, key)) for key, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{path or cls.__name__}: {e}") from e


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _convert(option, value, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else
                          f"{path}: expected {' or '.join(map(_describe, options))}, found {value!r}")
    if dataclasses.is_dataclass(tp):
        return value if isinstance(value, tp) else from_dict(tp, value, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        valid = [m.value for m in tp]
        if value not in valid:
            raise ConfigError(f"{path}: {value!r} is not one of {valid}")
        return tp(value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, found {value!r}")
        return {k: _convert(args[1], v, _join(path, k)) for k, v in value.items()}
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, found {value!r}")
        return origin(_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp is Any or (isinstance(tp, type) and isinstance(value, tp) and not (tp is int and isinstance(value, bool))):
        return value
    raise ConfigError(f"{path}: expected {getattr(tp, '__name__', tp)}, found {value!r} ({type(value).__name__})")


def _describe(tp: Any) -> str:
    """A type as a config file spells its values: an enum by them (``'auto'``), else by name (``int``)."""
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " or ".join(repr(m.value) for m in tp)
    return getattr(tp, "__name__", str(tp))


def _leaf_keys(value: Any, path: str) -> list[str]:
    """The dotted keys a user set under ``path`` (``path`` itself for a value or an empty mapping)."""
    if not isinstance(value, dict) or not value:
        return [path]
    return [leaf for key, sub in value.items() for leaf in _leaf_keys(sub, _join(path, key))]


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)
