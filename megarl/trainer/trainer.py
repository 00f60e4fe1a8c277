"""The RL fit loop: weight sync -> rollout and rewards (:mod:`megarl.trainer.experience`) -> (old log-probs)
-> reference -> teacher -> values -> advantages -> updates.

The driver holds the algorithm; workers (the policy with its rollout engine, reference, critic, reward
model, distillation teacher: :class:`megarl.trainer.cluster.Cluster`) do the model work. Each stage is a
named method run inside a named timer, and :meth:`Trainer.train_step` reads as the recipe. Everything
checkable is checked before a worker starts (:func:`megarl.config.train.check_config`, the dataset, the
reward function, the frozen models' tokens: :func:`megarl.trainer.checks.check_frozen_models`);
:func:`megarl.config.resolve.resolve` then makes every "auto" decision, and the run writes that config
to ``<output_dir>/config.yaml``.
Checkpoints every ``save_every`` steps; a new run in the same output directory resumes from the newest
intact one (:func:`megarl.checkpoint.run.resume_point`), or reports "already complete" without starting
a worker. Faults: the run holds its output directory (:class:`megarl.trainer.lock.RunLock`); a stop
signal ends it after the step in progress with a checkpoint (:mod:`megarl.trainer.signals`, exit status
75); a lost worker (a process or node that died or hung) makes :meth:`Trainer.fit` replace every worker
and resume from the newest intact checkpoint, up to ``trainer.max_restarts`` times in
``trainer.restart_window_s``, each an incident in ``incidents.jsonl``.

Old log-probs (the PPO ratio's denominator) come from a training-model forward after generation only
where ``algorithm.recompute_old_log_probs``; otherwise the one policy update per batch stands in for
them and reports ``rollout/logprob_abs_diff`` and ``actor/kl`` from its own forward at the same weights.

A response's reward is ``reward.function_weight * function + reward_model.weight * reward model`` over
the sources configured (each of ``reward.functions`` with its own weight in place of the one function).
ReMax samples one greedy response per prompt in the same rollout phase as the sampled ones; its reward
(same sources) is the prompt's baseline. Validation (:meth:`Trainer.validate`) only samples and scores:
no training forward, no checks that tie it to the training distribution.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megarl import algos
from megarl.checkpoint import run as run_checkpoints
from megarl.config.resolve import resolve, stop_token_ids
from megarl.config.train import CorruptCheckpoint, TrainConfig, check_config, dump_config, to_plain
from megarl.controller.handles import WorkerError
from megarl.data.batch import Batch
from megarl.data.prompts import load_prompts, load_row_adapter
from megarl.engine.results import mean_metrics
from megarl.errors import MegarlError, RunStopped, WorkersLostError
from megarl.metrics import trace
from megarl.metrics.tracking import Tracker
from megarl.parallel import cpu_compat
from megarl.rewards.monitor import RewardMonitor
from megarl.rewards.user import resolve_reward_function
from megarl.rollout.mismatch import logprob_abs_diff, mismatch_error
from megarl.trainer.callbacks import Callback
from megarl.trainer.checks import check_frozen_models, policy_vocab_size
from megarl.trainer.experience import Experience
from megarl.trainer.lock import RunLock
from megarl.trainer.signals import Abandoned, StopRequest
from megarl.trainer.sources import RolloutSource, make_source

if TYPE_CHECKING:
    from megarl.trainer.cluster import Cluster

logger = logging.getLogger(__name__)


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


class Trainer:
    def __init__(self, cfg: TrainConfig, callbacks: tuple[Callback, ...] = ()) -> None:
        check_config(cfg)
        cfg = resolve(cfg)
        self.cfg, self.callbacks = cfg, callbacks
        self.out = Path(cfg.trainer.output_dir)
        self.tokenizer = _load_tokenizer(cfg.model.tokenizer)
        check_frozen_models(cfg, self.tokenizer)
        self.train_data = self._load_data(cfg.data.train)
        self.val_data = self._load_data(cfg.data.val) if cfg.data.val else None
        self.reward_fns = {name: resolve_reward_function(spec.function, **spec.options)
                           for name, spec in cfg.reward.named_functions().items()}
        self._check_reward_columns()
        self.stop_token_ids = stop_token_ids(cfg.rollout, self.tokenizer.eos_token_id)
        self.stop = StopRequest()
        self.lock = RunLock(self.out)
        self.cluster: Cluster | None = None
        self.source: RolloutSource | None = None  # the schedule: where each step's rows come from
        self.restarts = 0  # workers replaced so far (run/restarts)
        self._restart_times: list[float] = []  # monotonic times of the restarts within trainer.restart_window_s
        self._reset()
        self.stop.install()
        try:
            self.lock.acquire()  # before anything is written to output_dir
            self._start()
        except BaseException:
            self.close()
            raise

    def _reset(self) -> None:
        """The driver's state at step 0 (a checkpoint's state is loaded over it)."""
        cfg = self.cfg
        self.step = self.saved_step = 0
        a = cfg.algorithm
        self.kl_ctl = algos.build_kl_controller(a.kl_penalty) if a.kl_penalty is not None else None

    def _start(self) -> None:
        """Find the checkpoint to resume from; start the workers unless the run is complete already."""
        for stale in run_checkpoints.remove_stale(self.out):
            logger.info("removed %s, a checkpoint an ended run did not finish writing", stale)
        dump_config(self.cfg, self.out / "config.yaml")
        t = self.cfg.trainer
        self.resume_from = self._newest_intact() if t.resume else None
        if self.resume_from is not None:
            done = int(run_checkpoints.read_state(self.resume_from)["step"])
            if done >= t.total_steps:
                self.step = done
                logger.info("already complete at step %d (trainer.total_steps=%d, checkpoint %s): nothing to do; "
                            "raise trainer.total_steps to train further", done, t.total_steps, self.resume_from)
                return
        from megarl.trainer.cluster import Cluster  # Ray and the workers: only once the config is known good

        self.cluster = Cluster(self.cfg, self.out, on_ray_started=self.stop.install)  # Ray replaces SIGTERM's handler
        self.experience = Experience(self.cfg, self.cluster, self.tokenizer, self.reward_fns, self.stop_token_ids,
                                     self._stage)
        self.source = make_source(self.cfg, self.cluster, self.experience, self.train_data)
        if self.resume_from is not None:
            self._restore(self.resume_from)

    def _newest_intact(self) -> Path | None:
        """The checkpoint to resume from (``trainer.on_corrupt_checkpoint`` decides about corrupt ones)."""
        fallback = self.cfg.trainer.on_corrupt_checkpoint is CorruptCheckpoint.FALLBACK
        return run_checkpoints.resume_point(self.out, fallback=fallback)

    @property
    def complete(self) -> bool:
        return self.step >= self.cfg.trainer.total_steps

    def _check_reward_columns(self) -> None:
        """Before any worker starts: every reward function can read the columns it needs from the datasets' rows
        (a keyword-style parameter without a default that no column fills is a ConfigError naming both)."""
        monitor = RewardMonitor()
        for data in (self.train_data, self.val_data):
            if data is not None:
                for name, fn in self.reward_fns.items():
                    monitor.check_columns(name, fn, [r.row for r in data.records])

    def _load_data(self, path: str):
        d = self.cfg.data
        adapter = load_row_adapter(d.row_adapter) if d.row_adapter else None
        # it warns of dropped prompts and refuses ones the tokenizer cannot represent or the model cannot embed
        return load_prompts(path, d, self.tokenizer, adapter, vocab_size=policy_vocab_size(self.cfg))

    # --------------------------------------------------------------------------------------- loop

    def fit(self) -> list[dict[str, float]]:
        """Train to ``trainer.total_steps``; the metrics of each step this call ran. A lost worker is
        replaced (:meth:`_recover`); a stop signal ends the run after the step in progress (:meth:`_stop`)."""
        t = self.cfg.trainer
        history: list[dict[str, float]] = []
        if self.complete:
            return history
        with Tracker(self.out, total_steps=t.total_steps, start_step=self.step, tensorboard=t.tensorboard,
                     wandb_project=t.wandb_project, run_config=to_plain(self.cfg)) as tracker:
            self.stop.in_loop = True
            while not self.complete and not self.stop.requested:
                try:
                    metrics = self._step()
                except WorkerError as e:
                    if not e.lost:
                        raise
                    self._recover(e, tracker)
                    continue
                tracker.log(self.step, metrics)
                history.append(metrics)
                for cb in self.callbacks:
                    cb.on_step_end(self.step, metrics)
            if self.stop.requested:
                self._stop()
        return history

    def _step(self) -> dict[str, float]:
        """One training step, its validation and its checkpoint when due."""
        t = self.cfg.trainer
        self.step += 1
        start = time.perf_counter()
        # the driver's own code (rewards included) runs without the CUDA -> CPU redirection the local launcher's
        # world of one installed in this process, as a role's methods do (megarl/parallel/cpu_compat.py)
        with cpu_compat.suspended(), trace.span(f"step {self.step}", cat="step"):
            metrics = self.train_step()
            if t.val_every and self.step % t.val_every == 0:
                timer = StageTimer()
                with timer("validation"):
                    metrics |= self.validate()
                metrics |= timer.metrics()
        metrics["timing/step_s"] = time.perf_counter() - start
        metrics["run/restarts"] = float(self.restarts)
        if (t.save_every and self.step % t.save_every == 0) or self.complete:
            self.save()
        return metrics

    def _recover(self, error: WorkerError, tracker: Tracker) -> None:
        """Replace every worker after ``error`` lost one, resume from the newest intact checkpoint, record
        the incident; at most ``trainer.max_restarts`` times within ``trainer.restart_window_s``."""
        t, now, failed_step = self.cfg.trainer, time.monotonic(), self.step
        self._restart_times = [r for r in self._restart_times if now - r < t.restart_window_s]
        if len(self._restart_times) >= t.max_restarts:
            raise WorkersLostError(
                f"{error} The run restarted its workers {len(self._restart_times)} time(s) within the last "
                f"{t.restart_window_s:.0f} s (trainer.max_restarts={t.max_restarts}); it stops here and resumes from "
                "its newest intact checkpoint when run again.") from error
        self._restart_times.append(now)
        self.restarts += 1
        where = f"pid {error.pid} on {error.host} ({error.node_ip})" if error.host is not None else "host unknown"
        logger.warning("worker lost in step %d (rank %s, hosting %s, %s; noticed by a %s call): restarting the "
                       "workers (restart %d of at most %d within %.0f s)", failed_step, error.rank,
                       "+".join(error.roles), where, error.role, len(self._restart_times), t.max_restarts,
                       t.restart_window_s)
        ckpt = self._newest_intact()
        self.source.close()  # stops the asynchronous producer before its workers go
        try:
            self.cluster.restart()
        except MegarlError as e:
            raise WorkersLostError(f"{error} Fresh workers could not be started ({e}); the run resumes from its "
                                   "newest intact checkpoint when run again (on a new allocation if a node is "
                                   "gone).") from e
        self._reset()
        self.source = make_source(self.cfg, self.cluster, self.experience, self.train_data)
        if ckpt is not None:
            self._restore(ckpt)
        tracker.rewind(self.step)
        tracker.incident({"kind": "worker_lost", "roles": list(error.roles), "rank": error.rank, "host": error.host,
                          "node_ip": error.node_ip, "pid": error.pid, "role": error.role, "failed_step": failed_step,
                          "resumed_from_step": self.step, "steps_lost": failed_step - 1 - self.step,
                          "restart": self.restarts, "error": str(error).splitlines()[0][:500]})

    def _stop(self) -> None:
        """After a stop signal: checkpoint the last finished step (``trainer.save_on_signal``), raise RunStopped."""
        t = self.cfg.trainer
        if t.save_on_signal and self.step > self.saved_step:
            where = f"checkpoint of step {self.step} written to {self.save()}"
        elif self.saved_step:
            where = f"the newest checkpoint is of step {self.saved_step}"
        else:
            where = "no checkpoint written yet (the run restarts from step 0)"
        raise RunStopped(f"{self.stop.name} received: stopped after step {self.step} of {t.total_steps}; {where}. Run "
                         "the same command to resume.")

    def train_step(self) -> dict[str, float]:
        timer = StageTimer()
        a = self.cfg.algorithm
        batch, metrics = self.source.next_batch(self.step, timer)  # generated by the weights of step - 1 or older
        if not len(batch):  # dynamic sampling found no prompt group with differing rewards: nothing to learn from
            logger.warning("step %d: no prompt group with differing rewards; the update is skipped", self.step)
            return metrics | timer.metrics() | {"batch/tokens": 0.0, "batch/num_sequences": 0.0}
        metrics |= self._version_lag(batch)
        if a.recompute_old_log_probs:
            with timer("old_log_probs"):
                metrics |= self.old_log_probs(batch)
        if a.needs_reference:
            with timer("reference"):
                metrics |= self.reference_log_probs(batch)
        if self.cfg.teacher is not None:
            with timer("teacher"):
                metrics |= self.teacher_log_probs(batch)
        if a.needs_critic:
            with timer("values"):
                self.values(batch)
        with timer("advantages"):
            metrics |= self.advantages(batch)
        if a.needs_critic:
            with timer("update_critic"):
                metrics |= self.update_critic(batch)
        if a.mask_truncated:  # DAPO overlong filtering: from here on (the policy loss) they count for nothing
            cut = torch.tensor([f == "length" for f in batch["finish_reasons"]])
            batch.tensors["response_mask"] = batch["response_mask"] * (~cut).to(batch["response_mask"].dtype)[:, None]
            metrics["response/truncated_masked_frac"] = cut.float().mean().item()
        if batch["response_mask"].any():
            with timer("update_policy"):
                metrics |= self.update_policy(batch)
        else:  # every response was cut at max_new_tokens and masked: no token to learn from
            logger.warning("step %d: every response was truncated (algorithm.mask_truncated): no policy update",
                           self.step)
        with timer("bookkeeping"):  # callbacks and the workers' memory peaks: part of the step's time
            self._stage("step", batch)
            metrics |= self.cluster.memory_peaks()
        tokens = float(batch["attention_mask"].sum())
        metrics |= timer.metrics() | {"batch/tokens": tokens, "batch/num_sequences": float(len(batch))}
        metrics["throughput/tokens_per_s"] = tokens / max(sum(timer.seconds.values()), 1e-9)
        return metrics

    # ------------------------------------------------------------------------------------- stages

    def old_log_probs(self, batch: Batch) -> dict[str, float]:
        """The training model's log-probs of the sampled tokens at the trained weights (the PPO ratio's
        denominator), compared with the rollout engine's on the samples of those weights
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
                raise mismatch_error(diff, limit)
            metrics["rollout/logprob_abs_diff"] = diff
        if not fresh.all():
            metrics["async/stale_logprob_abs_diff"] = logprob_abs_diff(lp, batch["rollout_log_probs"],
                                                                       batch["response_mask"] * (1 - fresh))
        return metrics

    def reference_log_probs(self, batch: Batch) -> dict[str, float]:
        ref = self.cluster.reference_log_probs(batch.select("input_ids", "attention_mask", "response_mask"))
        batch.tensors["ref_log_probs"] = ref["log_probs"]
        a = self.cfg.algorithm
        if not a.recompute_old_log_probs:
            return {}  # no old log-probs: the update reports actor/kl from its forward at the same weights
        kl = algos.kl_divergence(batch["old_log_probs"], batch["ref_log_probs"], a.kl_estimator, a.kl_clamp)
        return {"actor/kl": algos.masked_mean(kl, batch["response_mask"]).item()}

    def teacher_log_probs(self, batch: Batch) -> dict[str, float]:
        """The distillation teacher's log-probs of the sampled tokens, and ``distill/reverse_kl``: the k1
        estimate of KL(policy || teacher) per token, from the policy's own sampling log-probs."""
        lp = self.cluster.teacher_log_probs(batch.select("input_ids", "attention_mask"))["log_probs"]
        batch.tensors["teacher_log_probs"] = lp
        mask = batch["response_mask"]
        return {"distill/reverse_kl": algos.masked_mean(_student_log_probs(batch) - lp, mask).item(),
                "distill/teacher_log_prob": algos.masked_mean(lp, mask).item()}

    def values(self, batch: Batch) -> None:
        batch.tensors["values"] = self.cluster.values(batch.select("input_ids", "attention_mask"))["values"]

    def advantages(self, batch: Batch) -> dict[str, float]:
        a, mask = self.cfg.algorithm, batch["response_mask"]
        teacher = None if self.cfg.teacher is None else algos.TeacherKL(  # on-policy distillation
            self.cfg.teacher.kl_coef, batch["teacher_log_probs"], _student_log_probs(batch))
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
        self._stage("advantages", batch)
        return metrics | {"advantages/mean": algos.masked_mean(adv.advantages, mask).item(),
                          "advantages/max": adv.advantages[mask.bool()].max().item(),
                          "advantages/min": adv.advantages[mask.bool()].min().item()}

    def update_critic(self, batch: Batch) -> dict[str, float]:
        fields = ("input_ids", "attention_mask", "response_mask", "returns", "values")
        train = batch.select(*fields).update(Batch.from_dict({"old_values": batch["values"]}))
        return mean_metrics([self.cluster.update_critic(mb) for mb in self._mini_batches(train)], "critic/")

    def update_policy(self, batch: Batch) -> dict[str, float]:
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

    def validate(self) -> dict[str, float]:
        """Sample the validation prompts with ``rollout.validation`` at the current weights and score them:
        sampling only (no training forward, no log-prob check), so any temperature and ``n`` work."""
        records = self.val_data.records
        self.cluster.sync_weights(self.step)
        batch, _ = self.experience.rollout(records, self.cfg.rollout.validation, self.source.seed(self.step))
        num_errors = self.experience.score(batch, records, stage="validation")
        return self.experience.reward_metrics(batch, "val/reward", num_errors)

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

    def _stage(self, stage: str, batch: Batch) -> None:
        for cb in self.callbacks:
            cb.on_stage_end(stage, self.step, batch)

    # --------------------------------------------------------------------------------- checkpoints

    def save(self) -> Path:
        tmp = run_checkpoints.begin(self.out, self.step)
        self.cluster.save(tmp, self.step)
        state = {"step": self.step, **self.source.state(),  # where a resume draws prompts again
                 "kl_coef": self.kl_ctl.value if self.kl_ctl is not None else None}
        final = run_checkpoints.commit(tmp, self.step, state, self.cfg.trainer.keep_checkpoints)
        self.saved_step = self.step
        logger.info("checkpoint written: %s", final)
        return final

    def _restore(self, ckpt: Path) -> None:
        state = run_checkpoints.read_state(ckpt)
        self.cluster.load(ckpt)
        self.step = self.saved_step = state["step"]
        self.source.restore(state)
        if self.kl_ctl is not None and state["kl_coef"] is not None:
            self.kl_ctl.value = state["kl_coef"]
        _truncate_metrics(self.out / "metrics.jsonl", self.step)
        logger.info("resumed from %s at step %d", ckpt, self.step)

    def close(self) -> None:
        """Stop the workers and the run's own Ray cluster, release the output directory, restore signals."""
        try:
            if self.cluster is not None:
                if self.source is not None:
                    self.source.close()
                self.cluster.shutdown()
        finally:
            self.lock.release()
            self.stop.restore()


def _student_log_probs(batch: Batch) -> torch.Tensor:
    """The policy's log-probs of its sampled tokens at the sampling weights: the training model's where they
    were recomputed, else the rollout engine's (the same up to ``rollout/logprob_abs_diff``)."""
    return batch["old_log_probs"] if "old_log_probs" in batch else batch["rollout_log_probs"]


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records of steps after the checkpoint (a crashed run logged them; they are redone)."""
    if path.exists():
        keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in keep))


def _load_tokenizer(path: str):
    """The tokenizer as saved (not what a config.json beside it makes ``AutoTokenizer`` choose)."""
    from megarl.data.tokenizer import load_tokenizer

    return load_tokenizer(path)


def run(cfg: TrainConfig, callbacks: tuple[Callback, ...] = ()) -> list[dict[str, Any]]:
    """Train (or resume) the run ``cfg`` describes; the metrics of the steps run. A second stop signal
    (abandoning the step in progress) ends it with :class:`RunStopped` as the first does."""
    try:
        trainer = Trainer(cfg, callbacks)
        try:
            return trainer.fit()
        finally:
            trainer.close()
    except Abandoned as e:
        raise RunStopped(f"{e}; the workers were stopped, and the newest checkpoint in trainer.output_dir is where "
                         "the same command resumes.") from None


def _routing(batch: Batch) -> tuple[str, ...]:
    """The rollout's recorded MoE routing, when the batch has it: the policy's forwards compare their own routing
    with it (``actor/moe_routing_disagreement``) and, with ``policy.router_replay``, replay it."""
    return ("routed_experts",) if "routed_experts" in batch.tensors else ()
