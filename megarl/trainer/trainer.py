"""The run's loop around its step program: the output directory, checkpoints, validation, faults.

A step is a controller program, ``step(run) -> metrics`` (``trainer.program``; docs/programming.md §3): the built-in
PPO-family one (:mod:`megarl.recipes.rl`) or a user's given by path, both over :class:`megarl.trainer.run.Run` (the
run's roles and stages: :class:`megarl.trainer.cluster.Cluster` for the workers, the schedule's rollout source,
the stages' math from :mod:`megarl.algos`). The loop is the same for every program. Everything checkable is
checked before a worker starts (:func:`megarl.config.checks.check_config`, the program's signature, the dataset,
the reward function, the frozen models' tokens: :func:`megarl.trainer.checks.check_frozen_models`);
:func:`megarl.config.resolve.resolve` then makes every "auto" decision, and the run writes that config to
``<output_dir>/config.yaml``.
Checkpoints every ``save_every`` steps (the program's ``run.state`` with them); a new run in the same output
directory resumes from the newest intact one (:func:`megarl.checkpoint.run.resume_point`), or reports "already
complete" without starting a worker. Faults: the run holds its output directory
(:class:`megarl.trainer.lock.RunLock`); a stop signal ends it after the step in progress with a checkpoint
(:mod:`megarl.trainer.signals`, exit status 75); a lost worker (a process or node that died or hung) makes
:meth:`Trainer.fit` replace every worker and resume from the newest intact checkpoint, up to
``trainer.max_restarts`` times in ``trainer.restart_window_s``, each an incident in ``incidents.jsonl``.

A response's reward is ``reward.function_weight * function + reward_model.weight * reward model`` over
the sources configured (each of ``reward.functions`` with its own weight in place of the one function).
ReMax samples one greedy response per prompt in the same rollout phase as the sampled ones; its reward
(same sources) is the prompt's baseline. Validation (:meth:`megarl.trainer.run.Run.validate`) only samples and
scores: no training forward, no checks that tie it to the training distribution.
"""

from __future__ import annotations

import importlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megarl.algos.plugins import is_spec
from megarl.checkpoint import run as run_checkpoints
from megarl.config.checks import check_config
from megarl.config.resolve import resolve, stop_token_ids
from megarl.config.train import (
    PROGRAM_SIGNATURE,
    PROGRAMS,
    CorruptCheckpoint,
    Role,
    TrainConfig,
    dump_config,
    to_plain,
)
from megarl.config.user_code import load_function
from megarl.controller.handles import WorkerError
from megarl.data.batch import Batch
from megarl.data.examples import load_examples
from megarl.data.prompts import load_prompts, load_row_adapter
from megarl.errors import MegarlError, RunStopped, WorkersLostError
from megarl.metrics import trace
from megarl.metrics.tracking import Tracker
from megarl.parallel import cpu_compat
from megarl.rewards.monitor import RewardMonitor
from megarl.rewards.user import resolve_reward_function
from megarl.trainer.callbacks import Callback
from megarl.trainer.checks import check_frozen_models, check_rollout_function, policy_vocab_size
from megarl.trainer.experience import Experience
from megarl.trainer.lock import RunLock
from megarl.trainer.run import ProgramError, Run, StageTimer
from megarl.trainer.signals import Abandoned, StopRequest
from megarl.trainer.sources import RolloutSource, make_source

if TYPE_CHECKING:
    from megarl.trainer.cluster import Cluster

logger = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: TrainConfig, callbacks: tuple[Callback, ...] = ()) -> None:
        check_config(cfg)
        cfg = resolve(cfg)
        for pool in cfg.cluster.pools.values():  # what layout: auto chose (config.yaml records it too)
            if pool.auto_reason:
                logger.info("%s", pool.auto_reason)
        self.cfg, self.callbacks = cfg, callbacks
        self.out = Path(cfg.trainer.output_dir)
        self.tokenizer = _load_tokenizer(cfg.model.tokenizer)
        check_frozen_models(cfg, self.tokenizer)
        self.train_data = self._load_data(cfg.data.train)
        self.val_data = self._load_data(cfg.data.val) if cfg.data.val else None
        self.reward_fns = ({} if cfg.example_kind is not None  # an offline program scores nothing
                           else {name: resolve_reward_function(spec.function, **spec.options)
                                 for name, spec in cfg.reward.named_functions().items()})
        self._check_reward_columns()
        self.stop_token_ids = stop_token_ids(cfg.rollout, self.tokenizer.eos_token_id)
        check_rollout_function(cfg, self.tokenizer, self.stop_token_ids)
        self.stop = StopRequest()
        self.lock = RunLock(self.out)
        self.program = load_program(cfg.trainer.program)
        self.cluster: Cluster | None = None
        self.source: RolloutSource | None = None  # the schedule: where each step's rows come from
        self.run: Run | None = None  # the step program's view of the workers
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
        """The driver's state at step 0 (a checkpoint's state is loaded over it): the program's run starts anew
        (its algorithm state: the KL controller, ``run.state``) over the current workers."""
        self.step = self.saved_step = 0
        self.run = None if self.cluster is None else Run(self.cfg, self.cluster, self.experience, self.source,
                                                         self.tokenizer, self.val_data, self._stage)

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
        self.source = make_source(self.cfg, self.cluster, self.experience, self.train_data, self._pad_token_id())
        self._reset()
        if self.resume_from is not None:
            self._restore(self.resume_from)

    def _newest_intact(self) -> Path | None:
        """The checkpoint to resume from (``trainer.on_corrupt_checkpoint`` decides about corrupt ones)."""
        fallback = self.cfg.trainer.on_corrupt_checkpoint is CorruptCheckpoint.FALLBACK
        return run_checkpoints.resume_point(self.out, fallback=fallback)

    def _pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else 0

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
        d, kind = self.cfg.data, self.cfg.example_kind
        if kind is not None:  # an offline program's examples, tokenized as TRL's trainers do
            o = self.cfg.offline
            return load_examples(path, kind, self.tokenizer, max_length=o.max_length,
                                 truncation=o.truncation, completion_only_loss=o.completion_only_loss,
                                 assistant_only_loss=o.assistant_only_loss,
                                 for_reward_model=Role.CRITIC in self.cfg.roles())
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
                    # logged before the checkpoint: a kill between the two loses no record (a resume drops the
                    # records after its checkpoint and redoes those steps)
                    tracker.log(self.step, metrics)
                    self._save_if_due()
                except WorkerError as e:
                    if not e.lost:
                        raise
                    self._recover(e, tracker)
                    continue
                history.append(metrics)
                for cb in self.callbacks:
                    cb.on_step_end(self.step, metrics)
            if self.stop.requested:
                self._stop()
        return history

    def _step(self) -> dict[str, float]:
        """One training step and its validation (:meth:`fit` logs it, then checkpoints when due)."""
        t = self.cfg.trainer
        self.step += 1
        start = time.perf_counter()
        # the driver's own code (rewards included) runs without the CUDA -> CPU redirection the local launcher's
        # world of one installed in this process, as a role's methods do (megarl/parallel/cpu_compat.py)
        with cpu_compat.suspended(), trace.span(f"step {self.step}", cat="step"):
            metrics = self._program_step()
            if t.val_every and self.step % t.val_every == 0:
                timer = StageTimer()
                with timer("validation"):
                    metrics |= self.run.validate()
                metrics |= timer.metrics()
        metrics["timing/step_s"] = time.perf_counter() - start
        metrics["run/restarts"] = float(self.restarts)
        return metrics

    def _save_if_due(self) -> None:
        t = self.cfg.trainer
        if (t.save_every and self.step % t.save_every == 0) or self.complete:
            self.save()

    def _program_step(self) -> dict[str, float]:
        """The program's step with its stage times (``timing/<stage>_s``) and, when it reports ``batch/tokens``,
        ``throughput/tokens_per_s`` over them."""
        run = self.run
        run.step, run.timer = self.step, StageTimer()
        metrics = self.program(run)
        if not isinstance(metrics, dict) or not all(isinstance(k, str) for k in metrics):
            raise ProgramError(f"the step program {self.cfg.trainer.program!r} returned a {type(metrics).__name__} in "
                               f"step {self.step}; expected its metrics, a dict of str -> float "
                               f"({PROGRAM_SIGNATURE}). Return {{}} for none.")
        metrics = metrics | run.timer.metrics()
        if metrics.get("batch/tokens"):
            metrics["throughput/tokens_per_s"] = metrics["batch/tokens"] / max(sum(run.timer.seconds.values()), 1e-9)
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
        self.source = make_source(self.cfg, self.cluster, self.experience, self.train_data, self._pad_token_id())
        self._reset()
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

    def _stage(self, stage: str, batch: Batch) -> None:
        for cb in self.callbacks:
            cb.on_stage_end(stage, self.step, batch)

    # --------------------------------------------------------------------------------- checkpoints

    def save(self) -> Path:
        tmp = run_checkpoints.begin(self.out, self.step)
        self.cluster.save(tmp, self.step)
        state = {"step": self.step, **self.source.state(),  # where a resume draws prompts again
                 "kl_coef": self.run.kl_ctl.value if self.run.kl_ctl is not None else None,
                 "program": self.run.state}
        final = run_checkpoints.commit(tmp, self.step, state, self.cfg.trainer.keep_checkpoints)
        self.saved_step = self.step
        logger.info("checkpoint written: %s", final)
        return final

    def _restore(self, ckpt: Path) -> None:
        state = run_checkpoints.read_state(ckpt)
        self.cluster.load(ckpt)
        self.step = self.saved_step = state["step"]
        self.source.restore(state)
        if self.run.kl_ctl is not None and state["kl_coef"] is not None:
            self.run.kl_ctl.value = state["kl_coef"]
        self.run.state = state.get("program", {})
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


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records of steps after the checkpoint (a crashed run logged them; they are redone)."""
    if path.exists():
        keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in keep))


def _load_tokenizer(path: str):
    """The tokenizer as saved (not what a config.json beside it makes ``AutoTokenizer`` choose)."""
    from megarl.data.tokenizer import load_tokenizer

    return load_tokenizer(path)


def load_program(program: str) -> Callable[[Run], dict[str, float]]:
    """The step program ``trainer.program`` names: a built-in's ``step`` (:data:`megarl.config.train.PROGRAMS`) or a
    function by path (its signature was checked with the config)."""
    if is_spec(program):
        return load_function(program, "program", (None,), PROGRAM_SIGNATURE)
    module, function = PROGRAMS[program].target.split(":")
    return getattr(importlib.import_module(module), function)


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
