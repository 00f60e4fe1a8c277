"""Fully asynchronous RL (``rollout.schedule: async``): the rollout pool generates all along into a bounded
buffer of finished prompt groups; the trainer takes ``data.batch_size`` groups per step.

:class:`RolloutProducer` is a thread of the driver. It draws a wave of ``data.batch_size`` prompts, generates
their ``n`` responses on the rollout pool call by call (:meth:`megarl.roles.split.RolloutRole.extend`) and
moves each group to the buffer once its responses are finished. The trainer pushes the policy's weights
every ``push_every`` updates (:meth:`RolloutProducer.push`); the cluster submits calls to the rollout ranks
one at a time (every rank gets them in the same order), so the push lands after the call in flight. With
partial rollouts (``partial_chunk_tokens``) a call adds at most that many tokens to each response, so a
push interrupts the responses in flight and the next call continues them under the new weights: it
prefills the prompt and the response so far again, so every token's log-prob is exactly the one of the
weights it was sampled with.
Each token keeps its version; a response's version (``policy_version``) is its oldest token's.

Staleness (``max_staleness`` = eta, versions between a sample's oldest token and the weights it trains):

* ``on_stale: wait``: a wave starts only while every group of it will be trained at most eta versions after
  the weights the engines hold now: with ``S`` groups started so far, ``B`` per step and engine version
  ``w``, a wave of ``k`` groups starts when ``S + k <= (w + eta + 1) * B``. The trainer takes groups in the
  order they were started, so group ``i`` trains at version ``floor(i / B) <= w + eta``. Groups the trainer takes
  and does not train (dynamic sampling) are not counted. A step that trains fewer than ``B`` groups (dynamic
  sampling short of informative groups, ``on_short: train``) breaks the promise: with dynamic sampling a group
  found staler than eta is dropped and counted, as in drop mode. (Pushing every
  ``K`` updates, this waits forever unless ``K <= eta + 1``: the config check says so.)
* ``on_stale: drop``: generation runs on while the buffer has room; a group found staler than eta when the
  trainer takes it is dropped and counted.

Checkpoints (:meth:`resume_state`): the buffer and the responses in flight are not saved. A checkpoint holds
the prompt sampler's state before the oldest wave with a group not yet trained or dropped, and which of
the prompts of that wave and the later ones were; a resumed run draws the same waves again, skips those
prompts and generates the rest anew from the checkpoint's weights.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from megarl.config.train import AsyncConfig, OnStale
from megarl.controller.handles import WorkerError
from megarl.data.batch import Batch, prompt_batch
from megarl.data.prompts import PromptDataset, PromptRecord, PromptSampler
from megarl.roles.results import WeightSync
from megarl.rollout.base import FINISH_LENGTH, FINISH_STOP, RolloutOutput, SamplingParams
from megarl.rollout.rows import Sampled, pad_routing, rollout_batch

logger = logging.getLogger(__name__)

Converse = Callable[[list[PromptRecord], int], tuple[Batch, Batch | None]]


@dataclasses.dataclass
class Response(Sampled):
    """One response to ``prompt``, continued call by call (:class:`megarl.rollout.rows.Sampled`; its routing covers
    prompt + tokens, each position as the call that first fed it routed it: the one whose KV every later token
    attended to)."""

    prompt: list[int] = dataclasses.field(default_factory=list)
    finish: str | None = None  # FINISH_STOP / FINISH_LENGTH once finished

    @property
    def interrupted(self) -> bool:
        """Continued across a weight push (its tokens come from more than one version)."""
        return len(set(self.versions)) > 1


@dataclasses.dataclass
class Group:
    """One prompt's ``n`` responses."""

    wave: int
    index: int  # the prompt's index in the dataset
    record: PromptRecord
    responses: list[Response]
    baseline: Response | None = None  # ReMax: the prompt's greedy response
    # multi-turn: the rows of its conversations (and ReMax's greedy one) as built once the wave's conversations ended
    rows_built: Batch | None = None
    baseline_built: Batch | None = None

    @property
    def done(self) -> bool:
        return all(r.finish is not None for r in self.rows)

    @property
    def rows(self) -> list[Response]:
        """Its responses and its greedy baseline (every row the producer generates for it)."""
        return self.responses + ([self.baseline] if self.baseline is not None else [])

    @property
    def oldest_version(self) -> int:
        if self.rows_built is not None:
            return int(self.rows_built["policy_version"].min())
        return min(v for r in self.responses for v in r.versions)


@dataclasses.dataclass
class _Wave:
    number: int
    sampler_state: dict  # the sampler before this wave was drawn
    indices: list[int]
    consumed: set[int] = dataclasses.field(default_factory=set)  # prompts trained or dropped

    @property
    def finished(self) -> bool:
        return len(self.consumed) == len(self.indices)


class RolloutProducer:
    """The generating thread and its buffer (module docstring). ``params(n, max_new_tokens, seed)`` gives a
    call's sampling parameters; ``skip``: per wave from the first, prompts a checkpoint says were consumed;
    ``greedy``: how ReMax's greedy baseline of each prompt samples (None: no baseline); ``converse``: multi-turn
    rollouts, a wave's conversations run to their end (``(records, seed) -> (rows, ReMax's greedy rows or None)``,
    :meth:`megarl.trainer.experience.Experience.converse`), one generation call per turn."""

    def __init__(self, *, cluster: Any, data: PromptDataset, sampler: PromptSampler, batch_size: int, n: int,
                 max_new_tokens: int, config: AsyncConfig, params: Callable[[int, int, int], SamplingParams],
                 version: int, seed: int, skip: list[list[int]] | None = None,
                 greedy: SamplingParams | None = None, converse: Converse | None = None,
                 short_steps: bool = False) -> None:
        self.cluster, self.data, self.sampler, self.config = cluster, data, sampler, config
        self.batch_size, self.n, self.max_new_tokens = batch_size, n, max_new_tokens
        self.params, self.seed, self.greedy, self.converse = params, seed, greedy, converse
        # a step may train fewer than batch_size groups (dynamic sampling, on_short: train): the wait rule's promise
        # then slips, and a group found staler than max_staleness is dropped and counted, as with on_stale: drop
        self.short_steps = short_steps
        self.skip = collections.deque(set(s) for s in skip or [])
        self.chunk = config.partial_chunk_tokens or max_new_tokens
        self.cond = threading.Condition()
        self.buffer: collections.deque[Group] = collections.deque()
        self.waves: collections.deque[_Wave] = collections.deque()  # drawn and not wholly consumed, oldest first
        self.engine_version = version
        self.started = version * batch_size  # groups started, numbered as the trainer takes them (wait rule)
        self.stopping = False
        self.error: BaseException | None = None
        self.counters = collections.Counter()  # since the last take: interrupted responses, waits
        self.dropped_total = 0
        self.wave_metrics: dict[str, float] = {}  # multi-turn: the conversation metrics of the latest wave finished
        self._sampler_state = sampler.state_dict()  # before the next wave's draw
        self.first_push = self._push(version)  # the engines need weights before the first call
        self.thread = threading.Thread(target=self._run, name="megarl-rollout-producer", daemon=True)
        self.thread.start()

    # --------------------------------------------------------------------------------- trainer side

    def push(self, version: int) -> WeightSync:
        """Push the policy's current weights (``version``) to the rollout pool; it takes them after the
        generation call in flight. Waits for the transfer."""
        self._raise_error()
        start = time.perf_counter()
        sync = self._push(version)
        with self.cond:
            self.counters["push_s"] += time.perf_counter() - start
        return sync

    def _push(self, version: int) -> WeightSync:
        try:
            sync = self.cluster.sync_weights(version)
        except Exception as e:
            if not (isinstance(e, WorkerError) and e.lost):  # a lost worker is the cause whatever the producer saw
                self._raise_error()  # the producer saw the failure first: its error is the cause
            raise
        with self.cond:
            self.engine_version = version
            self.cond.notify_all()
        return sync

    def take(self, version: int, count: int | None = None) -> tuple[list[Group], dict[str, float]]:
        """``count`` (default ``data.batch_size``) finished groups (oldest first) for a step training ``version``,
        waiting for the buffer where needed; groups staler than ``max_staleness`` are dropped (on_stale: drop)."""
        eta, taken, dropped = self.config.max_staleness, [], 0
        count = self.batch_size if count is None else count
        start = time.perf_counter()
        with self.cond:
            filled = len(self.buffer)
            while len(taken) < count:
                while not self.buffer and self.error is None:
                    self.cond.wait(1.0)
                self._raise_error()
                group = self.buffer.popleft()
                self._consume(group)
                if version - group.oldest_version > eta:
                    if self.config.on_stale is OnStale.WAIT and not self.short_steps:
                        raise RuntimeError(f"a prompt group sampled at version {group.oldest_version} reached the "
                                           f"trainer at version {version} (max_staleness={eta}, on_stale=wait): a bug "
                                           "in megarl's staleness rule")
                    dropped += 1
                    continue
                taken.append(group)
            self.cond.notify_all()  # room in the buffer
            counters, self.counters = self.counters, collections.Counter()
        self.dropped_total += dropped
        metrics = {"async/buffer_groups": float(filled), "async/dropped_groups": float(dropped),
                   "async/dropped_groups_total": float(self.dropped_total),
                   "async/interrupted_responses": float(counters["interrupted"]),
                   "async/trainer_wait_s": time.perf_counter() - start,
                   "async/rollout_wait_s": counters["rollout_wait_s"], "async/push_s": counters["push_s"],
                   "async/engine_version": float(self.engine_version)} | self.wave_metrics
        return taken, metrics

    def discard(self, count: int) -> None:
        """``count`` of the groups taken will not be trained (dynamic sampling): the staleness rule numbers the
        groups as the trainer trains them, so each discarded group lets one more start."""
        if count:
            with self.cond:
                self.started -= count
                self.cond.notify_all()

    def resume_state(self) -> tuple[dict, list[list[int]]]:
        """(the sampler's state a resume starts from, per wave from there: the prompts already consumed)."""
        with self.cond:
            waves = [w for w in self.waves if not w.finished]
            if not waves:
                return self._sampler_state, []
            first = self.waves.index(waves[0])
            return waves[0].sampler_state, [sorted(w.consumed) for w in list(self.waves)[first:]]

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join(timeout=600)

    def _consume(self, group: Group) -> None:
        wave = next(w for w in self.waves if w.number == group.wave)
        wave.consumed.add(group.index)
        while self.waves and self.waves[0].finished:
            self.waves.popleft()

    def _raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    # ------------------------------------------------------------------------------- producer side

    def _run(self) -> None:
        try:
            number = 0
            while True:
                wave = self._next_wave(number)
                if wave is None:
                    return
                self._generate(wave, number)
                number += 1
        except BaseException as e:  # noqa: BLE001 - handed to the trainer, which raises it
            logger.debug("rollout producer stopped by %s", e)
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _next_wave(self, number: int) -> list[Group] | None:
        """Draw the next wave, and start it once the buffer has room and the staleness rule allows; None when
        stopping. (A wave is recorded as drawn before it waits: a checkpoint meanwhile redraws it on resume.)"""
        skip = self.skip.popleft() if self.skip else set()
        start = time.perf_counter()
        with self.cond:
            state = self.sampler.state_dict()
            indices = self.sampler.next_batch(self.batch_size)
            self._sampler_state = self.sampler.state_dict()
            self.waves.append(_Wave(number, state, indices, consumed={i for i in indices if i in skip}))
            todo = [i for i in indices if i not in skip]
            while not self.stopping and not self._may_start(len(todo)):
                self.cond.wait(1.0)
            self.counters["rollout_wait_s"] += time.perf_counter() - start
            if self.stopping:
                return None
            self.started += len(todo)
            while self.waves and self.waves[0].finished:
                self.waves.popleft()
        records = self.data.select(todo)
        return [Group(number, i, rec, [Response(prompt=list(rec.input_ids)) for _ in range(self.n)],
                      Response(prompt=list(rec.input_ids)) if self.greedy is not None else None)
                for i, rec in zip(todo, records, strict=True)]

    def _may_start(self, size: int) -> bool:
        if len(self.buffer) + size > self.config.buffer_batches * self.batch_size:
            return False
        if self.config.on_stale is OnStale.WAIT:
            return self.started + size <= (self.engine_version + self.config.max_staleness + 1) * self.batch_size
        return True

    def _generate(self, groups: list[Group], wave: int) -> None:
        """Generate the wave call by call; each finished group goes to the buffer at once."""
        if self.converse is not None:
            return self._talk(groups, wave)
        pending = list(groups)
        call = 0
        while pending and not self.stopping:
            sampled = self._extend([g.responses for g in pending], self.n, wave, call, self.params)
            greedy = None if self.greedy is None else self._extend(
                [[g.baseline] for g in pending], 1, wave, call,
                lambda n, budget, seed: dataclasses.replace(self.greedy, n=n, max_new_tokens=budget))
            for rows, pending_call in (sampled, greedy or (None, None)):
                if rows is not None:
                    self._record(rows, pending_call.result())
            call += 1
            finished = [g for g in pending if g.done]
            if finished:
                pending = [g for g in pending if not g.done]
                with self.cond:
                    self.buffer.extend(finished)
                    self.counters["interrupted"] += sum(r.interrupted for g in finished for r in g.rows)
                    self.cond.notify_all()

    def _talk(self, groups: list[Group], wave: int) -> None:
        """Multi-turn: the wave's conversations, turn by turn (a push lands between two turns' calls; each model
        token keeps its version); its groups go to the buffer when they all ended."""
        rows, baseline = self.converse([g.record for g in groups], self.seed + 7_919 * wave)
        for i, g in enumerate(groups):
            g.rows_built = rows.index((rows["prompt_uid"] == i).nonzero().flatten())
            if baseline is not None:
                g.baseline_built = baseline.index([i])
        with self.cond:
            self.buffer.extend(groups)
            self.counters["interrupted"] += int((rows["rollout_versions"].amax(-1) > rows["policy_version"]).sum())
            self.wave_metrics = {k: v for k, v in rows.meta.get("metrics", {}).items() if k.startswith("multiturn/")}
            self.cond.notify_all()

    def _extend(self, responses: list[list[Response]], n: int, wave: int, call: int,
                params: Callable[[int, int, int], SamplingParams]) -> tuple[list[Response] | None, Any]:
        """Start the next call for the unfinished ones of ``responses`` (per group; ``n`` per group on the first
        call, which samples from the prompts): (those rows, the pending call), or (None, None) when all are done."""
        rows = [r for group in responses for r in group if r.finish is None]
        if not rows:
            return None, None
        first = call == 0
        prompts = [group[0].prompt for group in responses] if first else [r.prompt + r.tokens for r in rows]
        budget = min(self.chunk, max(self.max_new_tokens - len(r.tokens) for r in rows))
        seed = self.seed + 7_919 * wave + call
        return rows, self.cluster.extend_async(prompt_batch(prompts), params(n if first else 1, budget, seed))

    def _record(self, rows: list[Response], out: Batch) -> None:
        """Append each row's new tokens (cut to its remaining budget) and end the finished ones."""
        lengths, stopped, versions = out["lengths"].tolist(), out["stopped"].tolist(), out["policy_version"].tolist()
        tokens, log_probs = out["tokens"].tolist(), out["log_probs"].tolist()
        routing = out["routed_experts"] if "routed_experts" in out.tensors.keys() else None  # noqa: SIM118
        for i, (r, k, stop, version, toks, lps) in enumerate(zip(rows, lengths, stopped, versions, tokens, log_probs,
                                                                  strict=True)):
            keep = min(k, self.max_new_tokens - len(r.tokens))
            r.add(toks[:k], lps[:k], version, keep, None if routing is None else routing[i], before=len(r.prompt))
            if stop and keep == k:
                r.finish = FINISH_STOP
            elif len(r.tokens) >= self.max_new_tokens:
                r.finish = FINISH_LENGTH


def groups_batch(groups: list[Group], pad_token_id: int) -> Batch:
    """Training rows of ``groups`` (as :func:`megarl.rollout.rows.rollout_batch` builds them, or the conversations'
    rows; ``prompt_uid`` numbers the groups), with each token's ``rollout_versions`` and each row's
    ``policy_version`` (its oldest)."""
    if groups[0].rows_built is not None:
        return _numbered([g.rows_built for g in groups])
    return _rows(groups, [g.responses for g in groups], pad_token_id)


def baseline_batch(groups: list[Group], pad_token_id: int) -> Batch:
    """ReMax: each group's greedy response, one row per group in group order (fields as :func:`groups_batch`)."""
    if groups[0].baseline_built is not None:
        return _numbered([g.baseline_built for g in groups])
    return _rows(groups, [[g.baseline] for g in groups], pad_token_id)


def _numbered(parts: list[Batch]) -> Batch:
    batch = Batch.concat(parts)
    batch.tensors["prompt_uid"] = torch.cat([torch.full((len(p),), i, dtype=torch.long) for i, p in enumerate(parts)])
    return batch


def _rows(groups: list[Group], responses: list[list[Response]], pad_token_id: int) -> Batch:
    rows = [r for group in responses for r in group]
    width = max(len(r.tokens) for r in rows)

    def padded(values: list[list], value, dtype) -> torch.Tensor:
        return torch.tensor([v + [value] * (width - len(v)) for v in values], dtype=dtype)

    lengths = torch.tensor([len(r.tokens) for r in rows])
    routing = None
    if rows[0].routing:  # recorded from each row's first prompt token: laid out as the rows (unfed: experts 0..k-1)
        seq = max(len(r.prompt) + len(r.tokens) for r in rows)
        routing = torch.cat([pad_routing(torch.cat(r.routing)[None], seq) for r in rows])
    out = RolloutOutput(
        prompt_index=torch.tensor([i for i, group in enumerate(responses) for _ in group]),
        responses=padded([r.tokens for r in rows], pad_token_id, torch.long),
        response_mask=torch.arange(width)[None, :] < lengths[:, None],
        log_probs=padded([r.log_probs for r in rows], 0.0, torch.float32), response_lengths=lengths,
        finish_reasons=[r.finish for r in rows], versions=padded([r.versions for r in rows], 0, torch.long),
        routed_experts=routing)
    batch = rollout_batch([g.record.input_ids for g in groups], [out], pad_token_id)
    batch.tensors["prompt_uid"] = batch["prompt_index"]
    return batch
