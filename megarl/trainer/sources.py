"""Where a step's training rows come from: one rollout source per schedule (``rollout.schedule``).

The trainer asks its source for the next batch (:meth:`RolloutSource.next_batch`) and never branches on the
schedule. A source owns the prompt position (its :class:`~megarl.data.prompts.PromptSampler`), the work in
flight and what a checkpoint keeps of them (:meth:`RolloutSource.state`, :meth:`RolloutSource.restore`):

* :class:`SyncSource` (``sync``): pushes the weights, generates and scores, in turn;
* :class:`OneStepOffSource` (``one_step_off``, rollout engines on a pool of their own): takes the rows generated
  during the previous step, pushes the newest weights and starts generating the next step's rows, which then
  runs while this step scores and trains;
* :class:`AsyncSource` (``async``): takes finished prompt groups from the buffer that the rollout pool fills all
  along (:class:`megarl.trainer.asynchronous.RolloutProducer`), pushing the weights every ``push_every`` updates.

Every source applies the same stages to what it generated, round by round (:class:`Rounds`): the rewards (rule
functions, reward model, DAPO's overlong shaping; ReMax's greedy baseline scored beside), then DAPO's dynamic
sampling, which keeps the prompt groups whose rewards differ and asks for more rounds until ``data.batch_size``
such groups are found or ``max_extra_rounds`` more rounds were sampled. A round is a draw of ``data.batch_size``
prompts (sync; one-step-off: the round generated ahead, then, when it was short, further rounds at the same
weights before the next push) or the groups taken from the asynchronous buffer (async: the producer draws more
prompts into the stream as groups are consumed). Every row carries ``policy_version``, the version of the
weights that generated it (version v: the weights after step v; with partial rollouts, its oldest token's).

A checkpoint's prompt position is where a resumed run draws again: prompts drawn for steps not trained yet (the
round generated ahead, the asynchronous waves in flight) are drawn and generated again from the checkpoint's
weights; prompts already trained are not.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from megarl.algos.dapo import ShortBatch
from megarl.algos.plugins import GROUP_FILTER, checked_keep, resolve
from megarl.config.resolve import sampling_params
from megarl.config.train import Role, Schedule, TrainConfig
from megarl.data.batch import Batch
from megarl.data.examples import Example, ExampleKind, example_rows, kl_examples
from megarl.data.prompts import PromptDataset, PromptRecord, PromptSampler
from megarl.errors import MegarlError
from megarl.trainer.asynchronous import RolloutProducer, groups_batch
from megarl.trainer.experience import Experience, Generation

logger = logging.getLogger(__name__)

Timer = Callable[[str], contextlib.AbstractContextManager[None]]


class ShortBatchError(MegarlError):
    """Dynamic sampling found too few informative prompt groups and ``on_short: fail`` was set."""


class Rounds:
    """One step's rounds: each round's scored rows kept, and (with dynamic sampling) which of its prompt groups
    have differing rewards; :meth:`result` is the step's batch and its rollout and reward metrics."""

    def __init__(self, cfg: TrainConfig, experience: Experience) -> None:
        self.cfg, self.experience = cfg, experience
        self.filter = cfg.algorithm.dynamic_sampling
        self.want = cfg.data.batch_size
        self.batches: list[Batch] = []
        self.informative: list[torch.Tensor] = []
        self.groups = self.found = self.errors = 0
        self.metrics: dict[str, float] = {}  # the weight syncs' of this step

    @property
    def done(self) -> bool:
        """No further round: without dynamic sampling after one; with it, once enough groups differ or the extra
        rounds are spent."""
        if not self.batches:
            return False
        if self.filter is None:
            return True
        return self.found >= self.want or self.groups >= self.budget

    @property
    def budget(self) -> int:
        """Prompt groups a step may sample with dynamic sampling: ``1 + max_extra_rounds`` rounds' worth, whether
        they come as whole rounds (sync, one-step-off) or as takes of what is missing (async)."""
        return (1 + self.filter.max_extra_rounds) * self.want

    @property
    def needed(self) -> int:
        """Prompt groups the next round should bring (async takes this many from the buffer)."""
        return self.want if self.filter is None else max(min(self.want - self.found, self.budget - self.groups), 1)

    def add(self, batch: Batch, num_groups: int, num_errors: int) -> int:
        """A scored round of ``num_groups`` groups (``prompt_uid`` 0..num_groups-1); how many of them dynamic
        sampling will not train (0 without it)."""
        dropped = 0
        if self.filter is not None:
            criterion = resolve(GROUP_FILTER, self.filter.criterion)
            informative = checked_keep(criterion(batch["scores"], batch["prompt_uid"], num_groups), num_groups,
                                       criterion.name)
            self.informative.append(informative)
            self.found += int(informative.sum())
            dropped = num_groups - int(informative.sum())
        batch.tensors["prompt_uid"] = batch["prompt_uid"] + self.groups  # numbers the groups of all rounds
        self.batches.append(batch)
        self.groups += num_groups
        self.errors += num_errors
        return dropped

    def result(self) -> tuple[Batch, dict[str, float]]:
        full = _concat(self.batches)
        exp = self.experience
        metrics = self.metrics | exp.rollout_metrics(full) | exp.reward_metrics(full, "reward", self.errors)
        if self.filter is None:
            return full, metrics
        return self._keep_informative(full, torch.cat(self.informative), metrics)

    def _keep_informative(self, batch: Batch, informative: torch.Tensor,
                          metrics: dict[str, float]) -> tuple[Batch, dict[str, float]]:
        """The first ``data.batch_size`` informative groups (fewer, trimmed to divide into the mini-batches,
        when sampling ran out), renumbered 0..k-1."""
        a, n, rounds = self.cfg.algorithm, self.cfg.rollout.sampling.n, len(self.batches)
        sampled = len(informative)
        kept = informative.nonzero().flatten().tolist()
        counts = {"dynamic/rounds": float(rounds), "dynamic/groups_sampled": float(sampled),
                  "dynamic/groups_kept": float(len(kept)), "dynamic/groups_dropped": float(sampled - len(kept))}
        if len(kept) < self.want:
            if self.filter.on_short is ShortBatch.FAIL:
                raise ShortBatchError(
                    f"dynamic sampling found {len(kept)} prompt groups with differing rewards in {rounds} rounds "
                    f"({sampled} prompts), fewer than data.batch_size={self.want}, and "
                    "algorithm.dynamic_sampling.on_short=fail. Raise max_extra_rounds, use on_short: train, or check "
                    "that the rewards can differ (all correct or all wrong for every prompt).")
            dps = [self.cfg.cluster.layout(r).dp for r in self.cfg.roles() if r in (Role.POLICY, Role.CRITIC)]
            step = math.lcm(*dps) * a.mini_batches  # the updates split the rows into this many parts
            while kept and (len(kept) * n) % step:
                kept.pop()
        kept = kept[: self.want]
        counts |= {"dynamic/groups_trained": float(len(kept)), "dynamic/short": float(len(kept) < self.want)}
        if not kept:
            return batch.index([]), metrics | counts
        rows = torch.cat([(batch["prompt_uid"] == uid).nonzero().flatten() for uid in kept])
        out = batch.index(rows)
        renumber = torch.full((sampled,), -1, dtype=torch.long)
        renumber[torch.tensor(kept)] = torch.arange(len(kept))
        out.tensors["prompt_uid"] = renumber[out["prompt_uid"]]
        return out, metrics | counts


class RolloutSource(abc.ABC):
    """The rows a step trains on (module docstring); owns the prompt sampler and the work in flight."""

    def __init__(self, cfg: TrainConfig, cluster: Any, experience: Experience, data: PromptDataset) -> None:
        self.cfg, self.cluster, self.experience, self.data = cfg, cluster, experience, data
        self.sampler = PromptSampler(len(data), seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)

    @abc.abstractmethod
    def next_batch(self, step: int, timer: Timer) -> tuple[Batch, dict[str, float]]:
        """Step ``step``'s rows (grouped by prompt, ``prompt_uid`` numbering the groups from 0) with ``scores``,
        and the step's weight-sync, rollout and reward metrics. The policy holds the weights of version
        ``step - 1``; the rollout engines hold them when generating this step's fresh rows."""

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: where a resumed run draws prompts again (``sampler``) and, per asynchronous
        wave from there, the prompts already consumed (``async_skip``)."""
        return {"sampler": self.sampler.state_dict(), "async_skip": []}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's :meth:`state`; work in flight is dropped (the checkpoint's weights make it
        stale)."""
        self.close()
        self.sampler.load_state_dict(state["sampler"])

    def close(self) -> None:  # noqa: B027 - a schedule without work in flight has nothing to forget
        """Forget the work in flight (a restart, a checkpoint load, the end of the run)."""

    # ------------------------------------------------------------------------------------ shared stages

    def draw(self) -> list[PromptRecord]:
        return self.data.select(self.sampler.next_batch(self.cfg.data.batch_size))

    def seed(self, step: int) -> int:
        """Step ``step``'s sampling seed (its rounds derive theirs from it)."""
        return self.cfg.trainer.seed * 1_000_003 + step

    def sync(self, rounds: Rounds, version: int, timer: Timer) -> None:
        if self.cluster.holds(version):  # a later round at the same weights on a rollout pool: nothing to resend
            return
        with timer("weight_sync"):
            rounds.metrics |= self.cluster.sync_weights(version).metrics()

    def score(self, rounds: Rounds, batch: Batch, records: list[PromptRecord], baseline: Batch | None,
              timer: Timer) -> int:
        with timer("reward"):
            num_errors = self.experience.score(batch, records, baseline)
        return rounds.add(batch, len(records), num_errors)

    def sample_round(self, rounds: Rounds, step: int, timer: Timer) -> None:
        """A round at the weights the engines hold: draw, generate, score."""
        records = self.draw()
        seed = self.seed(step) + 100_003 * len(rounds.batches)
        with timer("rollout"):
            batch, baseline = self.experience.rollout(records, self.cfg.rollout.sampling, seed)
        self.score(rounds, batch, records, baseline, timer)


class SyncSource(RolloutSource):
    def next_batch(self, step: int, timer: Timer) -> tuple[Batch, dict[str, float]]:
        rounds = Rounds(self.cfg, self.experience)
        while not rounds.done:  # (later rounds: the engine slept while the previous round was scored)
            self.sync(rounds, step - 1, timer)
            self.sample_round(rounds, step, timer)
        return rounds.result()


class OneStepOffSource(RolloutSource):
    """The rows generated during the previous step (at version ``step - 2``; at ``step - 1`` on the first step and
    the first after a resume, which generate theirs now). ``timing/rollout_s`` is the time the step waited for
    them. Before scoring them it pushes the weights and starts the next step's generation; with dynamic sampling
    it first scores them and samples its further rounds at the same weights (the generation ahead waits)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.ahead: Generation | None = None
        self.before_draw: dict | None = None  # the sampler before the prompts of ``ahead`` were drawn

    def next_batch(self, step: int, timer: Timer) -> tuple[Batch, dict[str, float]]:
        rounds = Rounds(self.cfg, self.experience)
        if self.ahead is None:
            self.sync(rounds, step - 1, timer)
            self.ahead = self._start(self.seed(step))
        current, self.ahead = self.ahead, None
        with timer("rollout"):
            batch, baseline = self.experience.finish(current)
        if rounds.filter is not None:  # its rounds are known only once scored: before the next push
            self.score(rounds, batch, current.records, baseline, timer)
            while not rounds.done:
                self.sample_round(rounds, step, timer)
        self.sync(rounds, step - 1, timer)
        self.ahead = self._start(self.seed(step + 1))
        if rounds.filter is None:
            self.score(rounds, batch, current.records, baseline, timer)
        return rounds.result()

    def _start(self, seed: int) -> Generation:
        self.before_draw = self.sampler.state_dict()
        return self.experience.start(self.draw(), self.cfg.rollout.sampling, seed)

    def state(self) -> dict[str, Any]:
        # the prompts drawn for the step not trained yet are drawn again after a resume
        state = super().state()
        return state | {"sampler": self.before_draw} if self.ahead is not None else state

    def close(self) -> None:
        self.ahead = None
        self.experience.close()


class AsyncSource(RolloutSource):
    """Finished prompt groups from the producer's buffer (:mod:`megarl.trainer.asynchronous`); the producer
    starts with the first step (and again after a resume) and the weights are pushed when ``push_every``
    updates have passed since the last push. With dynamic sampling, the groups whose rewards are all equal are
    discarded and more are taken (the producer's staleness rule counts only the groups kept)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.producer: RolloutProducer | None = None
        self.skip: list[list[int]] = []  # per wave, prompts a checkpoint says were consumed

    def next_batch(self, step: int, timer: Timer) -> tuple[Batch, dict[str, float]]:
        version, rounds = step - 1, Rounds(self.cfg, self.experience)
        if self.producer is None:
            with timer("weight_sync"):
                self.producer = self._producer(step)
            rounds.metrics |= self.producer.first_push.metrics()
        elif version != self.producer.engine_version and version % self.cfg.rollout.asynchronous.push_every == 0:
            with timer("weight_sync"):
                rounds.metrics |= self.producer.push(version).metrics()
        taken_metrics: dict[str, float] = {}
        discarded = 0
        while not rounds.done:
            with timer("rollout"):  # the trainer's wait for the buffer
                groups, taken = self.producer.take(version, rounds.needed)
            for k, v in taken.items():  # over the takes of the step: waits and counts summed, states the last
                taken_metrics[k] = taken_metrics.get(k, 0.0) + v if k in _SUMMED else v
            batch = groups_batch(groups, self.experience.pad_token_id)
            batch.meta["metrics"] = {}
            baseline = self.experience.baseline_rows(groups)
            self.experience.stage("rollout", batch)
            dropped = self.score(rounds, batch, [g.record for g in groups], baseline, timer)
            self.producer.discard(dropped)  # at once: the producer may be waiting for room under the wait rule
            discarded += dropped
        batch, metrics = rounds.result()
        trained = int(batch["prompt_uid"].max()) + 1 if len(batch) else 0
        # informative groups past data.batch_size (or trimmed to the mini-batches) are not trained either
        self.producer.discard(rounds.groups - discarded - trained)
        return batch, metrics | taken_metrics

    def _producer(self, step: int) -> RolloutProducer:
        """The asynchronous schedule's generating thread, from the weights of ``step - 1`` on."""
        r, exp = self.cfg.rollout, self.experience
        return RolloutProducer(
            cluster=self.cluster, data=self.data, sampler=self.sampler, batch_size=self.cfg.data.batch_size,
            n=r.sampling.n, max_new_tokens=r.max_new_tokens, config=r.asynchronous, version=step - 1,
            params=lambda n, max_new, seed: dataclasses.replace(
                sampling_params(r.sampling, r, exp.stop_token_ids, seed), n=n, max_new_tokens=max_new),
            greedy=exp.greedy_params() if self.cfg.algorithm.needs_greedy_baseline else None,
            converse=None if not exp.conversational else lambda records, seed: exp.converse(
                records, r.sampling, seed, chunk_tokens=r.asynchronous.partial_chunk_tokens),
            short_steps=self.cfg.algorithm.dynamic_sampling is not None,
            seed=self.seed(step), skip=self.skip)

    def state(self) -> dict[str, Any]:
        if self.producer is None:
            return super().state() | {"async_skip": self.skip}
        sampler, skip = self.producer.resume_state()
        return {"sampler": sampler, "async_skip": skip}

    def restore(self, state: dict[str, Any]) -> None:
        super().restore(state)
        self.skip = state.get("async_skip", [])

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
            self.producer = None


_SUMMED = {"async/dropped_groups", "async/interrupted_responses", "async/trainer_wait_s", "async/rollout_wait_s",
           "async/push_s"}

SOURCES: dict[Schedule, type[RolloutSource]] = {Schedule.SYNC: SyncSource, Schedule.ONE_STEP_OFF: OneStepOffSource,
                                                Schedule.ASYNC: AsyncSource}


class ExampleSource(RolloutSource):
    """An offline program's rows (``trainer.program``: sft, dpo, kto, reward_model): ``data.batch_size`` examples of
    the dataset per step in the sampler's order (pairs as two consecutive rows, chosen then rejected), laid out by
    :func:`megarl.data.examples.example_rows`; for KTO also its KL rows (``kl_input_ids``, ...: each prompt with the
    previous example's completion, as TRL forms them per batch); nothing is generated or scored. A checkpoint keeps
    the position."""

    def __init__(self, cfg: TrainConfig, cluster: Any, experience: Experience, data: list[Example],
                 pad_token_id: int) -> None:
        super().__init__(cfg, cluster, experience, data)
        self.pad_token_id = pad_token_id
        self._ref: dict[int, torch.Tensor] | None = None  # offline.precompute_ref_log_probs: by example index

    def next_batch(self, step: int, timer: Timer) -> tuple[Batch, dict[str, float]]:
        with timer("data"):
            picked = [self.data[i] for i in self.sampler.next_batch(self.cfg.data.batch_size)]
            batch = self.rows(picked)
        if self.cfg.offline.precompute_ref_log_probs:
            with timer("reference"):
                batch.tensors["ref_logps"] = torch.cat([self._reference_logps()[e.index] for e in picked])
        return batch, {"data/epoch": float(self.sampler.epoch)}

    def _reference_logps(self) -> dict[int, torch.Tensor]:
        """Each training example's reference log-probs (one per completion, summed over its counted tokens, at
        temperature 1), computed once over the whole dataset on first use (TRL's ``precompute_ref_log_probs``;
        again after a restart or resume: the reference is frozen, the numbers are the same)."""
        if self._ref is None:
            self._ref = {}
            size = self.cfg.data.batch_size
            for start in range(0, len(self.data), size):
                chunk = self.data[start:start + size]
                rows = self.rows(chunk)
                lp = self.cluster.reference_log_probs(rows.select("input_ids", "attention_mask"), temperature=1.0)
                sums = (lp["log_probs"].double() * rows["response_mask"]).sum(-1)
                for e, part in zip(chunk, sums.split([len(e.completions) for e in chunk]), strict=True):
                    self._ref[e.index] = part
            logger.info("reference log-probs of %d training examples computed once", len(self._ref))
        return self._ref

    def rows(self, examples: list[Example]) -> Batch:
        """``examples`` laid out for the objective, cut as TRL's collators cut (the examples keep whole
        completions); for KTO with its KL rows (each prompt with the previous example's completion)."""
        o, kind = self.cfg.offline, self.cfg.example_kind
        batch = example_rows(examples, kind, self.pad_token_id, max_length=o.max_length, truncation=o.truncation)
        if kind is ExampleKind.UNPAIRED:
            kl = example_rows(kl_examples(examples), kind, self.pad_token_id, max_length=o.max_length,
                              truncation=o.truncation)
            for key in ("input_ids", "attention_mask", "response_mask"):
                batch.tensors[f"kl_{key}"] = kl[key]
        return batch

    def draw(self) -> list[PromptRecord]:
        raise MegarlError(f"trainer.program={self.cfg.trainer.program} reads examples (run.examples()), not prompts "
                          "to generate from: run.draw(), run.rollout() and run.generate() need an RL program's "
                          "prompt data.")


def make_source(cfg: TrainConfig, cluster: Any, experience: Experience, data: PromptDataset | list[Example],
                pad_token_id: int = 0) -> RolloutSource:
    if cfg.example_kind is not None:
        return ExampleSource(cfg, cluster, experience, data, pad_token_id)
    return SOURCES[cfg.rollout.schedule](cfg, cluster, experience, data)


def _concat(batches: list[Batch]) -> Batch:
    """Several rounds' rows; the rollout engine's per-call metrics summed (timings) over the rounds."""
    if len(batches) == 1:
        return batches[0]
    metrics: dict[str, float] = {}
    for b in batches:
        for k, v in b.meta["metrics"].items():
            metrics[k] = metrics.get(k, 0.0) + v
    out = Batch.concat(batches)
    out.meta["metrics"] = metrics
    return out
