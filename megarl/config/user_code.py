"""User functions loaded from a Python file by path: ``"path/to/file.py:function"``.

Reward functions and dataset-row adapters are given this way in configs. The file is imported under
a module name unique to its resolved path (two files with the same base name never clash). Every
problem (no ``:``, no such file, the import fails, no such function, not callable, a signature that
cannot take the documented arguments) is a :class:`ConfigError` saying what was expected and found. A
reward function's signature is read by :mod:`megarl.rewards.conventions` instead, which accepts several.
Ship the spec string, not the function, to another process: the module lives only in the
``sys.modules`` of the process that loaded it. Pure module: standard library only.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from megarl.errors import ConfigError

logger = logging.getLogger(__name__)

SPEC_FORM = "'path/to/file.py:function_name'"


def load_function(spec: str, what: str, call_args: tuple[Any, ...] | None, signature_text: str) -> Callable[..., Any]:
    """Import ``path/to/file.py`` and return its attribute ``function`` (after the last ``:``), checking
    that it can be called with ``call_args`` (``signature_text`` describes them in errors; None: any signature,
    e.g. a tool the model calls with its own arguments, or a reward function: its signature picks how it is called)."""
    file_part, sep, name = spec.rpartition(":")
    if not sep or not file_part or not name:
        raise ConfigError(f"{what} spec {spec!r}: expected {SPEC_FORM}")
    path = Path(file_part).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"{what} spec {spec!r}: file {str(path)!r} does not exist; expected {SPEC_FORM}")
    module = _import_file(path, what)
    if not hasattr(module, name):
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ConfigError(f"{what} spec {spec!r}: {path.name} defines no {name!r}; its callables: {public}")
    fn = getattr(module, name)
    if not callable(fn):
        raise ConfigError(f"{what} spec {spec!r}: {name!r} in {path.name} is a {type(fn).__name__}, expected a "
                          f"function {signature_text}")
    if call_args is not None:
        _check_signature(fn, spec, what, call_args, signature_text)
    logger.info("loaded %s %s from %s", what, name, path)
    return fn


def _import_file(path: Path, what: str) -> ModuleType:
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"megarl_user_{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot import {str(path)!r} as a Python module; expected a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise ConfigError(f"importing {what} file {str(path)!r} failed: {type(e).__name__}: {e}") from e
    return module


def _check_signature(fn: Any, spec: str, what: str, call_args: tuple[Any, ...], signature_text: str) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C extensions have none: trust the call
        return
    try:
        signature.bind(*call_args)
    except TypeError as e:
        raise ConfigError(f"{what} {spec!r} has signature {signature}, which cannot be called as "
                          f"{signature_text}: {e}") from None
