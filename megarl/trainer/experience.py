"""What a step trains on: responses to prompts and their rewards (the trainer's rollout and reward stages).

:meth:`Experience.collect` generates ``rollout.sampling.n`` responses to each of ``data.batch_size`` prompts
and scores them. With DAPO dynamic sampling (``algorithm.dynamic_sampling``) it keeps only the prompt
groups whose rewards differ and samples further batches of prompts (up to ``max_extra_rounds`` more) until
it has ``data.batch_size`` such groups; the reward metrics describe every response sampled, the
``dynamic/*`` counts what was kept. A response's reward is ``reward.function_weight * function +
reward_model.weight * reward model`` over the sources configured (or each of ``reward.functions`` with
its weight, scored and logged apart: ``NAME_scores``, ``reward/NAME_mean``), plus DAPO's soft overlong penalty where
``reward.overlong_buffer`` is set. ReMax's greedy baseline (one response per prompt) is generated and
scored in the same round. Validation samples and scores with the same methods.

Multi-turn rollouts (``rollout.multi_turn``, :mod:`megarl.multiturn`): each prompt opens ``n`` conversations with
an environment (or tools); every turn is one generation call across the policy's rollout engines and the
environment steps run on this process's threads. A conversation's reward is its environment's, plus the reward
function's score of the model's last turn. Environment failures (``on_env_error: score``) and tool errors are kept
with their texts in ``<output_dir>/env_errors.jsonl``, the first of each kind logged. ``response/length_*`` counts
the model's tokens, ``response/env_tokens_*`` the environment's between them.

Schedules (``rollout.schedule``): ``sync`` syncs the weights, generates and scores in turn (:meth:`collect`);
``one_step_off`` (:meth:`collect_ahead`, rollout engines on a pool of their own) waits for the responses
generated during the previous step, pushes the newest weights, starts generating the next step's responses
and only then scores, so the next generation overlaps this step's scoring and training; ``async``
(:meth:`collect_async`) takes finished prompt groups from a buffer that the rollout pool fills all along
(:mod:`megarl.trainer.asynchronous`). Every row carries ``policy_version``, the version of the weights that
generated it (version v: the weights after step v; with partial rollouts, its oldest token's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megarl.algos.dapo import ShortBatch, informative_groups, overlong_penalty
from megarl.config.resolve import sampling_params
from megarl.config.train import Role, TrainConfig
from megarl.controller.handles import PendingCall
from megarl.data.batch import Batch, prompt_batch
from megarl.data.prompts import PromptRecord
from megarl.errors import MegarlError
from megarl.multiturn.environment import environment_factory
from megarl.multiturn.errors import EnvErrorLog
from megarl.multiturn.rollout import conversations_batch, model_turns, run_conversations
from megarl.multiturn.trajectory import ChatRenderer
from megarl.rewards.base import RewardFunction, score_samples
from megarl.rewards.monitor import RewardMonitor
from megarl.rollout.base import SamplingConfig
from megarl.trainer.asynchronous import RolloutProducer, groups_batch

logger = logging.getLogger(__name__)

Timer = Callable[[str], contextlib.AbstractContextManager[None]]
Stage = Callable[[str, Batch], None]


class ShortBatchError(MegarlError):
    """Dynamic sampling found too few informative prompt groups and ``on_short: fail`` was set."""


@dataclasses.dataclass
class _Generation:
    """Responses being generated: the prompts, the pending call, and ReMax's pending greedy baseline."""

    records: list[PromptRecord]
    rows: PendingCall[Batch]
    baseline: PendingCall[Batch] | None


class Experience:
    def __init__(self, cfg: TrainConfig, cluster: Any, tokenizer: Any, reward_fns: dict[str, RewardFunction],
                 stop_token_ids: list[int], stage: Stage) -> None:
        """``reward_fns``: the callables of ``cfg.reward.named_functions()``, by the same names."""
        self.cfg, self.cluster, self.tokenizer, self.reward_fns = cfg, cluster, tokenizer, reward_fns
        self.stop_token_ids, self.stage = stop_token_ids, stage
        self.reward_monitor = RewardMonitor()  # the columns the reward functions need; constant scores warned about
        self.ahead: _Generation | None = None  # one_step_off: the next step's responses, being generated
        self.producer: RolloutProducer | None = None  # async: the generating thread and its buffer
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.conversations = None  # multi-turn: (one environment per conversation, the chat renderer)
        if cfg.rollout.multi_turn.enabled:
            make_env, schemas = environment_factory(cfg.rollout.multi_turn)
            self.conversations = (make_env, ChatRenderer(tokenizer, tools=schemas))
            self.env_errors = EnvErrorLog(Path(cfg.trainer.output_dir) / "env_errors.jsonl")  # texts; firsts logged

    # ------------------------------------------------------------------------------------ a step

    def collect(self, next_prompts: Callable[[], list[PromptRecord]], seed: int, timer: Timer,
                version: int) -> tuple[Batch, dict[str, float]]:
        """The rows a step trains on (grouped by prompt, ``prompt_uid`` numbering the groups from 0) with
        ``scores``, and the step's weight-sync, rollout and reward metrics: the rollout engines get the policy's
        weights (``version``) first. The policy is in training mode afterwards."""
        ds = self.cfg.algorithm.dynamic_sampling
        batches: list[Batch] = []
        informative: list[torch.Tensor] = []  # per round: which of its prompt groups have differing rewards
        num_groups = num_errors = found = 0
        for round_ in range(1 + (ds.max_extra_rounds if ds is not None else 0)):
            with timer("weight_sync"):  # (later rounds: the engine slept while the previous round was scored)
                sync = self.cluster.sync_weights(version)
            records = next_prompts()
            with timer("rollout"):
                batch, baseline = self.rollout(records, self.cfg.rollout.sampling, seed + 100_003 * round_)
            with timer("reward"):
                num_errors += self.score(batch, records, baseline)
            if ds is not None:
                informative.append(informative_groups(batch["scores"], batch["prompt_uid"], len(records)))
                found += int(informative[-1].sum())
            batch.tensors["prompt_uid"] = batch["prompt_uid"] + num_groups  # numbers the groups of all rounds
            batches.append(batch)
            num_groups += len(records)
            if ds is None or found >= self.cfg.data.batch_size:
                break
        full = _concat(batches)
        metrics = sync.metrics() | self._rollout_metrics(full) | self.reward_metrics(full, "reward", num_errors)
        if ds is None:
            return full, metrics
        return self._keep_informative(full, torch.cat(informative), round_ + 1, metrics)

    def collect_ahead(self, next_prompts: Callable[[], list[PromptRecord]], seed: int, next_seed: int, timer: Timer,
                      version: int) -> tuple[Batch, dict[str, float]]:
        """One-step-off :meth:`collect`: the rows generated during the previous step (at ``version - 1``; at
        ``version`` on the first step and the first after a resume, which generate theirs now). Before scoring
        them, it pushes the weights (``version``) and starts generating the next step's rows (``next_seed``),
        which then runs while this step trains. ``timing/rollout_s`` is the time the trainer waited for them."""
        sampling = self.cfg.rollout.sampling
        if self.ahead is None:
            with timer("weight_sync"):
                self.cluster.sync_weights(version)
            self.ahead = self._start(next_prompts(), sampling, seed)
        current, self.ahead = self.ahead, None
        with timer("rollout"):
            batch, baseline = self._finish(current)
        with timer("weight_sync"):
            sync = self.cluster.sync_weights(version)
        self.ahead = self._start(next_prompts(), sampling, next_seed)
        with timer("reward"):
            num_errors = self.score(batch, current.records, baseline)
        return batch, sync.metrics() | self._rollout_metrics(batch) | self.reward_metrics(batch, "reward", num_errors)

    def drop_ahead(self) -> None:
        """Forget responses being generated ahead (a restart or a checkpoint load makes them stale)."""
        self.ahead = None
        if self.producer is not None:
            self.producer.close()
            self.producer = None

    def collect_async(self, version: int, timer: Timer, start: Callable[[], RolloutProducer]) -> tuple[
            Batch, dict[str, float]]:
        """Asynchronous :meth:`collect` (:mod:`megarl.trainer.asynchronous`): ``data.batch_size`` finished prompt
        groups from the producer's buffer (``start`` makes the producer on the first step or after a resume);
        first the weights (``version``) are pushed when ``push_every`` updates have passed since the last push."""
        metrics: dict[str, float] = {}
        if self.producer is None:
            with timer("weight_sync"):
                self.producer = start()
        elif version != self.producer.engine_version and version % self.cfg.rollout.asynchronous.push_every == 0:
            with timer("weight_sync"):
                metrics |= self.producer.push(version).metrics()
        with timer("rollout"):  # the trainer's wait for the buffer
            groups, taken = self.producer.take(version)
        batch = groups_batch(groups, self.pad_token_id)
        batch.meta["metrics"] = taken
        self.stage("rollout", batch)
        with timer("reward"):
            num_errors = self.score(batch, [g.record for g in groups])
        return batch, metrics | self._rollout_metrics(batch) | self.reward_metrics(batch, "reward", num_errors)

    def _keep_informative(self, batch: Batch, informative: torch.Tensor, rounds: int,
                          metrics: dict[str, float]) -> tuple[Batch, dict[str, float]]:
        """The first ``data.batch_size`` informative groups (fewer, trimmed to divide into the mini-batches,
        when sampling ran out), renumbered 0..k-1."""
        a, want, n = self.cfg.algorithm, self.cfg.data.batch_size, self.cfg.rollout.sampling.n
        sampled = len(informative)
        kept = informative.nonzero().flatten().tolist()
        counts = {"dynamic/rounds": float(rounds), "dynamic/groups_sampled": float(sampled),
                  "dynamic/groups_kept": float(len(kept)), "dynamic/groups_dropped": float(sampled - len(kept))}
        if len(kept) < want:
            if a.dynamic_sampling.on_short is ShortBatch.FAIL:
                raise ShortBatchError(
                    f"dynamic sampling found {len(kept)} prompt groups with differing rewards in {rounds} rounds "
                    f"({sampled} prompts), fewer than data.batch_size={want}, and "
                    "algorithm.dynamic_sampling.on_short=fail. Raise max_extra_rounds, use on_short: train, or check "
                    "that the rewards can differ (all correct or all wrong for every prompt).")
            dps = [self.cfg.cluster.layout(r).dp for r in self.cfg.roles() if r in (Role.POLICY, Role.CRITIC)]
            step = math.lcm(*dps) * a.mini_batches  # the updates split the rows into this many parts
            while kept and (len(kept) * n) % step:
                kept.pop()
        kept = kept[:want]
        counts |= {"dynamic/groups_trained": float(len(kept)), "dynamic/short": float(len(kept) < want)}
        if not kept:
            return batch.index([]), metrics | counts
        rows = torch.cat([(batch["prompt_uid"] == uid).nonzero().flatten() for uid in kept])
        out = batch.index(rows)
        renumber = torch.full((sampled,), -1, dtype=torch.long)
        renumber[torch.tensor(kept)] = torch.arange(len(kept))
        out.tensors["prompt_uid"] = renumber[out["prompt_uid"]]
        return out, metrics | counts

    # ------------------------------------------------------------------------------------ stages

    def rollout(self, records: list[PromptRecord], sampling: SamplingConfig,
                seed: int | None) -> tuple[Batch, Batch | None]:
        """Responses to ``records`` (rows grouped by prompt) and, for ReMax, one greedy response per prompt
        (prompt-indexed); the policy returns to training afterwards."""
        if self.conversations is not None:
            return self._converse(records, sampling, seed)
        return self._finish(self._start(records, sampling, seed))

    def _converse(self, records: list[PromptRecord], sampling: SamplingConfig,
                  seed: int | None) -> tuple[Batch, Batch | None]:
        """Multi-turn rollouts: ``sampling.n`` conversations per record, as training rows (see the module doc), and
        for ReMax (training only) one greedy conversation per record, each with its own environment, after them."""
        call_metrics: dict[str, float] = {}
        reuse = [0, 0]  # prompt tokens the engines did not compute again (kept KV / prefix cache), of all prompt tokens
        validation = sampling is self.cfg.rollout.validation  # a step trains on version step - 1, validates on step
        phase = "validation" if validation else "train"
        batch, metrics = self._talk(records, sampling.n, self._params(sampling, seed), phase, call_metrics, reuse)
        baseline = None
        if self.cfg.algorithm.needs_greedy_baseline and not validation:  # ReMax, scored like the sampled ones
            greedy = self._params(SamplingConfig(temperature=0.0), None)
            baseline, _ = self._talk(records, 1, greedy, "baseline", call_metrics, reuse)
            self.stage("baseline", baseline)
        if reuse[1]:
            call_metrics["multiturn/prompt_tokens_reused"] = reuse[0] / reuse[1]
        batch.meta["metrics"] = call_metrics | metrics | {"timing/to_train_s": self.cluster.to_train()}
        self.stage("rollout", batch)
        return batch, baseline

    def _talk(self, records: list[PromptRecord], n: int, params: Any, phase: str, call_metrics: dict[str, float],
              reuse: list[int]) -> tuple[Batch, dict[str, float]]:
        """``n`` conversations per record through the policy's rollout engines (:meth:`_converse`): their
        training rows and the loop's metrics; each call's metrics summed into ``call_metrics``, the prompt tokens the
        engines reused and were handed into ``reuse``, the environments' errors kept under ``phase``."""
        make_env, renderer = self.conversations
        versions: set[int] = set()  # of the weights that generated the turns (one: the engines sync only before)

        def generate(prompts: list[list[int]], turn_params) -> list:
            rows = self.cluster.generate(prompt_batch(prompts), turn_params)
            for k, v in rows.meta["metrics"].items():  # per call (timings): summed over the turns
                call_metrics[k] = call_metrics.get(k, 0.0) + v
            if "cached_tokens" in rows.keys():  # noqa: SIM118 (Batch)
                reuse[0] += int(rows["cached_tokens"].sum())
                reuse[1] += sum(len(p) for p in prompts)
            versions.update(rows["policy_version"].tolist())
            return model_turns(rows)  # each turn's ids, log-probs, version and (MoE) routing

        result = run_conversations([{**rec.row, "prompt": rec.prompt} for rec in records], n, make_env, renderer,
                                   generate, params, self.cfg.rollout.multi_turn, stop_ids=self.stop_token_ids)
        batch = conversations_batch(result.conversations, self.pad_token_id)  # with each token's version
        self.env_errors.record(min(versions) + (phase != "validation"), result.errors(), phase=phase)
        return batch, result.metrics

    def _start(self, records: list[PromptRecord], sampling: SamplingConfig, seed: int | None) -> _Generation:
        prompts = _prompt_batch(records)
        rows = self.cluster.generate_async(prompts, self._params(sampling, seed))
        baseline = (self.cluster.generate_async(prompts, self._params(SamplingConfig(temperature=0.0), None))
                    if self.cfg.algorithm.needs_greedy_baseline else None)  # ReMax
        return _Generation(records, rows, baseline)

    def _finish(self, generation: _Generation) -> tuple[Batch, Batch | None]:
        batch = generation.rows.result()
        baseline = generation.baseline.result() if generation.baseline is not None else None
        if baseline is not None:
            self.stage("baseline", baseline)
        batch.meta["metrics"]["timing/to_train_s"] = self.cluster.to_train()
        self.stage("rollout", batch)
        return batch, baseline

    def _params(self, sampling: SamplingConfig, seed: int | None):
        return sampling_params(sampling, self.cfg.rollout, self.stop_token_ids, seed)

    def score(self, batch: Batch, records: list[PromptRecord], baseline: Batch | None = None,
              stage: str = "reward") -> int:
        """``scores``: each row's reward (its sources kept as ``function_scores`` or ``NAME_scores``, ``model_scores``,
        ``overlong_scores``); with ``baseline`` (ReMax: one response per prompt, in prompt order),
        ``baseline_scores``: the reward of the row's prompt's baseline response. Returns how many rows the
        reward functions failed on (``on_error: score``), over all of them."""
        scores, parts, num_errors = self._rewards(batch, records)
        batch.tensors["scores"] = scores
        for source, values in parts.items():
            batch.tensors[f"{source}_scores"] = values
        if baseline is not None:
            if not torch.equal(baseline["prompt_uid"], torch.arange(len(records))):
                raise ValueError(f"a baseline is one response per prompt in prompt order; found prompt ids "
                                 f"{baseline['prompt_uid'].tolist()[:8]} for {len(records)} prompts")
            per_prompt, _, baseline_errors = self._rewards(baseline, records)
            batch.tensors["baseline_scores"] = per_prompt[batch["prompt_uid"]]
            num_errors += baseline_errors
        self.stage(stage, batch)
        return num_errors

    def reward_metrics(self, batch: Batch, prefix: str, num_errors: int) -> dict[str, float]:
        scores = batch["scores"]
        std = scores.std().item() if len(scores) > 1 else 0.0
        metrics = {f"{prefix}/mean": scores.mean().item(), f"{prefix}/std": std, f"{prefix}/min": scores.min().item(),
                   f"{prefix}/max": scores.max().item(), f"{prefix}/num_errors": float(num_errors)}
        functions = self.cfg.reward.named_functions()
        sources = (*functions, "model", "overlong", "environment")
        parts = {source: batch[f"{source}_scores"] for source in sources if f"{source}_scores" in batch}
        named = bool(self.cfg.reward.functions)  # named functions are always logged apart (TRL's rewards/NAME)
        if len(parts) > 1 or named or any(f.function_weight != 1.0 for f in functions.values()):  # sources apart
            metrics |= {f"{prefix}/{source}_mean": values.mean().item() for source, values in parts.items()}
            metrics |= {f"{prefix}/{name}_std": parts[name].std().item() if len(scores) > 1 else 0.0
                        for name in self.cfg.reward.functions if name in parts}  # TRL's rewards/NAME/std
        if "model" in parts:
            metrics[f"{prefix}/model_std"] = parts["model"].std().item() if len(scores) > 1 else 0.0
        if "baseline_scores" in batch:  # one value per prompt, repeated on its rows: the mean over prompts
            uid = batch["prompt_uid"]
            per_prompt = torch.zeros(int(uid.max()) + 1).scatter(0, uid, batch["baseline_scores"])
            metrics[f"{prefix}/baseline_mean"] = per_prompt.mean().item()
        return metrics

    def _rewards(self, batch: Batch, records: list[PromptRecord]) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        """Each row's reward, each source's own scores, and how many rows the function failed on."""
        r = self.cfg.reward
        parts: dict[str, torch.Tensor] = {}
        total, num_errors = torch.zeros(len(batch)), 0
        if "environment_scores" in batch:  # multi-turn: the environment's rewards of each conversation
            parts["environment"] = batch["environment_scores"]
            total = total + parts["environment"]
        if self.reward_fns:
            rows = [records[i] for i in batch["prompt_uid"].tolist()]
            if "final_texts" in batch.non_tensors:  # multi-turn: the model's last turn is its answer
                responses = batch.non_tensors["final_texts"]
            else:  # whole-batch tensor ops and lists: per-row tensor indexing costs ~10 us a row
                masks = batch["response_mask"].bool().tolist()
                responses = self.tokenizer.batch_decode(
                    [[t for t, m in zip(ids, row_mask, strict=True) if m]
                     for ids, row_mask in zip(batch["input_ids"].tolist(), masks, strict=True)],
                    skip_special_tokens=True)
            texts, row_columns = [rec.text for rec in rows], [rec.row for rec in rows]
            for name, spec in r.named_functions().items():  # each with its own error policy
                fn = self.reward_fns[name]
                self.reward_monitor.check_columns(name, fn, row_columns)  # needs a column no row has: ConfigError
                parts[name], info = score_samples(fn, texts, responses, row_columns, spec.on_error, spec.error_score)
                self.reward_monitor.observe(name, spec.function, fn, parts[name], info)  # constant scores: warned
                total, num_errors = total + spec.function_weight * parts[name], num_errors + info.num_errors
        if self.cfg.reward_model is not None:
            parts["model"] = self.cluster.reward_scores(batch.select("input_ids", "attention_mask"))["scores"]
            total = total + self.cfg.reward_model.weight * parts["model"]
        if r.overlong_buffer:
            parts["overlong"] = _overlong_scores(self.cfg, batch)
            total = total + parts["overlong"]
        return total, parts, num_errors

    @staticmethod
    def _rollout_metrics(batch: Batch) -> dict[str, float]:
        lengths = batch["response_lengths"].float()  # multi-turn: the model's tokens, observations apart
        env = batch["observation_lengths"].float() if "observation_lengths" in batch else None
        return batch.meta.pop("metrics") | {
            "rollout/num_tokens": lengths.sum().item(), "response/length_mean": lengths.mean().item(),
            "response/length_max": lengths.max().item(),
            "response/stopped_frac": sum(f == "stop" for f in batch["finish_reasons"]) / len(lengths)} | (
            {} if env is None else {"response/env_tokens_mean": env.mean().item(),
                                    "response/env_tokens_max": env.max().item()})


def _overlong_scores(cfg: TrainConfig, batch: Batch) -> torch.Tensor:
    """DAPO's soft overlong penalty of each row: a response's length against ``rollout.max_new_tokens``; a
    conversation's tokens after the prompt (the model's and the observations', what ``max_total_tokens`` bounds and
    cuts) against ``rollout.multi_turn.max_total_tokens`` (docs/multiturn.md)."""
    r = cfg.reward
    if "observation_lengths" in batch:  # multi-turn rows
        lengths = batch["response_lengths"] + batch["observation_lengths"]
        limit = cfg.rollout.multi_turn.max_total_tokens
    else:
        lengths, limit = batch["response_lengths"], cfg.rollout.max_new_tokens
    return overlong_penalty(lengths, limit, r.overlong_buffer, r.overlong_penalty_factor).float()


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


def _prompt_batch(records: list[PromptRecord]) -> Batch:
    return prompt_batch([r.input_ids for r in records]).update(
        Batch.from_dict({"prompt_uid": torch.arange(len(records))}))

