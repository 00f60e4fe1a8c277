"""User reward functions loaded from a Python file by path (``"path/to/file.py:function"``).

Owns turning a reward spec string into a callable: a built-in key from
:data:`megarl.rewards.rules.BUILTIN_REWARDS`, or a file and a function name. The file is imported
under a module name unique to its resolved path, so two files that share a base name never clash.
Every problem (no ``:``, no such file, the file fails to import, no such function, not callable, a
signature that cannot take ``(prompt, response, row)``) is a :class:`ConfigError` naming what was
expected and what was found.

Ship the spec string, not the loaded function, to another process: the module lives only in the
``sys.modules`` of the process that loaded it. Pure module: standard library only.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import logging
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from megarl.errors import ConfigError
from megarl.rewards.base import RewardFunction
from megarl.rewards.rules import BUILTIN_REWARDS, builtin_reward

logger = logging.getLogger(__name__)

_SPEC_FORM = "'path/to/file.py:function_name'"


def resolve_reward_function(spec: str, **options: Any) -> RewardFunction:
    """A built-in key (``gsm8k``, ``math_boxed``, ``integer_answer``; ``options`` are its fields) or a
    ``"file.py:function"`` spec (which takes no options)."""
    if spec in BUILTIN_REWARDS or ":" not in spec:
        return builtin_reward(spec, **options)
    if options:
        raise ConfigError(
            f"reward function {spec!r} is loaded from a file and takes no options; found {sorted(options)}"
        )
    return load_reward_function(spec)


def load_reward_function(spec: str) -> RewardFunction:
    """Import ``path/to/file.py`` by path and return its attribute ``function`` (the text after the last ``:``)."""
    file_part, sep, name = spec.rpartition(":")
    if not sep or not file_part or not name:
        raise ConfigError(f"reward function spec {spec!r}: expected {_SPEC_FORM}")
    path = Path(file_part).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"reward function spec {spec!r}: file {str(path)!r} does not exist; expected {_SPEC_FORM}")
    module = _import_file(path)
    if not hasattr(module, name):
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ConfigError(f"reward function spec {spec!r}: {path.name} defines no {name!r}; its callables: {public}")
    fn = getattr(module, name)
    if not callable(fn):
        raise ConfigError(f"reward function spec {spec!r}: {name!r} in {path.name} is a "
                          f"{type(fn).__name__}, expected a function (prompt, response, row) -> float")
    _check_signature(fn, spec)
    logger.info("loaded reward function %s from %s", name, path)
    return fn


def _import_file(path: Path) -> ModuleType:
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"megarl_user_reward_{path.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot import {str(path)!r} as a Python module; expected a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise ConfigError(f"importing reward file {str(path)!r} failed: {type(e).__name__}: {e}") from e
    return module


def _check_signature(fn: Any, spec: str) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C extensions have none: trust the call
        return
    try:
        signature.bind("prompt", "response", {})
    except TypeError as e:
        raise ConfigError(f"reward function {spec!r} has signature {signature}, which cannot be called as "
                          f"(prompt, response, row): {e}") from None
