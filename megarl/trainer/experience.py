"""The rollout and reward stages a step's rows go through, whichever schedule drives them
(:mod:`megarl.trainer.sources`): generation (single- or multi-turn) and scoring.

:meth:`Experience.rollout` generates ``rollout.sampling.n`` responses to each prompt (:meth:`start` and
:meth:`finish` split it around other work) and :meth:`Experience.score` scores them. A response's reward is
``reward.function_weight * function + reward_model.weight * reward model + cost_model.weight * cost model`` over
the sources configured (or each of ``reward.functions`` with its weight, scored and logged apart: ``NAME_scores``,
``reward/NAME_mean``), plus DAPO's soft overlong penalty where ``reward.overlong_buffer`` is set. The reward and
cost models are called together (on pools of their own they score at the same time). ReMax's greedy baseline
(one response per prompt) is generated and scored in the same round. Validation samples and scores with the same
methods.

Multi-turn rollouts (``rollout.multi_turn``, :mod:`megarl.multiturn`): each prompt opens ``n`` conversations with
an environment (or tools); every turn is one generation call across the policy's rollout engines and the
environment steps run on this process's threads. A conversation's reward is its environment's, plus the reward
function's score of the model's last turn. Environment failures (``on_env_error: score``) and tool errors are kept
with their texts in ``<output_dir>/env_errors.jsonl``, the first of each kind logged. ``response/length_*`` counts
the model's tokens, ``response/env_tokens_*`` the environment's between them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megarl.algos.dapo import overlong_penalty
from megarl.algos.plugins import REWARD_STAGE, ROLLOUT_FUNCTION, RewardStageInputs, checked_stage_scores
from megarl.algos.plugins import resolve as resolve_plugin
from megarl.config.resolve import sampling_params
from megarl.config.train import TrainConfig
from megarl.controller.handles import wait_all
from megarl.data.batch import Batch, prompt_batch
from megarl.data.prompts import PromptRecord
from megarl.multiturn.custom import RolloutContext, run_rollout_function
from megarl.multiturn.environment import environment_factory
from megarl.multiturn.errors import EnvErrorLog
from megarl.multiturn.rollout import conversations_batch, model_turns, run_conversations
from megarl.multiturn.trajectory import ChatRenderer
from megarl.rewards.base import RewardFunction, score_samples
from megarl.rewards.monitor import RewardMonitor
from megarl.rollout.base import SamplingConfig, SamplingParams
from megarl.trainer.asynchronous import Group, baseline_batch

logger = logging.getLogger(__name__)

Stage = Callable[[str, Batch], None]


@dataclasses.dataclass
class Generation:
    """Responses being generated: the prompts and a wait for the rows and ReMax's greedy baseline (prompt-indexed,
    or None) once generated."""

    records: list[PromptRecord]
    wait: Callable[[], tuple[Batch, Batch | None]]


class Experience:
    def __init__(self, cfg: TrainConfig, cluster: Any, tokenizer: Any, reward_fns: dict[str, RewardFunction],
                 stop_token_ids: list[int], stage: Stage) -> None:
        """``reward_fns``: the callables of ``cfg.reward.named_functions()``, by the same names."""
        self.cfg, self.cluster, self.tokenizer, self.reward_fns = cfg, cluster, tokenizer, reward_fns
        self.stop_token_ids, self.stage = stop_token_ids, stage
        self.reward_monitor = RewardMonitor()  # the columns the reward functions need; constant scores warned about
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.conversations = None  # multi-turn: (one environment per conversation, the chat renderer)
        self.rollout_fn = None  # rollout.function: the user's generation loop (megarl.multiturn.custom)
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None  # multi-turn generations started ahead
        if cfg.rollout.multi_turn.enabled:
            make_env, schemas = environment_factory(cfg.rollout.multi_turn)
            self.conversations = (make_env, ChatRenderer(tokenizer, tools=schemas))
        if cfg.rollout.function is not None:
            self.rollout_fn = resolve_plugin(ROLLOUT_FUNCTION, cfg.rollout.function)
        if self.conversational:
            self.env_errors = EnvErrorLog(Path(cfg.trainer.output_dir) / "env_errors.jsonl")  # texts; firsts logged

    @property
    def conversational(self) -> bool:
        """Whether rows come from a loop of several generation calls (multi-turn, a rollout function): through
        :meth:`converse`, on a thread of their own when started ahead."""
        return self.conversations is not None or self.rollout_fn is not None

    # ------------------------------------------------------------------------------------ stages

    def rollout(self, records: list[PromptRecord], sampling: SamplingConfig,
                seed: int | None) -> tuple[Batch, Batch | None]:
        """Responses to ``records`` (rows grouped by prompt) and, for ReMax, one greedy response per prompt
        (prompt-indexed); the policy returns to training afterwards."""
        if self.conversational:  # on this thread
            return self.finish(Generation(records, lambda: self.converse(records, sampling, seed)))
        return self.finish(self.start(records, sampling, seed))

    def converse(self, records: list[PromptRecord], sampling: SamplingConfig, seed: int | None,
                 chunk_tokens: int | None = None) -> tuple[Batch, Batch | None]:
        """Multi-turn rollouts: ``sampling.n`` conversations per record, as training rows (see the module doc), and
        for ReMax (training only) one greedy conversation per record, each with its own environment, after them.
        ``chunk_tokens`` (partial rollouts): each model turn is generated that many tokens per call, so that a
        weight push can land inside a turn (:func:`megarl.multiturn.rollout.run_conversations`)."""
        call_metrics: dict[str, float] = {}
        reuse = [0, 0]  # prompt tokens the engines did not compute again (kept KV / prefix cache), of all prompt tokens
        validation = sampling is self.cfg.rollout.validation  # a step trains on version step - 1, validates on step
        phase = "validation" if validation else "train"
        batch, metrics = self._talk(records, sampling.n, self._params(sampling, seed), phase, call_metrics, reuse,
                                    chunk_tokens)
        baseline = None
        if self.cfg.algorithm.needs_greedy_baseline and not validation:  # ReMax, scored like the sampled ones
            baseline, _ = self._talk(records, 1, self.greedy_params(), "baseline", call_metrics, reuse, chunk_tokens)
        if reuse[1]:
            call_metrics["multiturn/prompt_tokens_reused"] = reuse[0] / reuse[1]
        batch.meta["metrics"] = call_metrics | metrics
        return batch, baseline

    def _talk(self, records: list[PromptRecord], n: int, params: Any, phase: str, call_metrics: dict[str, float],
              reuse: list[int], chunk_tokens: int | None) -> tuple[Batch, dict[str, float]]:
        """``n`` conversations per record through the policy's rollout engines (:meth:`converse`): their
        training rows and the loop's metrics; each call's metrics summed into ``call_metrics``, the prompt tokens the
        engines reused and were handed into ``reuse``, the environments' errors kept under ``phase``."""
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

        rows = [{**rec.row, "prompt": rec.prompt} for rec in records]
        if self.rollout_fn is not None:  # whole generation calls: a push lands between two of them
            ctx = RolloutContext(self.tokenizer, tuple(self.stop_token_ids), generate, params)
            result = run_rollout_function(self.rollout_fn, self.rollout_fn.name, rows, [r.input_ids for r in records],
                                          n, ctx)
        else:
            make_env, renderer = self.conversations
            result = run_conversations(rows, n, make_env, renderer, generate, params, self.cfg.rollout.multi_turn,
                                       stop_ids=self.stop_token_ids, chunk_tokens=chunk_tokens)
        batch = conversations_batch(result.conversations, self.pad_token_id)  # with each token's version
        self.env_errors.record(min(versions) + (phase != "validation"), result.errors(), phase=phase)
        return batch, result.metrics

    def start(self, records: list[PromptRecord], sampling: SamplingConfig, seed: int | None) -> Generation:
        """:meth:`rollout`, started: it runs while this thread does other work (the conversations of multi-turn
        rollouts on a thread of their own, whose generation calls reach the rollout engines in turn)."""
        if self.conversational:
            if self._threads is None:
                self._threads = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megarl-conversations")
            return Generation(records, self._threads.submit(self.converse, records, sampling, seed).result)
        prompts = _prompt_batch(records)
        rows = self.cluster.generate_async(prompts, self._params(sampling, seed))
        baseline = (self.cluster.generate_async(prompts, self.greedy_params())
                    if self.cfg.algorithm.needs_greedy_baseline else None)  # ReMax
        return Generation(records, lambda: (rows.result(), baseline.result() if baseline is not None else None))

    def finish(self, generation: Generation) -> tuple[Batch, Batch | None]:
        batch, baseline = generation.wait()
        if baseline is not None:
            self.stage("baseline", baseline)
        batch.meta["metrics"]["timing/to_train_s"] = self.cluster.to_train()
        self.stage("rollout", batch)
        return batch, baseline

    def close(self) -> None:
        """Stop waiting for conversations started ahead (their results are not needed any more)."""
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None

    def _params(self, sampling: SamplingConfig, seed: int | None) -> SamplingParams:
        return sampling_params(sampling, self.cfg.rollout, self.stop_token_ids, seed)

    def greedy_params(self) -> SamplingParams:
        """How ReMax's greedy baseline samples (one response per prompt, temperature 0)."""
        return self._params(SamplingConfig(temperature=0.0), None)

    def baseline_rows(self, groups: list[Group]) -> Batch | None:
        """ReMax's greedy baselines of asynchronous ``groups`` (one row per group, in group order), or None."""
        if not self.cfg.algorithm.needs_greedy_baseline:
            return None
        baseline = baseline_batch(groups, self.pad_token_id)
        self.stage("baseline", baseline)
        return baseline

    def score(self, batch: Batch, records: list[PromptRecord], baseline: Batch | None = None,
              stage: str = "reward") -> int:
        """``scores``: each row's reward (its sources kept as ``function_scores`` or ``NAME_scores``, ``model_scores``,
        ``cost_scores``, ``overlong_scores``); with ``baseline`` (ReMax: one response per prompt, in prompt order),
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
        sources = (*functions, "model", "cost", "overlong", "environment", *self.cfg.reward.stages)
        parts = {source: batch[f"{source}_scores"] for source in sources if f"{source}_scores" in batch}
        named = bool(self.cfg.reward.functions or self.cfg.reward.stages)  # named sources: always logged apart
        if len(parts) > 1 or named or any(f.function_weight != 1.0 for f in functions.values()):  # sources apart
            metrics |= {f"{prefix}/{source}_mean": values.mean().item() for source, values in parts.items()}
            metrics |= {f"{prefix}/{name}_std": parts[name].std().item() if len(scores) > 1 else 0.0
                        for name in (*self.cfg.reward.functions, *self.cfg.reward.stages) if name in parts}
        for source in ("model", "cost"):
            if source in parts:
                metrics[f"{prefix}/{source}_std"] = parts[source].std().item() if len(scores) > 1 else 0.0
        if "baseline_scores" in batch:  # one value per prompt, repeated on its rows: the mean over prompts
            uid = batch["prompt_uid"]
            per_prompt = torch.zeros(int(uid.max()) + 1).scatter(0, uid, batch["baseline_scores"])
            metrics[f"{prefix}/baseline_mean"] = per_prompt.mean().item()
        return metrics

    def _rewards(self, batch: Batch, records: list[PromptRecord]) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        """Each row's reward, each source's own scores, and how many rows the function failed on. The reward and cost
        models are called first (they score while the driver runs the reward functions), the stages last."""
        r = self.cfg.reward
        classifiers = {source: (section, getattr(self.cluster, call)) for source, section, call in (
            ("model", self.cfg.reward_model, "reward_scores_async"),
            ("cost", self.cfg.cost_model, "cost_scores_async")) if section is not None}
        if classifiers:  # on pools of their own, the reward and cost models score at the same time
            model_rows = batch.select("input_ids", "attention_mask")
            pending = [score(model_rows) for _, score in classifiers.values()]
        parts: dict[str, torch.Tensor] = {}
        total, num_errors = torch.zeros(len(batch)), 0
        if "environment_scores" in batch:  # multi-turn: the environment's rewards of each conversation
            parts["environment"] = batch["environment_scores"]
            total = total + parts["environment"]
        texts = _Texts(self.tokenizer, batch, records) if self.reward_fns or r.stages else None
        for name, spec in r.named_functions().items():  # each with its own error policy
            fn, row_columns = self.reward_fns[name], texts.row_columns
            self.reward_monitor.check_columns(name, fn, row_columns)  # needs a column no row has: ConfigError
            parts[name], info = score_samples(fn, texts.prompts, texts.responses, row_columns, spec.on_error,
                                              spec.error_score)
            self.reward_monitor.observe(name, spec.function, fn, parts[name], info)  # constant scores: warned
            total, num_errors = total + spec.function_weight * parts[name], num_errors + info.num_errors
        if classifiers:
            for (source, (section, _)), result in zip(classifiers.items(), wait_all(pending), strict=True):
                parts[source] = result["scores"]
                total = total + section.weight * parts[source]
        if r.overlong_buffer:
            parts["overlong"] = _overlong_scores(self.cfg, batch)
            total = total + parts["overlong"]
        for name, spec in r.stages.items():  # in order: each sees the reward so far
            stage = resolve_plugin(REWARD_STAGE, spec)
            inputs = RewardStageInputs(
                scores=total, sources=dict(parts), prompts=texts.prompts, responses=texts.responses,
                rows=texts.row_columns, group_ids=batch["prompt_uid"], response_lengths=batch["response_lengths"],
                finish_reasons=list(batch["finish_reasons"]))
            parts[name] = checked_stage_scores(stage(inputs), len(batch), stage.name)
            total = total + parts[name]
        return total, parts, num_errors

    @staticmethod
    def rollout_metrics(batch: Batch) -> dict[str, float]:
        lengths = batch["response_lengths"].float()  # multi-turn: the model's tokens, observations apart
        env = batch["observation_lengths"].float() if "observation_lengths" in batch else None
        return batch.meta.pop("metrics") | {
            "rollout/num_tokens": lengths.sum().item(), "response/length_mean": lengths.mean().item(),
            "response/length_max": lengths.max().item(),
            "response/stopped_frac": sum(f == "stop" for f in batch["finish_reasons"]) / len(lengths)} | (
            {} if env is None else {"response/env_tokens_mean": env.mean().item(),
                                    "response/env_tokens_max": env.max().item()})


class _Texts:
    """A round's prompts, responses (decoded once, for the reward functions and stages) and dataset rows."""

    def __init__(self, tokenizer: Any, batch: Batch, records: list[PromptRecord]) -> None:
        rows = [records[i] for i in batch["prompt_uid"].tolist()]
        self.prompts, self.row_columns = [rec.text for rec in rows], [rec.row for rec in rows]
        if "final_texts" in batch.non_tensors:  # multi-turn: the model's last turn is its answer
            self.responses = batch.non_tensors["final_texts"]
        else:  # whole-batch tensor ops and lists: per-row tensor indexing costs ~10 us a row
            masks = batch["response_mask"].bool().tolist()
            self.responses = tokenizer.batch_decode(
                [[t for t, m in zip(ids, row_mask, strict=True) if m]
                 for ids, row_mask in zip(batch["input_ids"].tolist(), masks, strict=True)], skip_special_tokens=True)


def _overlong_scores(cfg: TrainConfig, batch: Batch) -> torch.Tensor:
    """DAPO's soft overlong penalty of each row: a response's length against ``rollout.max_new_tokens``; a
    conversation's tokens after the prompt (the model's and the observations', what ``max_total_tokens`` bounds and
    cuts) against ``rollout.multi_turn.max_total_tokens`` (docs/multiturn.md); a rollout function's row, its model
    tokens against ``rollout.max_new_tokens``."""
    r = cfg.reward
    if cfg.rollout.multi_turn.enabled:  # multi-turn rows
        lengths = batch["response_lengths"] + batch["observation_lengths"]
        limit = cfg.rollout.multi_turn.max_total_tokens
    else:
        lengths, limit = batch["response_lengths"], cfg.rollout.max_new_tokens
    return overlong_penalty(lengths, limit, r.overlong_buffer, r.overlong_penalty_factor).float()


def _prompt_batch(records: list[PromptRecord]) -> Batch:
    return prompt_batch([r.input_ids for r in records]).update(
        Batch.from_dict({"prompt_uid": torch.arange(len(records))}))

