"""What a controller program's step sees: :class:`Run`, the run's roles and stages behind one object.

A program is a function ``step(run: Run) -> dict[str, float]`` that does one training step's dataflow and returns
its metrics (docs/programming.md §3). The built-in PPO-family step is one (:mod:`megarl.recipes.rl`); a user's
is given by path (``megarl run my_algo.py CONFIG``, or ``trainer.program: my_algo.py:step``). The loop around it
(:class:`megarl.trainer.trainer.Trainer`) is the same for both: config checks and resolution, the output
directory and its lock, validation, checkpoints (with the program's :attr:`Run.state`), stop signals and
restarts after a lost worker; a restart builds a new :class:`Run` over the new workers and restores its state.

The stages (each a method taking and extending a :class:`~megarl.data.batch.Batch`, returning metrics) are the
built-in step's, so a program that reorders, drops or adds stages keeps the math and the checks of the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from megarl import algos
from megarl.config.train import TrainConfig
from megarl.data.batch import Batch
from megarl.data.prompts import PromptDataset, PromptRecord
from megarl.engine.results import mean_metrics
from megarl.errors import MegarlError
from megarl.metrics import trace
from megarl.rollout.base import SamplingConfig
from megarl.rollout.mismatch import logprob_abs_diff, mismatch_error

if TYPE_CHECKING:
    from megarl.trainer.cluster import Cluster
    from megarl.trainer.experience import Experience
    from megarl.trainer.sources import RolloutSource

logger = logging.getLogger(__name__)


class ProgramError(MegarlError):
    """A controller program returned something that is not a step's metrics."""


class StageTimer:
    """Seconds per named stage of one step (``timing/<stage>_s``); each stage is also a trace span."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        with trace.span(stage, cat="stage"):
            yield
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing/{k}_s": v for k, v in self.seconds.items()}


class Run:
    """One run's roles and stages, as a step program uses them (module docstring).

    Attributes a program reads: ``cfg`` (the resolved config), ``step`` (the step being run, from 1: the policy
    holds the weights of version ``step - 1``), ``cluster`` (the typed role calls:
    :class:`megarl.trainer.cluster.Cluster`), ``tokenizer``, and ``state``: a dict of the program's own values
    (JSON types: numbers, strings, lists, dicts), saved with every checkpoint and restored on resume.
    """

    def __init__(self, cfg: TrainConfig, cluster: Cluster, experience: Experience, source: RolloutSource,
                 tokenizer: Any, val_data: PromptDataset | None, notify: Callable[[str, Batch], None]) -> None:
        self.cfg, self.cluster, self.experience, self.source = cfg, cluster, experience, source
        self.tokenizer, self.val_data = tokenizer, val_data
        self.notify = notify  # the callbacks' on_stage_end(stage, step, batch)
        self.step = 0
        self.state: dict[str, Any] = {}
        self.timer = StageTimer()
        a = cfg.algorithm
        self.kl_ctl = algos.build_kl_controller(a.kl_penalty) if a.kl_penalty is not None else None

    def stage(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Time a block as stage ``name`` of this step (``timing/<name>_s``; times of one name add up)."""
        return self.timer(name)

    # ------------------------------------------------------------------------------ rows

    def rollout(self) -> tuple[Batch, dict[str, float]]:
        """This step's scored rows from the schedule (``rollout.schedule``: sync, one step off, async), grouped by
        prompt (``prompt_uid`` numbers the groups from 0), with ``scores``, ``policy_version`` and the rollout's
        fields; dynamic sampling's groups already filtered. Its metrics: weight syncs, rollout, rewards."""
        batch, metrics = self.source.next_batch(self.step, self.timer)
        if len(batch):
            metrics |= self._version_lag(batch)
        return batch, metrics

    def draw(self) -> list[PromptRecord]:
        """The next ``data.batch_size`` training prompts (the data order a checkpoint keeps)."""
        return self.source.draw()

    def generate(self, records: list[PromptRecord], sampling: SamplingConfig | None = None,
                 seed: int | None = None) -> Batch:
        """Responses to ``records`` from the current policy (the weights are pushed to the rollout engines first
        when they do not hold them), ``sampling.n`` per prompt (default ``rollout.sampling``), grouped by prompt;
        ``seed`` defaults to the step's. Not scored: :meth:`score`."""
        sampling = sampling or self.cfg.rollout.sampling
        synced: dict[str, float] = {}
        if not self.cluster.holds(self.step - 1):
            with self.stage("weight_sync"):
                synced = self.cluster.sync_weights(self.step - 1).metrics()
        with self.stage("rollout"):
            batch, _ = self.experience.rollout(records, sampling, self.source.seed(self.step) if seed is None else seed)
        batch.meta["metrics"] |= synced  # reported by score()
        return batch

    def score(self, batch: Batch, records: list[PromptRecord], prefix: str = "reward") -> dict[str, float]:
        """Each row's reward (``scores``) from the configured sources (reward functions, reward model, overlong
        penalty), and the rollout and reward metrics (``<prefix>/mean``, ...)."""
        with self.stage("reward"):
            num_errors = self.experience.score(batch, records)
        return self.experience.rollout_metrics(batch) | self.experience.reward_metrics(batch, prefix, num_errors)

    def examples(self) -> tuple[Batch, dict[str, float]]:
        """An offline program's rows for this step (``trainer.program``: sft, dpo, reward_model): ``data.batch_size``
        examples of ``data.train`` in the data order a checkpoint keeps, pairs as two consecutive rows (chosen,
        rejected); ``response_mask`` marks the tokens the loss counts."""
        return self.source.next_batch(self.step, self.timer)

    def sampling(self, **changes: Any) -> SamplingConfig:
        """``rollout.sampling`` with ``changes`` (e.g. ``n=8``, ``temperature=0.7``)."""
        return dataclasses.replace(self.cfg.rollout.sampling, **changes)

    # ------------------------------------------------------------------------------ stages

    def old_log_probs(self, batch: Batch) -> dict[str, float]:
        """``old_log_probs``: the training model's log-probs of the sampled tokens at the trained weights (the PPO
        ratio's denominator), compared with the rollout engine's on the samples of those weights
        (``rollout/logprob_abs_diff``; older samples' gap, which includes the updates since, is
        ``async/stale_logprob_abs_diff``)."""
        lp = self.cluster.old_log_probs(batch.select("input_ids", "attention_mask", *_routing(batch)))["log_probs"]
        batch.tensors["old_log_probs"] = lp
        fresh = (batch["policy_version"] == self.step - 1).to(lp.dtype)[:, None]
        metrics = {}
        if fresh.any():
            diff = logprob_abs_diff(lp, batch["rollout_log_probs"], batch["response_mask"] * fresh)
            limit = self.cfg.rollout.engine.max_logprob_abs_diff
            if limit is not None and diff > limit:
                raise mismatch_error(diff, limit, self.cfg.rollout.engine.lora_sync)
            metrics["rollout/logprob_abs_diff"] = diff
        if not fresh.all():
            metrics["async/stale_logprob_abs_diff"] = logprob_abs_diff(lp, batch["rollout_log_probs"],
                                                                       batch["response_mask"] * (1 - fresh))
        return metrics

    def reference_log_probs(self, batch: Batch) -> dict[str, float]:
        """``ref_log_probs``: the reference model's; ``actor/kl`` where old log-probs were computed."""
        ref = self.cluster.reference_log_probs(batch.select("input_ids", "attention_mask", "response_mask"))
        batch.tensors["ref_log_probs"] = ref["log_probs"]
        a = self.cfg.algorithm
        if "old_log_probs" not in batch:
            return {}  # no old log-probs: the update reports actor/kl from its forward at the same weights
        kl = algos.kl_divergence(batch["old_log_probs"], batch["ref_log_probs"], a.kl_estimator, a.kl_clamp)
        return {"actor/kl": algos.masked_mean(kl, batch["response_mask"]).item()}

    def reference_sequence_log_probs(self, batch: Batch) -> dict[str, float]:
        """``ref_logps`` [B]: the reference model's log-probability of each row's counted tokens (summed), at
        temperature 1 (DPO's reference term, offline or online). Already there when the source precomputed them
        (``offline.precompute_ref_log_probs``)."""
        if "ref_logps" in batch:
            return {}
        lp = self.cluster.reference_log_probs(batch.select("input_ids", "attention_mask"), temperature=1.0)
        batch.tensors["ref_logps"] = (lp["log_probs"].double() * batch["response_mask"]).sum(-1)
        return {}

    def preference_pairs(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """Scored rollout rows (``rollout.sampling.n`` >= 2 per prompt) as preference pairs, interleaved (chosen,
        rejected) like an offline DPO batch: each prompt's best-scored response against its worst (the earlier one
        chosen on a tie, as TRL's online DPO does for its two samples). Metrics as TRL's online DPO names them:
        ``objective/scores`` (mean over every row), ``objective/scores_margin`` (chosen minus rejected)."""
        scores, groups = batch["scores"].double(), batch["prompt_uid"]
        order = []
        for g in torch.unique(groups, sorted=True).tolist():
            rows = (groups == g).nonzero().flatten().tolist()
            best = max(rows, key=lambda i: (scores[i].item(), -i))  # on a tie the earliest
            order += [best, min((i for i in rows if i != best), key=lambda i: (scores[i].item(), i))]
        pairs = batch.index(order)
        margin = scores[order[0::2]] - scores[order[1::2]]
        return pairs, {"objective/scores": scores.mean().item(), "objective/scores_margin": margin.mean().item()}

    def kto_kl(self, batch: Batch) -> dict[str, float]:
        """``kto_kl`` [B]: KTO's KL estimate of this batch (TRL's: the mean over its KL rows, ``kl_*``, of the policy's
        minus the reference's summed log-prob, both at temperature 1, clamped at 0), on every row; the KL rows leave
        the batch."""
        kl = Batch.from_dict({k.removeprefix("kl_"): batch.tensors.pop(k)
                              for k in ("kl_input_ids", "kl_attention_mask", "kl_response_mask")})
        rows, mask = kl.select("input_ids", "attention_mask"), kl["response_mask"].double()
        policy = (self.cluster.old_log_probs(rows, temperature=1.0)["log_probs"].double() * mask).sum(-1)
        reference = (self.cluster.reference_log_probs(rows, temperature=1.0)["log_probs"].double() * mask).sum(-1)
        z = algos.kto_kl(policy, reference)
        batch.tensors["kto_kl"] = z.expand(len(batch)).clone()
        return {}

    def train_policy(self, batch: Batch, objective: algos.LMObjective) -> dict[str, float]:
        """One optimizer step of the policy on ``objective`` (:mod:`megarl.algos.offline`: ``SFTObjective``,
        ``DPOObjective``, ``KTOObjective``, or one of the user's with the same ``loss`` and ``report``), over the
        whole batch; its metrics under TRL's names (``loss``, ``grad_norm``, ``lr`` and the objective's)."""
        result = self.cluster.train_policy(_tensors(batch), objective)
        return dataclasses.replace(result, terms=objective.report(dict(result.terms))).metrics("")

    def train_critic(self, batch: Batch, objective: algos.ScalarObjective) -> dict[str, float]:
        """One optimizer step of the scalar-head model (the critic role) on ``objective``: reward-model training
        (``BradleyTerryObjective``); its metrics as :meth:`train_policy`'s."""
        result = self.cluster.train_critic(_tensors(batch), objective)
        return dataclasses.replace(result, terms=objective.report(dict(result.terms))).metrics("")

    def teacher_log_probs(self, batch: Batch) -> dict[str, float]:
        """``teacher_log_probs``: the distillation teacher's log-probs of the sampled tokens, and
        ``distill/reverse_kl``: the k1 estimate of KL(policy || teacher) per token, from the policy's own sampling
        log-probs."""
        lp = self.cluster.teacher_log_probs(batch.select("input_ids", "attention_mask"))["log_probs"]
        batch.tensors["teacher_log_probs"] = lp
        mask = batch["response_mask"]
        return {"distill/reverse_kl": algos.masked_mean(student_log_probs(batch) - lp, mask).item(),
                "distill/teacher_log_prob": algos.masked_mean(lp, mask).item()}

    def values(self, batch: Batch) -> dict[str, float]:
        """``values``: the critic's value of every token."""
        batch.tensors["values"] = self.cluster.values(batch.select("input_ids", "attention_mask"))["values"]
        return {}

    def advantages(self, batch: Batch) -> dict[str, float]:
        """``advantages`` and ``returns`` by ``algorithm.advantage.estimator``, from ``scores`` shaped per token
        (the distillation teacher's KL term, the reward KL penalty: whichever the config has)."""
        a, mask = self.cfg.algorithm, batch["response_mask"]
        teacher = None if self.cfg.teacher is None else algos.TeacherKL(  # on-policy distillation
            self.cfg.teacher.kl_coef, batch["teacher_log_probs"], student_log_probs(batch))
        penalty = None if self.kl_ctl is None else algos.RewardKLPenalty(
            self.kl_ctl.value, batch["old_log_probs"], batch["ref_log_probs"], a.kl_estimator, a.kl_clamp)
        shaped = algos.token_rewards(batch["scores"], mask, teacher=teacher, kl_penalty=penalty)
        if shaped.mean_kl is not None:  # the controller is stateful: its update stays here
            self.kl_ctl.update(shaped.mean_kl.item(), n_steps=len(batch))
        metrics = {f"actor/{k}": v for k, v in shaped.metrics.items()}
        inputs = algos.AdvantageInputs(shaped.rewards, mask, values=batch["values"] if a.needs_critic else None,
                                       group_ids=batch["prompt_uid"],
                                       baseline_rewards=batch["baseline_scores"] if a.needs_greedy_baseline else None)
        adv = algos.compute_advantages(a.advantage, inputs)
        batch.tensors["advantages"], batch.tensors["returns"] = adv.advantages, adv.returns
        self.notify("advantages", batch)
        return metrics | {"advantages/mean": algos.masked_mean(adv.advantages, mask).item(),
                          "advantages/max": adv.advantages[mask.bool()].max().item(),
                          "advantages/min": adv.advantages[mask.bool()].min().item()}

    def mask_truncated(self, batch: Batch) -> dict[str, float]:
        """DAPO's overlong filtering: responses cut at ``max_new_tokens`` count for nothing in the policy loss."""
        cut = torch.tensor([f == "length" for f in batch["finish_reasons"]])
        batch.tensors["response_mask"] = batch["response_mask"] * (~cut).to(batch["response_mask"].dtype)[:, None]
        return {"response/truncated_masked_frac": cut.float().mean().item()}

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """The critic's updates on ``returns`` (``algorithm.ppo_epochs`` x ``mini_batches``), mean metrics."""
        fields = ("input_ids", "attention_mask", "response_mask", "returns", "values")
        train = batch.select(*fields).update(Batch.from_dict({"old_values": batch["values"]}))
        return mean_metrics([self.cluster.update_critic(mb) for mb in self._mini_batches(train)], "critic/")

    def update_policy(self, batch: Batch) -> dict[str, float]:
        """The policy's updates (``algorithm.ppo_epochs`` x ``mini_batches``) with the configured policy loss, on
        ``advantages`` and whichever of ``old_log_probs``, ``rollout_log_probs`` and ``ref_log_probs`` the loss
        terms read; mean metrics."""
        a = self.cfg.algorithm
        fields = ["input_ids", "attention_mask", "response_mask", "advantages"]
        if a.recompute_old_log_probs:
            fields.append("old_log_probs")
        if a.rollout_correction.active or not a.recompute_old_log_probs:  # the correction's denominator; the check
            fields.append("rollout_log_probs")
        if a.kl_loss_coef:
            fields.append("ref_log_probs")
        train = batch.select(*fields, *_routing(batch))
        return mean_metrics([self.cluster.update_policy(mb) for mb in self._mini_batches(train)], "actor/")

    def _mini_batches(self, batch: Batch) -> Iterator[Batch]:
        a = self.cfg.algorithm
        for _ in range(a.ppo_epochs):
            yield from batch.chunk(a.mini_batches)

    def end(self, batch: Batch) -> dict[str, float]:
        """The step's last stage: the callbacks' ``step`` notice, the workers' memory peaks, the batch's size."""
        with self.stage("bookkeeping"):  # part of the step's time
            self.notify("step", batch)
            metrics = self.cluster.memory_peaks()
        tokens = float(batch["attention_mask"].sum())
        return metrics | {"batch/tokens": tokens, "batch/num_sequences": float(len(batch))}

    def validate(self) -> dict[str, float]:
        """Sample the validation prompts with ``rollout.validation`` at the current weights and score them:
        sampling only (no training forward, no log-prob check), so any temperature and ``n`` work. An offline
        program's validation is its objective on ``data.val`` (:meth:`evaluate`)."""
        program = self.cfg.builtin_program
        if program is not None and program.offline:
            return self.evaluate(getattr(self.cfg.offline, self.cfg.trainer.program))
        records = self.val_data.records
        self.cluster.sync_weights(self.step)
        batch, _ = self.experience.rollout(records, self.cfg.rollout.validation, self.source.seed(self.step))
        num_errors = self.experience.score(batch, records, stage="validation")
        return self.experience.reward_metrics(batch, "val/reward", num_errors)

    def evaluate(self, objective: algos.LMObjective | algos.ScalarObjective) -> dict[str, float]:
        """``objective``'s loss and metrics on all of ``data.val`` (examples) at the current weights, forward only,
        as ``val/<name>`` (TRL's ``eval_<name>``, over the whole set at once: TRL averages per-batch values, equal
        when its eval batches are of equal size; KTO's KL estimate is the whole set's)."""
        batch = self.source.rows(self.val_data)
        if "kl_input_ids" in batch:
            self.kto_kl(batch)
        rows = batch.select("input_ids", "attention_mask")
        mb = dict(_tensors(batch).tensors.items()) | {"sample_mask": torch.ones(len(batch))}
        counts = algos.Counts(tokens=float(batch["response_mask"].sum()), rows=float(len(batch)))
        if self.cluster.policy is None:  # the trained model is the scalar-head one (reward-model training)
            loss, terms = objective.loss(self.cluster.critic_scores(rows)["scores"], mb, counts)
        else:
            if self.cluster.has_reference:
                self.reference_sequence_log_probs(batch)
                mb["ref_logps"] = batch["ref_logps"]
            out = self.cluster.old_log_probs(rows, temperature=1.0)
            loss, terms = objective.loss(out["log_probs"].double(), out["entropy"].double(), mb, counts)
        metrics = {"loss": float(loss)} | objective.report({k: float(v) for k, v in terms.items()})
        return {f"val/{k}": v for k, v in metrics.items()}

    def _version_lag(self, batch: Batch) -> dict[str, float]:
        """How many updates behind the trained weights each sample's generating weights are; at most what the
        schedule guarantees (``rollout.max_version_lag``)."""
        lag = (self.step - 1 - batch["policy_version"]).float()
        bound = self.cfg.rollout.max_version_lag
        if lag.min() < 0 or lag.max() > bound:
            raise RuntimeError(f"step {self.step} would train on samples {lag.min():.0f}..{lag.max():.0f} versions "
                               f"behind the policy; rollout.schedule={self.cfg.rollout.schedule.value} allows 0.."
                               f"{bound}. This is a bug in megarl's version accounting.")
        return {"async/version_lag_min": lag.min().item(), "async/version_lag_mean": lag.mean().item(),
                "async/version_lag_max": lag.max().item()}


def student_log_probs(batch: Batch) -> torch.Tensor:
    """The policy's log-probs of its sampled tokens at the sampling weights: the training model's where they
    were recomputed, else the rollout engine's (the same up to ``rollout/logprob_abs_diff``)."""
    return batch["old_log_probs"] if "old_log_probs" in batch else batch["rollout_log_probs"]


def _tensors(batch: Batch) -> Batch:
    """The batch's tensors only (an objective reads no per-row Python lists: they need not cross to the workers)."""
    return batch.select(*batch.tensors.keys())


def _routing(batch: Batch) -> tuple[str, ...]:
    """The rollout's recorded MoE routing, when the batch has it: the policy's forwards compare their own routing
    with it (``actor/moe_routing_disagreement``) and, with ``policy.router_replay``, replay it."""
    return ("routed_experts",) if "routed_experts" in batch.tensors else ()
