"""Rollout functions: a user's own generation loop over the rollout engines (``rollout.function``; slime's custom
generate), given by path like the other plug-ins (docs/programming.md §2).

A rollout function is ``fn(requests: list[RolloutRequest], ctx: RolloutContext) -> list[RolloutSample]``: one
request per response to produce (``rollout.sampling.n`` per prompt, grouped by prompt), one sample back for each, in
order. It calls ``ctx.generate(prompts)`` as often as it likes (each call one batched generation across the rollout
engines, at the weights they hold then) and lays out each sample as segments after its prompt: the model's tokens
(:meth:`RolloutSample.add_model`: trained, with the engine's log-probs and versions) and context it inserts itself
(:meth:`RolloutSample.add_context`: read by the model, not trained) -- a draft and its revision, a plan and an
answer, an answer and a tool's output. ``sample.reward`` (default 0) is added to the response's reward (as an
environment's), ``sample.text`` is what reward functions score (default: the last model segment's text).

The samples become training rows exactly as multi-turn conversations do (:func:`megarl.multiturn.rollout.
conversations_batch`), so every schedule runs them: sync, one step off (on a driver thread), async (the producer
calls the function for each wave; a push lands between two generation calls and each token keeps its version).
Before any worker starts, the run calls the function once with the real tokenizer and a stand-in ``generate``
(every call answers each prompt with the end-of-sequence token): a wrong signature, an exception or a wrong return
is a :class:`~megarl.errors.ConfigError` naming the file, the function, what was expected and what was found.

Pure module: the tokenizer, the rollout contract and the trajectory segments (no Ray, no torch.distributed).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from megarl.errors import ConfigError
from megarl.multiturn.rollout import FINISH_DONE, Conversation, Generate, ModelTurn, MultiTurnResult
from megarl.multiturn.trajectory import Segment, model_segment, record_routing
from megarl.rollout.base import SamplingParams

SIGNATURE = "fn(requests: list[RolloutRequest], ctx: RolloutContext) -> list[RolloutSample]"


@dataclasses.dataclass(frozen=True)
class RolloutRequest:
    """One response to produce: its prompt (``group``: the prompt's index in the call, the GRPO group)."""

    group: int
    prompt_ids: list[int]
    row: Mapping[str, Any]  # the dataset row's columns; "prompt": the prompt's text


class RolloutSample:
    """One training row: the request's prompt, then the segments the function adds, in order."""

    def __init__(self, request: RolloutRequest) -> None:
        self.group = request.group
        self.segments = [Segment("prompt", [int(i) for i in request.prompt_ids])]
        self.reward = 0.0  # added to the response's reward (logged as reward/environment_mean)
        self.text: str | None = None  # what reward functions score; None: the last model segment's text

    @property
    def ids(self) -> list[int]:
        return [i for s in self.segments for i in s.ids]

    def add_model(self, turn: ModelTurn | tuple[list[int], list[float]]) -> None:
        """Append tokens the model sampled (a ``ctx.generate`` result for this sample's prompt): trained."""
        turn = turn if isinstance(turn, ModelTurn) else ModelTurn(*turn)
        self.segments.append(model_segment(turn.ids, turn.log_probs, turn.version))
        if turn.routing is not None:  # MoE: the routing of the tokens this call fed, from the row's first
            record_routing(self.segments, turn.routing)

    def add_context(self, ids: Sequence[int]) -> None:
        """Append tokens the function inserts (an instruction, a tool's output): the model reads them, no loss."""
        self.segments.append(Segment("observation", [int(i) for i in ids]))


@dataclasses.dataclass
class RolloutContext:
    """What a rollout function generates with: ``generate(prompts, **changes)`` samples one continuation of each
    prompt (token ids) with the run's sampling parameters, ``changes`` replacing some (``max_new_tokens=8``,
    ``temperature=0``, ``stop_token_ids=[...]``); ``tokenizer`` (``encode``, ``decode``); ``stop_ids`` (the tokens
    that end a turn: eos and ``rollout.stop_token_ids``)."""

    tokenizer: Any
    stop_ids: tuple[int, ...]
    _generate: Generate
    _params: SamplingParams
    calls: int = 0
    generate_s: float = 0.0

    def generate(self, prompts: Sequence[Sequence[int]], **changes: Any) -> list[ModelTurn]:
        params = dataclasses.replace(self._params, n=1, **changes)
        params = dataclasses.replace(params, seed=None if params.seed is None else params.seed + self.calls)
        start = time.perf_counter()
        turns = self._generate([[int(i) for i in p] for p in prompts], params)
        self.calls, self.generate_s = self.calls + 1, self.generate_s + time.perf_counter() - start
        return [t if isinstance(t, ModelTurn) else ModelTurn(*t) for t in turns]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in self.stop_ids], skip_special_tokens=True)


def run_rollout_function(fn: Callable[..., Any], name: str, rows: Sequence[Mapping[str, Any]],
                         prompt_ids: Sequence[Sequence[int]], n: int, ctx: RolloutContext) -> MultiTurnResult:
    """``n`` samples per row from the rollout function ``fn``, as conversations (:func:`conversations_batch` lays
    them out); its returns are checked (:class:`ConfigError` naming ``name``)."""
    requests = [RolloutRequest(g, list(ids), row) for g, (ids, row) in enumerate(zip(prompt_ids, rows, strict=True))
                for _ in range(n)]
    samples = _called(fn, name, requests, ctx)
    convs = []
    for sample in samples:
        trajectory = _Trajectory(sample, ctx)
        convs.append(Conversation(row=sample.group, env=None, trajectory=trajectory, reward=float(sample.reward),
                                  turns=sum(s.kind == "model" for s in sample.segments), finish=FINISH_DONE))
    metrics = {"rollout_function/calls": float(ctx.calls), "timing/rollout_function_generate_s": ctx.generate_s}
    return MultiTurnResult(convs, metrics)


def _called(fn: Callable[..., Any], name: str, requests: list[RolloutRequest], ctx: RolloutContext) -> list:
    samples = fn(requests, ctx)
    where = f"rollout function {name!r}"
    if not isinstance(samples, list) or len(samples) != len(requests) or not all(
            isinstance(s, RolloutSample) for s in samples):
        found = (f"a list of {len(samples)}: {sorted({type(s).__name__ for s in samples})}"
                 if isinstance(samples, list) else type(samples).__name__)
        raise ConfigError(f"{where} returned {found}; expected a list of {len(requests)} RolloutSample, one per "
                          f"request in order ({SIGNATURE})")
    for k, (sample, request) in enumerate(zip(samples, requests, strict=True)):
        if sample.group != request.group or sample.segments[0].ids != request.prompt_ids:
            raise ConfigError(f"{where}: sample {k} is not its request's (prompt group {sample.group}, expected "
                              f"{request.group}); build each with RolloutSample(request), in the requests' order")
        if not any(s.kind == "model" and s.ids for s in sample.segments):
            raise ConfigError(f"{where}: sample {k} holds no model tokens (nothing to train on); add what "
                              "ctx.generate returned with sample.add_model(turn)")
    return samples


class _Trajectory:
    """A sample seen as a conversation's trajectory (what :func:`conversations_batch` reads)."""

    def __init__(self, sample: RolloutSample, ctx: RolloutContext) -> None:
        self.segments, self.ids = sample.segments, sample.ids
        self.prompt_length = len(sample.segments[0].ids)
        last = next(s.ids for s in reversed(sample.segments) if s.kind == "model")
        self.stopped = bool(last) and last[-1] in ctx.stop_ids
        self.final_text = sample.text if sample.text is not None else ctx.decode(last)


def check_rollout_function(fn: Callable[..., Any], name: str, tokenizer: Any, stop_ids: Sequence[int],
                           params: SamplingParams) -> None:
    """Call ``fn`` on two synthetic requests (two prompts of the tokenizer's own tokens) with a stand-in generate
    that answers each prompt with the first stop token: a :class:`ConfigError` when it raises or returns the wrong
    thing, before any worker starts."""
    stop = int(stop_ids[0]) if stop_ids else 0

    def stand_in(prompts: list[list[int]], _: SamplingParams) -> list[ModelTurn]:
        return [ModelTurn([stop], [-1.0]) for _ in prompts]

    ids = tokenizer.encode("1+1=", add_special_tokens=False) or [stop]
    requests = [RolloutRequest(g, list(ids), {"prompt": "1+1="}) for g in range(2)]
    ctx = RolloutContext(tokenizer, tuple(int(i) for i in stop_ids), stand_in, params)
    try:
        _called(fn, name, requests, ctx)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's function raised: say so, with what it was given
        raise ConfigError(f"rollout function {name!r} raised {type(e).__name__}: {e} when called on 2 synthetic "
                          f"requests (prompt '1+1=', a generate that answers with the stop token); expected "
                          f"{SIGNATURE}") from e
