"""``rollout.multi_turn`` in a run's YAML: which environment a conversation talks to, and its limits. Pure."""

from __future__ import annotations

import dataclasses

from megarl.errors import ConfigError
from megarl.rewards.base import OnError


@dataclasses.dataclass(frozen=True)
class MultiTurnConfig:
    """Multi-turn rollouts (docs/multiturn.md): on when ``environment`` or ``tools`` is set."""

    environment: str | None = None  # "path/to/env.py:Factory": called once per conversation, returns an Environment
    tools: tuple[str, ...] = ()  # "path/to/tools.py:function" each: tool calling (megarl.multiturn.ToolEnvironment)
    max_turns: int = 4  # model turns per conversation
    max_total_tokens: int = 1024  # trajectory tokens after the prompt (model turns and observations)
    max_turn_tokens: int = 256  # new tokens per model turn
    env_timeout_s: float = 30.0  # one environment call (reset or step)
    on_env_error: OnError = OnError.RAISE  # raise: fail the step; score: end the conversation with env_error_score
    env_error_score: float = 0.0  # the reward of a conversation ended by an environment error (on_env_error: score)
    env_workers: int = 8  # environment calls in flight at once

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_total_tokens", "max_turn_tokens", "env_workers"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"rollout.multi_turn.{name} must be an integer >= 1; found {getattr(self, name)!r}")
        if not self.env_timeout_s > 0:
            raise ConfigError(f"rollout.multi_turn.env_timeout_s must be > 0; found {self.env_timeout_s!r}")
        if self.environment is not None and self.tools:
            raise ConfigError("rollout.multi_turn sets both environment and tools: tools make the tool-calling "
                              "environment; an environment of your own runs its tools itself. Set one.")

    @property
    def enabled(self) -> bool:
        return self.environment is not None or bool(self.tools)
