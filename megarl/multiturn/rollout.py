"""The multi-turn rollout loop: many conversations at once, one generation call per turn, environment steps in a
thread pool.

Each dataset row opens ``n`` conversations (a GRPO group), each with its own environment. A turn generates one
model turn for every conversation still running (a single call to the rollout engine: the embedded engine or
vLLM, whose prefix cache holds the conversation so far), then hands every turn's text to its environment; those
calls run concurrently (``env_workers`` threads), so a slow tool holds up the turn only by its own duration, not
by the sum. A conversation ends when its environment says so, after ``max_turns`` model turns, or when its
trajectory would pass ``max_total_tokens`` tokens after the prompt. Its reward is the sum of its turns' rewards.

An environment that raises, exceeds ``env_timeout_s`` or returns something that is not a well-formed
:class:`~megarl.multiturn.environment.Step` follows ``on_env_error`` like a reward function: ``raise`` fails the
step with :class:`~megarl.multiturn.environment.EnvironmentFailure` naming the row and the turn; ``score`` ends
that conversation with ``env_error_score`` and counts it (``multiturn/env_errors``). A timed-out call cannot be
stopped (Python threads cannot be killed): its thread finishes in the background and its result is dropped.
What went wrong -- each scored failure and each tool error, its kind, text and traceback tail -- comes back in
:meth:`MultiTurnResult.errors`, for the run's ``env_errors.jsonl`` (:mod:`megarl.multiturn.errors`).

Pure module: a Hugging Face tokenizer, torch tensors and the rollout contract (no Ray, no torch.distributed).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from megarl.data.batch import Batch
from megarl.multiturn.config import MultiTurnConfig
from megarl.multiturn.environment import Environment, EnvironmentFailure, Step, checked_step
from megarl.multiturn.errors import EnvError, traceback_tail
from megarl.multiturn.trajectory import ChatRenderer, Trajectory
from megarl.rewards.base import OnError
from megarl.rollout.base import FINISH_LENGTH, FINISH_STOP, RolloutOutput, SamplingParams
from megarl.rollout.rows import Sampled, rollout_batch


class ModelTurn(NamedTuple):
    """One model turn as a generation call returns it (:data:`Generate`)."""

    ids: list[int]  # the sampled ids
    log_probs: list[float]  # the rollout engine's log-prob of each
    version: int | list[int] = 0  # the policy version of the weights that sampled them (or of each token)
    routing: Any = None  # MoE engines that record routing: [tokens fed, layers, top_k] of the row, from its first


# one model turn for each prompt: a ModelTurn, or an (ids, log_probs) pair (e.g. from RolloutOutput.token_lists and
# log_prob_lists); from a worker group's training rows: model_turns
Generate = Callable[[list[list[int]], SamplingParams], list[ModelTurn | tuple[list[int], list[float]]]]

FINISH_DONE = "done"  # the environment ended the episode
FINISH_TURNS = "turns"  # max_turns model turns
FINISH_TOKENS = "tokens"  # the token budget
FINISH_ERROR = "env_error"  # the environment failed (on_env_error: score)


@dataclasses.dataclass
class Conversation:
    row: int  # index of its dataset row in the call (its GRPO group)
    env: Environment
    trajectory: Trajectory
    reward: float = 0.0
    turns: int = 0
    tool_errors: int = 0
    finish: str | None = None  # one of the FINISH_* values once over
    error: EnvError | None = None  # the environment failure that ended it (on_env_error: score)
    problems: list[tuple[int, EnvError]] = dataclasses.field(default_factory=list)  # (model turn, tool error or
    # the failure that ended it), in order

    @property
    def truncated(self) -> bool:
        """Cut by a token budget (DAPO's truncated response, what ``algorithm.mask_truncated`` masks): the token
        budget ``max_total_tokens`` ended it, or it ended (the environment's ``done``, ``max_turns``) after a model
        turn that no stop token closed (cut at ``max_turn_tokens`` or at what was left of the budget). One ended by an
        environment failure is not: its reward is ``env_error_score``, the verdict on a failure."""
        if self.finish == FINISH_TOKENS:
            return True
        return self.finish in (FINISH_DONE, FINISH_TURNS) and not self.trajectory.stopped


@dataclasses.dataclass
class MultiTurnResult:
    conversations: list[Conversation]
    metrics: dict[str, float]

    def errors(self) -> list[dict[str, Any]]:
        """Every problem of every conversation, for :class:`megarl.multiturn.errors.EnvErrorLog`: ``conversation``
        (its index), ``row``, ``turn`` (the model turn the environment was answering, from 1), ``kind``, ``ended``
        (whether it ended the conversation: an environment failure; else a tool error the model was told of),
        ``message``, ``traceback``."""
        return [{"conversation": k, "row": c.row, "turn": turn, "kind": e.kind, "ended": e is c.error,
                 "message": e.message, "traceback": e.traceback}
                for k, c in enumerate(self.conversations) for turn, e in c.problems]


def run_conversations(rows: Sequence[Mapping[str, Any]], n: int, make_env: Callable[[], Environment],
                      renderer: ChatRenderer, generate: Generate, params: SamplingParams, config: MultiTurnConfig,
                      *, stop_ids: Sequence[int] = (), chunk_tokens: int | None = None) -> MultiTurnResult:
    """Run ``n`` conversations per row to their end (module docstring). ``params``: how each model turn samples
    (``n`` and ``max_new_tokens`` are set per turn; a seed advances per turn); ``stop_ids``: the tokens that end
    a model turn (eos, ``<|im_end|>``), added to ``params.stop_token_ids``; ``chunk_tokens``: partial rollouts, a
    model turn generated ``chunk_tokens`` at a time (:func:`_generate`)."""
    stop = tuple(sorted({*params.stop_token_ids, *(int(i) for i in stop_ids)}))
    waited = {"env_s": 0.0, "generate_s": 0.0}
    with concurrent.futures.ThreadPoolExecutor(config.env_workers, thread_name_prefix="megarl-env") as pool:
        convs = _open(rows, n, make_env, renderer, stop, config, pool, waited)
        for turn in range(config.max_turns):
            budget = {id(c): config.max_total_tokens - (len(c.trajectory.ids) - c.trajectory.prompt_length)
                      for c in convs}
            for c in convs:
                if c.finish is None and budget[id(c)] <= 0:
                    c.finish = FINISH_TOKENS
            active = [c for c in convs if c.finish is None]
            if not active:
                break
            start = time.perf_counter()
            outputs = _generate(generate, active, params, turn, stop, config, budget, chunk_tokens)
            waited["generate_s"] += time.perf_counter() - start
            texts = [c.trajectory.add_model_turn(t.ids, t.log_probs, version=t.version, routing=t.routing)
                     for c, t in zip(active, outputs, strict=True)]
            for c in active:
                c.turns += 1
            steps = _call_all(pool, [(c, c.env.step, (text,)) for c, text in zip(active, texts, strict=True)],
                              config, turn, waited)
            for c, step in zip(active, steps, strict=True):
                if step is not None:
                    _apply(c, step, turn, config)
    for c in convs:
        if c.finish is None:
            c.finish = FINISH_TURNS
    return MultiTurnResult(convs, _metrics(convs, waited))


def _open(rows, n, make_env, renderer, stop, config, pool, waited) -> list[Conversation]:
    envs = [make_env() for _ in range(len(rows) * n)]
    jobs = [(None, env.reset, (rows[i // n],)) for i, env in enumerate(envs)]
    opened = _call_all(pool, jobs, config, None, waited, rows=[i // n for i in range(len(envs))])
    convs = []
    for i, (env, messages) in enumerate(zip(envs, opened, strict=True)):
        if messages is None:  # failed with on_env_error: score -- a conversation with nothing to train
            raise EnvironmentFailure(f"the environment's reset failed for row {i // n}; there is no conversation "
                                     "to score (on_env_error: score covers turns, not the opening)")
        if not isinstance(messages, list) or not messages:
            raise EnvironmentFailure(f"the environment's reset for row {i // n} returned {str(messages)[:200]!r}; "
                                     "expected a non-empty list of chat messages")
        convs.append(Conversation(i // n, env, Trajectory(renderer, messages, stop_ids=stop)))
    return convs


def _generate(generate: Generate, active: list[Conversation], params: SamplingParams, turn: int,
              stop: tuple[int, ...], config: MultiTurnConfig, budget: dict[int, int],
              chunk: int | None) -> list[ModelTurn]:
    """One model turn for every active conversation (each prompt its trajectory so far): one engine call, or with
    ``chunk`` one call per ``chunk`` tokens (partial rollouts: a weight push may land between two of them; the
    next call continues the turn under the new weights, each token keeping its version)."""
    new = min(config.max_turn_tokens, max(budget[id(c)] for c in active))
    limit = [min(new, budget[id(c)]) for c in active]  # a row may not pass its own budget (a call takes the largest)
    turns = [Sampled() for _ in active]
    call = 0
    while pending := [k for k, t in enumerate(turns) if not _ended(t.tokens, limit[k], stop)]:
        size = max(limit[k] - len(turns[k].tokens) for k in pending)
        seed = None if params.seed is None else params.seed + 7_919 * turn + 104_729 * call
        call_params = dataclasses.replace(params, n=1, max_new_tokens=size if chunk is None else min(chunk, size),
                                          stop_token_ids=stop, seed=seed)
        out = generate([active[k].trajectory.ids + turns[k].tokens for k in pending], call_params)
        if len(out) != len(pending):
            raise RuntimeError(f"the rollout engine returned {len(out)} rows for {len(pending)} conversations")
        for k, got in zip(pending, out, strict=True):
            got = ModelTurn(*got)
            turns[k].add(got.ids, got.log_probs, got.version, min(len(got.ids), limit[k] - len(turns[k].tokens)),
                         got.routing, before=len(active[k].trajectory.ids))
        call += 1
    return [ModelTurn(t.tokens, t.log_probs, t.versions, torch.cat(t.routing) if t.routing else None) for t in turns]


def _ended(tokens: list[int], limit: int, stop: tuple[int, ...]) -> bool:
    return len(tokens) >= limit or (bool(tokens) and tokens[-1] in stop)


def _call_all(pool, jobs, config: MultiTurnConfig, turn: int | None, waited: dict, *, rows=None) -> list[Any]:
    """Run ``(conversation, fn, args)`` jobs concurrently; each result, or None for a failure handled by
    ``on_env_error: score`` (the conversation is ended with the error score)."""
    start = time.perf_counter()
    started: list[float | None] = [None] * len(jobs)  # when each call began: queued calls are not timed yet
    futures = [pool.submit(_timed, started, k, fn, args) for k, (_, fn, args) in enumerate(jobs)]
    results = []
    for k, ((conv, fn, _), future) in enumerate(zip(jobs, futures, strict=True)):
        row = conv.row if conv is not None else rows[k]
        where = f"{_name(fn)} (row {row}" + (f", turn {turn + 1})" if turn is not None else ", opening)")
        name = _name(fn)
        try:
            value = _result(future, started, k, config.env_timeout_s)
            if conv is not None:
                value = checked_step(value, where)
            results.append(value)
        except concurrent.futures.TimeoutError:
            timeout = f"{where} did not return within env_timeout_s={config.env_timeout_s}"
            results.append(_failure(conv, EnvError(f"timeout in {name}", timeout), config, turn))
        except EnvironmentFailure as e:
            results.append(_failure(conv, EnvError(f"invalid result from {name}", str(e)), config, turn))
        except Exception as e:  # noqa: BLE001 - the user's environment raised: the policy decides
            results.append(_failure(conv, EnvError(f"{type(e).__name__} in {name}",
                                                   f"{where} raised {type(e).__name__}: {e}", traceback_tail(e)),
                                    config, turn, cause=e))
    waited["env_s"] += time.perf_counter() - start
    return results


def _timed(started: list[float | None], k: int, fn: Callable[..., Any], args: tuple) -> Any:
    started[k] = time.monotonic()
    return fn(*args)


def _result(future: concurrent.futures.Future, started: list[float | None], k: int, timeout_s: float) -> Any:
    """The call's result, or TimeoutError once it has run ``timeout_s`` (its time in the pool's queue not counted)."""
    while True:
        begun = started[k]
        wait = 0.05 if begun is None else max(0.0, begun + timeout_s - time.monotonic())
        try:
            return future.result(timeout=wait)
        except concurrent.futures.TimeoutError:
            if begun is not None and time.monotonic() >= begun + timeout_s:
                raise


def _failure(conv: Conversation | None, error: EnvError, config: MultiTurnConfig, turn: int | None,
             cause: Exception | None = None):
    if config.on_env_error is OnError.RAISE or conv is None:
        raise EnvironmentFailure(f"{error.message} (multi-turn on_env_error: raise; set it to score to end the "
                                 f"conversation with env_error_score={config.env_error_score} and count it)") from cause
    conv.error, conv.reward, conv.finish = error, config.env_error_score, FINISH_ERROR
    conv.problems.append((turn + 1, error))
    return None


def _apply(c: Conversation, step: Step, turn: int, config: MultiTurnConfig) -> None:
    c.reward += float(step.reward)
    c.tool_errors += step.errors
    c.problems += [(turn + 1, e) for e in step.error_details]
    if step.done:
        c.finish = FINISH_DONE
        return
    if turn + 1 >= config.max_turns:
        c.finish = FINISH_TURNS
        return
    c.trajectory.add_observation(step.messages)
    if len(c.trajectory.ids) - c.trajectory.prompt_length >= config.max_total_tokens:  # no room left for a model turn
        c.trajectory.drop_observation()  # a trailing observation trains nothing
        c.finish = FINISH_TOKENS


def _name(fn: Any) -> str:
    owner = getattr(fn, "__self__", None)
    return f"{type(owner).__name__}.{fn.__name__}" if owner is not None else getattr(fn, "__qualname__", repr(fn))


def _metrics(convs: list[Conversation], waited: dict) -> dict[str, float]:
    count = max(len(convs), 1)
    total = waited["env_s"] + waited["generate_s"]
    out = {"multiturn/turns_mean": sum(c.turns for c in convs) / count,
           "multiturn/turns_max": float(max((c.turns for c in convs), default=0)),
           "multiturn/tool_errors": float(sum(c.tool_errors for c in convs)),
           "multiturn/env_errors": float(sum(c.finish == FINISH_ERROR for c in convs)),
           "multiturn/env_wait_share": waited["env_s"] / total if total > 0 else 0.0}
    for finish in (FINISH_DONE, FINISH_TURNS, FINISH_TOKENS):
        out[f"multiturn/finished_{finish}"] = float(sum(c.finish == finish for c in convs))
    return out


def conversations_batch(convs: Sequence[Conversation], pad_token_id: int) -> Batch:
    """Training rows ``[trajectory | pad]``, laid out by :func:`megarl.rollout.rows.rollout_batch` (the prompt
    segment, then the model's and the observations' segments as the continuation): ``input_ids``,
    ``attention_mask``, ``response_mask`` (1 on the model's tokens only: observations are context, not trained),
    ``rollout_log_probs`` and ``rollout_versions`` (token-aligned: entry i is the log-prob of token i and the policy
    version that sampled it, 0 off the model's tokens), ``policy_version`` (each row's oldest model token's
    version), ``prompt_uid`` (the row, for group baselines), ``environment_scores`` (each conversation's reward from
    its environment), ``response_lengths`` (the model's tokens: what ``response/length_*`` counts, as of a
    single-turn response) and ``observation_lengths`` (the environment's tokens between the model's turns:
    ``response/env_tokens_*``; the two add up to the tokens after the prompt, what ``max_total_tokens`` bounds),
    ``routed_experts`` when every model turn came with its routing (MoE: int16 ``[rows, width, layers, top_k]``,
    each token's experts from the call that first fed it, experts 0..k-1 where none fed it); non-tensor
    ``finish_reasons`` ("length" for a conversation cut by a token budget, :attr:`Conversation.truncated`, else
    "stop") and ``final_texts`` (the model's last turn, what a reward function scores)."""
    prompts = [c.trajectory.segments[0].ids for c in convs]
    after = [c.trajectory.segments[1:] for c in convs]  # each conversation's segments after its prompt
    width = max(sum(len(s.ids) for s in segments) for segments in after)

    def padded(per_segment: Callable[[Any], list], value, dtype) -> torch.Tensor:
        values = [[x for s in segments for x in per_segment(s)] for segments in after]
        return torch.tensor([v + [value] * (width - len(v)) for v in values], dtype=dtype)

    def model(field: str, other) -> Callable[[Any], list]:  # a model segment's field, ``other`` on observations
        return lambda s: getattr(s, field) if s.kind == "model" else [other] * len(s.ids)

    span = torch.tensor([sum(len(s.ids) for s in segments) for segments in after])
    routing = None
    if any(s.routing for c in convs for s in c.trajectory.segments):  # the engine records it: every row has it
        routing = _routing_rows(convs, max(len(c.trajectory.ids) for c in convs))
    out = RolloutOutput(prompt_index=torch.arange(len(convs)),
                        responses=padded(lambda s: s.ids, pad_token_id, torch.long),
                        response_mask=padded(lambda s: [s.kind == "model"] * len(s.ids), False, torch.bool),
                        log_probs=padded(model("log_probs", 0.0), 0.0, torch.float32), response_lengths=span,
                        finish_reasons=[FINISH_LENGTH if c.truncated else FINISH_STOP for c in convs],
                        versions=padded(model("versions", 0), 0, torch.long), routed_experts=routing)
    batch = rollout_batch(prompts, [out], pad_token_id)
    del batch.tensors["prompt_index"]
    batch.tensors["prompt_uid"] = torch.tensor([c.row for c in convs], dtype=torch.long)
    batch.tensors["environment_scores"] = torch.tensor([c.reward for c in convs], dtype=torch.float32)
    batch.tensors["observation_lengths"] = span - batch["response_lengths"]
    batch.non_tensors["final_texts"] = [c.trajectory.final_text for c in convs]
    return batch


def _routing_rows(convs: Sequence[Conversation], width: int) -> torch.Tensor:
    """[rows, width, layers, k]: each conversation's recorded routing (every token but its last, which no call fed,
    at least), then experts 0..k-1 (the contract of :attr:`megarl.rollout.base.RolloutOutput.routed_experts`)."""
    rows = [[torch.as_tensor(chunk) for s in c.trajectory.segments for chunk in s.routing] for c in convs]
    layers, k = next(chunks[0] for chunks in rows if chunks).shape[1:]
    out = torch.arange(k, dtype=torch.int16).expand(len(rows), width, layers, k).clone()
    for i, (c, chunks) in enumerate(zip(convs, rows, strict=True)):
        r = torch.cat(chunks) if chunks else out.new_zeros((0, layers, k))
        if r.shape[0] < len(c.trajectory.ids) - 1:
            raise RuntimeError(f"conversation {i} (row {c.row}) has the routed experts of {r.shape[0]} of its "
                               f"{len(c.trajectory.ids)} tokens; every token but the last was fed to the rollout "
                               "engine, whose routing must cover it (router replay)")
        out[i, : r.shape[0]] = r.to(torch.int16)
    return out


def model_turns(rows: Batch) -> list[ModelTurn]:
    """Each row's response ids, rollout log-probs, policy version and (MoE, when recorded) routing of the tokens
    it fed (all but its last), from single-turn training rows (:func:`megarl.rollout.rows.rollout_batch`): the
    :data:`Generate` contract over a worker group's generate."""
    masks = rows["response_mask"].bool().tolist()
    n = len(masks)
    versions = rows["policy_version"].tolist() if "policy_version" in rows.tensors else [0] * n
    routing = rows["routed_experts"] if "routed_experts" in rows.tensors else None
    fed = (rows["attention_mask"].sum(-1).long() - 1).tolist()
    return [ModelTurn([t for t, m in zip(ids, mask, strict=True) if m],
                      [lp for lp, m in zip(lps, mask, strict=True) if m], int(version),
                      None if routing is None else routing[i, : fed[i]])
            for i, (ids, lps, mask, version) in enumerate(zip(rows["input_ids"].tolist(),
                                                              rows["rollout_log_probs"].tolist(), masks, versions,
                                                              strict=True))]
