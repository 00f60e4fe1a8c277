"""The environment protocol of multi-turn rollouts, and tools as an environment.

An environment plays the other side of a conversation. A user implements :class:`Environment` in a file of
their own and names it by path (``"path/to/env.py:MyEnv"``, like a reward function): megarl builds one per
conversation from the dataset row, asks it for the opening messages, and after every model turn hands it the
turn's text and takes back a :class:`Step`: the messages that answer it (``role`` ``tool`` or ``user``), a
reward for the turn, and whether the episode is over. The reward of a conversation is the sum of its turns'
rewards, plus the reward function's score of the model's last turn when one is configured.

:class:`ToolEnvironment` is the environment of tool calling: the model calls Python functions (given by path)
in the chat template's format -- Hermes/Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` --
each call's result comes back as a ``tool`` message, a malformed call (not JSON, an unknown tool, arguments
the function does not take, a function that raises) as a ``tool`` message saying what was wrong, counted in
:attr:`Step.errors` and described in :attr:`Step.error_details` (kept in the run's ``env_errors.jsonl``); a turn
without a call is the answer: it ends the episode.

Pure module: the standard library, megarl.errors and megarl.config.user_code.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from megarl.config.user_code import load_function
from megarl.errors import ConfigError, MegarlError
from megarl.multiturn.config import MultiTurnConfig
from megarl.multiturn.errors import EnvError, traceback_tail

Message = dict[str, Any]

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclasses.dataclass
class Step:
    """What an environment returns for one model turn."""

    messages: list[Message]  # the answer: tool results or the environment's reply (empty when done)
    reward: float = 0.0  # this turn's reward
    done: bool = False  # the episode is over: no further model turn
    errors: int = 0  # malformed tool calls (or other recoverable mistakes) in the turn, counted in the metrics
    # what those were (kind, text, traceback): kept in the run's env_errors.jsonl, the first of each kind logged
    error_details: list[EnvError] = dataclasses.field(default_factory=list)


@runtime_checkable
class Environment(Protocol):
    """One episode of a multi-turn rollout (a fresh instance per conversation)."""

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        """The opening messages of the conversation for dataset row ``row`` (at least one)."""

    def step(self, text: str) -> Step:
        """Answer the model's turn ``text`` (its decoded tokens, stop token excluded)."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """The Hermes/Qwen tool calls in ``text``: ``(calls, errors)``, one error message per malformed block."""
    calls, errors = [], []
    for body in _TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            errors.append(f"the tool call is not valid JSON ({e.msg} at character {e.pos}): {body[:200]!r}")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            errors.append(f'a tool call must be an object {{"name": ..., "arguments": {{...}}}}; found {body[:200]!r}')
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                errors.append(f"the arguments of tool {call['name']!r} are not a JSON object: {arguments[:200]!r}")
                continue
        if not isinstance(arguments, dict):
            errors.append(f"the arguments of tool {call['name']!r} must be a JSON object; found {arguments!r}")
            continue
        calls.append(ToolCall(call["name"], arguments))
    return calls, errors


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema a chat template announces for ``fn``: its name, docstring and parameters (typed from
    annotations where they are int/float/str/bool, else left open)."""
    types = {int: "integer", float: "number", str: "string", bool: "boolean"}
    names = {"int": "integer", "float": "number", "str": "string", "bool": "boolean"}
    properties, required = {}, []
    for name, p in inspect.signature(fn).parameters.items():
        annotation = p.annotation
        kind = types.get(annotation) or (names.get(annotation) if isinstance(annotation, str) else None)
        properties[name] = {"type": kind} if kind else {}
        if p.default is inspect.Parameter.empty:
            required.append(name)
    return {"type": "function", "function": {"name": fn.__name__, "description": inspect.getdoc(fn) or "",
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}


class ToolEnvironment:
    """Tool calling as an environment: the row's messages open the conversation, every ``<tool_call>`` in a model
    turn runs, and the first turn without a call ends the episode (the reward function scores that answer).

    ``tools``: name -> function; ``messages_key``: the row column holding the opening messages (a list of chat
    messages or a string)."""

    def __init__(self, tools: Mapping[str, Callable[..., Any]], *, messages_key: str = "prompt") -> None:
        self.tools = dict(tools)
        self.messages_key = messages_key

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        opening = row[self.messages_key]
        return [{"role": "user", "content": opening}] if isinstance(opening, str) else [dict(m) for m in opening]

    def step(self, text: str) -> Step:
        calls, malformed = parse_tool_calls(text)
        if not calls and not malformed:
            return Step([], done=True)
        messages = [{"role": "tool", "content": f"error: {e}"} for e in malformed]
        errors = [EnvError("malformed tool call", e) for e in malformed]
        for call in calls:
            result, error = self._run(call)
            messages.append({"role": "tool", "content": result if error is None else f"error: {error.message}"})
            errors += [error] if error else []
        return Step(messages, errors=len(errors), error_details=errors)

    def _run(self, call: ToolCall) -> tuple[str, EnvError | None]:
        """The call's result text, or what was wrong with it."""
        fn = self.tools.get(call.name)
        if fn is None:
            return "", EnvError("unknown tool", f"unknown tool {call.name!r}; tools: {sorted(self.tools)}")
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as e:
            return "", EnvError(f"bad arguments to tool {call.name}",
                                f"tool {call.name!r} cannot take the arguments {call.arguments}: {e}")
        try:
            result = fn(**call.arguments)
        except Exception as e:  # noqa: BLE001 - the model's call failed: it is told, and the error counted
            return "", EnvError(f"{type(e).__name__} in tool {call.name}",
                                f"tool {call.name!r} raised {type(e).__name__}: {e}", traceback_tail(e))
        return (result if isinstance(result, str) else json.dumps(result)), None


def environment_factory(config: MultiTurnConfig) -> tuple[Callable[[], Environment], list[dict[str, Any]] | None]:
    """(a function making one environment per conversation, the tool schemas the chat template announces) for
    ``rollout.multi_turn``: its tools (``"file.py:function"`` each) in a :class:`ToolEnvironment`, or its
    ``environment`` factory (``"file.py:Name"``, called with no arguments)."""
    if config.tools:
        loaded = [load_function(spec, "tool", None, "") for spec in config.tools]
        tools = {fn.__name__: fn for fn in loaded}
        if len(tools) != len(loaded):
            raise ConfigError(f"rollout.multi_turn.tools name two functions alike: {config.tools}; the model calls "
                              "a tool by its function's name")
        return (lambda: ToolEnvironment(tools)), [tool_schema(fn) for fn in tools.values()]
    if config.environment is None:
        raise ConfigError("rollout.multi_turn has neither an environment nor tools")
    factory = load_function(config.environment, "environment", (), "() -> Environment")

    def make() -> Environment:
        env = factory()
        if not isinstance(env, Environment):
            raise EnvironmentFailure(f"{config.environment} made a {type(env).__name__}, which lacks reset(row) or "
                                     "step(text); it must return an object with both (megarl.multiturn.Environment)")
        return env

    return make, None


class EnvironmentFailure(MegarlError):
    """An environment broke its contract (raised, returned something that is not a :class:`Step`, or messages a
    chat template cannot render)."""


def checked_step(step: Any, where: str) -> Step:
    """``step`` if it is a well-formed :class:`Step` (messages: dicts with string ``role`` and ``content``; a
    finite reward; messages unless done), else :class:`EnvironmentFailure` saying what was found."""
    if not isinstance(step, Step):
        raise EnvironmentFailure(f"{where} returned {type(step).__name__} {str(step)[:200]!r}; expected a "
                                 "megarl.multiturn.Step(messages, reward, done)")
    bad = [m for m in step.messages if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                                            and isinstance(m.get("content"), str))]
    if bad or not isinstance(step.messages, list):
        raise EnvironmentFailure(f"{where} returned messages a chat template cannot render: {str(bad[:2])[:200]}; "
                                 "expected a list of {'role': str, 'content': str}")
    if not isinstance(step.reward, (int, float)) or step.reward != step.reward or abs(step.reward) == float("inf"):
        raise EnvironmentFailure(f"{where} returned the reward {step.reward!r}; expected a finite number")
    if not step.done and not step.messages:
        raise EnvironmentFailure(f"{where} returned no messages for a turn that does not end the episode; return "
                                 "the reply, or done=True")
    if not isinstance(step.error_details, list) or not all(isinstance(e, EnvError) for e in step.error_details):
        raise EnvironmentFailure(f"{where} returned error_details {str(step.error_details)[:200]!r}; expected a list "
                                 "of megarl.multiturn.EnvError(kind, message)")
    return step
