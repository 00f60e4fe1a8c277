"""Multi-turn rollouts (issue #25, in progress): a rollout as a conversation between the model and an environment
(tools, a game, a simulated user), kept as token ids end to end.

- :mod:`megarl.multiturn.config`  ``rollout.multi_turn``: the environment or tools, limits, error policy
- :mod:`megarl.multiturn.environment`  the :class:`Environment` protocol users implement, :class:`Step`, tool calls
  in the Hermes/Qwen format and :class:`ToolEnvironment` (Python functions as tools)
- :mod:`megarl.multiturn.trajectory`  :class:`Trajectory`: the model's sampled tokens as sampled, observations
  rendered by the chat template, the loss mask, the rollout log-probs and versions, MoE routing
- :mod:`megarl.multiturn.rollout`  the loop: conversations to their end, one generation call per turn,
  environment steps in a thread pool; the training rows
- :mod:`megarl.multiturn.errors`  :class:`EnvError` and :class:`EnvErrorLog`: environment and tool errors' texts in
  the run directory (``env_errors.jsonl``), the first of each kind in the log

Pure package: no Ray, no torch.distributed, no engine.
"""

from megarl.multiturn.config import MultiTurnConfig
from megarl.multiturn.environment import (
    Environment,
    EnvironmentFailure,
    Step,
    ToolCall,
    ToolEnvironment,
    checked_step,
    environment_factory,
    parse_tool_calls,
    tool_schema,
)
from megarl.multiturn.errors import EnvError, EnvErrorLog
from megarl.multiturn.trajectory import ChatRenderer, Segment, TemplateError, Trajectory

__all__ = [
    "ChatRenderer",
    "EnvError",
    "EnvErrorLog",
    "Environment",
    "EnvironmentFailure",
    "MultiTurnConfig",
    "Segment",
    "Step",
    "TemplateError",
    "ToolCall",
    "ToolEnvironment",
    "Trajectory",
    "checked_step",
    "environment_factory",
    "parse_tool_calls",
    "tool_schema",
]
