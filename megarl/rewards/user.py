"""Reward spec strings -> callables: a built-in key from :data:`megarl.rewards.rules.BUILTIN_REWARDS`,
or a user function given by path (``"path/to/file.py:function"``, loaded by
:mod:`megarl.config.user_code`, which names every problem as a ConfigError) wrapped for its calling
convention (:mod:`megarl.rewards.conventions`: row, keyword columns or TRL's batch style). Pure module.
"""

from __future__ import annotations

import logging
from typing import Any

from megarl.config.user_code import load_function
from megarl.errors import ConfigError
from megarl.rewards.base import RewardFunction
from megarl.rewards.conventions import FORMS, UserReward, adapt
from megarl.rewards.rules import BUILTIN_REWARDS, builtin_reward

logger = logging.getLogger(__name__)


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


def load_reward_function(spec: str) -> UserReward:
    """Import ``path/to/file.py`` by path and return its attribute ``function`` (the text after the last ``:``),
    wrapped for the calling convention its signature shows; a ConfigError if it fits none."""
    return adapt(load_function(spec, "reward function", None, f"in {FORMS}"), spec)
