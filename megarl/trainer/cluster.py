"""The run's roles, seen from the driver: the pool(s) hosting policy (with its rollout engine), reference,
critic, reward model and distillation teacher, behind typed methods the trainer calls. A pool is Ray
worker processes, or (``cluster.launcher: local``) one rank in the driver process itself.

Owns Ray start-up, the one-time HF -> Megatron conversion of the starting model, the teacher and the reward
model (in a child process, so the driver never joins a torch.distributed world, except with the local
launcher, where the driver hosts the rank anyway), what each role is built with (keyword arguments
from the resolved config: :func:`megarl.config.resolve.resolve`), and the dispatch mode of each call
(data-parallel shards for forward passes, generation and updates; all ranks for transitions and
checkpoints).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from megarl import algos
from megarl.checkpoint import cpu_only
from megarl.checkpoint.format import is_checkpoint, read_meta
from megarl.config.train import ClusterConfig, Role, TrainConfig
from megarl.controller.handles import PendingCall, wait_all
from megarl.controller.placement import Placement
from megarl.controller.spec import GroupOptions, Launcher, PlacementConfig
from megarl.data.batch import Batch
from megarl.engine.results import StepResult
from megarl.errors import ClusterError, RunStopped
from megarl.host import allocator, forkserver
from megarl.models.spec import spec_from_hf_config
from megarl.roles.critic import CriticRole, RewardModelRole
from megarl.roles.policy import PolicyRole, ReferenceRole
from megarl.roles.results import WeightSync
from megarl.roles.split import RolloutRole
from megarl.rollout.base import SamplingParams
from megarl.rollout.parity import PushParity, compare, make_probe

logger = logging.getLogger(__name__)

_QUIET_WORKERS = {"PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning,ignore::UserWarning",
                  "TOKENIZERS_PARALLELISM": "false"}


class Cluster:
    """Started from a resolved config (every role placed, every "auto" decided)."""

    def __init__(self, cfg: TrainConfig, out: Path, on_ray_started: Callable[[], None] = lambda: None) -> None:
        """``on_ray_started`` runs once Ray is up, before the workers start (starting a local Ray cluster
        replaces the driver's SIGTERM handler: the trainer installs its own again)."""
        self.cfg = cfg
        c = cfg.cluster
        local = c.launcher is Launcher.LOCAL
        rm, cm, teacher = cfg.reward_model, cfg.cost_model, cfg.teacher
        # the starting model, reward model and teacher, converted from HF while Ray and the workers start
        conversions = Conversions(cfg.cluster, {
            "policy": (Path(cfg.model.path), out / "initial_checkpoint"),
            **({"reward_model": (Path(rm.model.path), out / "reward_model_checkpoint")} if rm is not None else {}),
            **({"cost_model": (Path(cm.model.path), out / "cost_model_checkpoint")} if cm is not None else {}),
            **({"teacher": (Path(teacher.model.path), out / "teacher_checkpoint")} if teacher is not None else {})})
        self.placement: Placement | None = None
        self.owns_ray, self.ray_session = False, None  # ray_session: the private cluster's session directory
        try:
            if not local:
                self.owns_ray, self.ray_session = _start_ray(c.ray_address or os.environ.get("RAY_ADDRESS"))
            on_ray_started()
            logger.info("host allocator of the driver process: %s", allocator.loaded())
            self._start_workers()
            sources = conversions.result()
            self.source, self.teacher_source = sources["policy"], sources.get("teacher")
            self.classifier_sources = {k: sources[k] for k in ("reward_model", "cost_model") if k in sources}
            self._add_roles(cfg)
        except BaseException:
            conversions.close()
            self.shutdown()
            raise

    def _start_workers(self) -> None:
        c, local = self.cfg.cluster, self.cfg.cluster.launcher is Launcher.LOCAL
        env = _QUIET_WORKERS | allocator.preload_env(c.allocator) | c.worker_env  # workers on a running cluster too
        options = GroupOptions(seed=self.cfg.trainer.seed, timeouts=c.timeouts, env=env)
        self.placement = None  # a Placement that fails to start shuts itself down
        self.placement = Placement(PlacementConfig(c.pools, dict(c.placement)), options, local=local,
                                   run=Path(self.cfg.trainer.output_dir).name)  # in the workers' process titles

    def restart(self) -> None:
        """Replace every worker (after one was lost): kill all groups and start fresh ones with the same roles
        and seeds, at the run's starting weights; the Ray cluster stays. Load a checkpoint next. The old workers
        are killed, not asked to stop: the lost one's peers may be blocked in a collective with it, and a stop
        request would queue behind that call until the group's 30 s shutdown timeout."""
        if self.placement is not None:
            self.placement.shutdown(kill=True)
        self._start_workers()
        try:
            self._add_roles(self.cfg)
        except BaseException:
            self.placement.shutdown()
            self.placement = None
            raise

    def _add_roles(self, cfg: TrainConfig) -> None:
        roles, a, src, c = cfg.roles(), cfg.algorithm, str(self.source), cfg.cluster
        temperature = cfg.rollout.sampling.temperature  # the log-probs are of the sampling distribution by default
        rollout_ranks = c.pool(Role.ROLLOUT).world_size if c.rollout_apart and Role.ROLLOUT in roles else None
        self.policy = (self.placement.add_role(
            Role.POLICY.value, PolicyRole, checkpoint_dir=src, engine=cfg.policy, algorithm=a,
            temperature=temperature, rollout=cfg.rollout.engine if Role.ROLLOUT in roles else None,
            seed=cfg.trainer.seed, rollout_ranks=rollout_ranks) if Role.POLICY in roles else None)
        self.rollout = None  # rollout engines on a pool of their own, joined to the policy by a weight link
        self._held: int | None = None  # the version the rollout pool holds (None: none pushed, or not known)
        # calls to the rollout pool come from the trainer and the asynchronous producer's thread: each is submitted
        # to all its ranks before the next, so every rank runs them in one order (a vLLM TP group's ranks must)
        self._rollout_calls = threading.Lock()
        if rollout_ranks is not None:
            hf_config = read_meta(src).hf_config
            self.rollout = self.placement.add_role(
                Role.ROLLOUT.value, RolloutRole, hf_config=hf_config, train_layout=c.layout(),
                rollout=cfg.rollout.engine, seed=cfg.trainer.seed, record_routing=cfg.policy.router_replay,
                lora=cfg.policy.lora)
            self._join_weight_link()
            # every push's parity probe: one row per replica, at the policy's temperature
            self.probe = make_probe(self.rollout.group.layout.dp, spec_from_hf_config(hf_config).vocab_size,
                                    temperature, cfg.rollout.engine.max_model_len)
        self.reference = (self.placement.add_role(Role.REFERENCE.value, ReferenceRole, checkpoint_dir=src,
                                                  engine=cfg.policy, temperature=temperature)
                          if Role.REFERENCE in roles else None)
        self.critic = (self.placement.add_role(Role.CRITIC.value, CriticRole, checkpoint_dir=src, engine=cfg.critic,
                                               value_clip=a.value_clip)
                       if Role.CRITIC in roles else None)
        self.reward_model, self.cost_model = (
            self.placement.add_role(role.value, RewardModelRole, engine=section.engine,
                                    checkpoint_dir=str(self.classifier_sources[role.value])) if role in roles else None
            for role, section in ((Role.REWARD_MODEL, cfg.reward_model), (Role.COST_MODEL, cfg.cost_model)))
        self.teacher = (self.placement.add_role(Role.TEACHER.value, ReferenceRole,
                                                checkpoint_dir=str(self.teacher_source), engine=cfg.teacher.engine,
                                                temperature=temperature)
                        if Role.TEACHER in roles else None)

    def _join_weight_link(self) -> None:
        """Both pools join the process group of the weight sync (policy rank 0 hosts its rendezvous)."""
        t = self.cfg.cluster.timeouts  # init_s for the rendezvous, collective_s for the group's exchanges
        host, port = self.policy.one(0, PolicyRole.open_weight_link, t)
        size, _ = wait_all([self.policy.all_async(PolicyRole.join_weight_link, host, port, t),
                            self.rollout.all_async(RolloutRole.join_weight_link, host, port,
                                                   self.policy.group.world_size + self.rollout.group.world_size, t)])
        logger.info("weight link: %d training ranks -> %d rollout ranks (%s:%d)", self.policy.group.world_size,
                    self.rollout.group.world_size, host, port)

    # ------------------------------------------------------------------------------------- calls

    def sync_weights(self, version: int = 0) -> WeightSync:
        """Train -> rollout: the rollout engines hold the policy's current weights, which the rows they generate
        record as ``policy_version`` = ``version``. The ranks' transitions as one (:meth:`WeightSync.slowest`);
        with a rollout pool, the receiving side's (its seconds cover the whole transfer), with the push's parity
        probe (:meth:`_check_push`). A push stalled past ``cluster.timeouts.push_s`` (counted once the rollout
        ranks have run the calls ahead of it) fails as a lost worker."""
        if self.rollout is None:
            return WeightSync.slowest(self.policy.all(PolicyRole.sync_weights, version))
        # one submission to each rollout rank, in this order, before any other thread's call: the marker, the
        # receive, then the probe, which so meets exactly the weights pushed
        with self._rollout_calls:
            ready = self.rollout.all_async(RolloutRole.ready)
            calls = [self.policy.all_async(PolicyRole.push_weights),
                     self.rollout.all_async(RolloutRole.receive_weights, version)]
            probed = self.rollout.dp_async(RolloutRole.probe, self.probe.prompts, self.probe.params)
        ready.result()  # the generation ahead of the push (call_s); the policy's ranks wait in the link
        _, received = wait_all(calls, deadline_s=self.cfg.cluster.timeouts.push_s,
                               what=f"the weight push of version {version} to the rollout pool")
        sync = dataclasses.replace(WeightSync.slowest(received), parity=self._check_push(probed, version))
        self._held = version
        return sync

    def holds(self, version: int) -> bool:
        """Whether the rollout pool holds the policy's weights of ``version`` already (a push would resend them);
        colocated engines never do across calls: they sleep between rollouts."""
        return self.rollout is not None and self._held == version

    def _check_push(self, probed: PendingCall[Batch], version: int) -> PushParity:
        """The training model's log-probs of every replica's probe tokens, at the version just pushed (the policy
        is idle meanwhile: it holds exactly the weights it sent); raises over
        ``rollout.engine.max_logprob_abs_diff``."""
        start = time.perf_counter()
        rows = probed.result()
        fields = ("input_ids", "attention_mask", *(("routed_experts",) if "routed_experts" in rows.tensors else ()))
        training = self.policy.dp(PolicyRole.compute_log_probs, rows.select(*fields))["log_probs"]
        result = compare(rows, training, version, replicas=self.rollout.group.layout.dp)
        result = dataclasses.replace(result, seconds=time.perf_counter() - start)
        logger.debug("push of version %d: log-prob gap per rollout replica %s", version, result.per_replica)
        result.check(self.cfg.rollout.engine.max_logprob_abs_diff, self.cfg.rollout.engine.lora_sync)
        return result

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """``params.n`` rows per prompt, grouped by prompt, in prompt order (after :meth:`sync_weights`)."""
        return self.generate_async(prompts, params).result()

    def generate_async(self, prompts: Batch, params: SamplingParams) -> PendingCall[Batch]:
        """:meth:`generate`, started: with a rollout pool it runs while the policy's pool does other work."""
        if self.rollout is None:
            return self.policy.dp_async(PolicyRole.generate, prompts, params)
        with self._rollout_calls:
            return self.rollout.dp_async(RolloutRole.generate, prompts, params)

    def extend_async(self, prompts: Batch, params: SamplingParams) -> PendingCall[Batch]:
        """Partial generation on the rollout pool (:meth:`megarl.roles.split.RolloutRole.extend`), started."""
        with self._rollout_calls:
            return self.rollout.dp_async(RolloutRole.extend, prompts, params)

    def to_train(self) -> float:
        """Rollout -> train on every policy rank; the slowest rank's seconds (0 with a rollout pool: its engines
        stay awake on their own devices)."""
        return max(self.policy.all(PolicyRole.to_train)) if self.rollout is None else 0.0

    def old_log_probs(self, batch: Batch, temperature: float | None = None) -> Batch:
        """The policy's ``log_probs`` (at the sampling temperature unless ``temperature`` is given)."""
        return self.policy.dp(PolicyRole.compute_log_probs, batch, temperature)

    def reward_scores(self, batch: Batch) -> Batch:
        """``scores`` [B] of the reward model (``input_ids``, right-padded ``attention_mask``)."""
        return self.reward_scores_async(batch).result()

    def reward_scores_async(self, batch: Batch) -> PendingCall[Batch]:
        """:meth:`reward_scores`, started (it runs while the cost model, on a pool of its own, scores too)."""
        return self.reward_model.dp_async(RewardModelRole.compute_scores, batch)

    def cost_scores(self, batch: Batch) -> Batch:
        """``scores`` [B] of the cost model (as :meth:`reward_scores`)."""
        return self.cost_scores_async(batch).result()

    def cost_scores_async(self, batch: Batch) -> PendingCall[Batch]:
        return self.cost_model.dp_async(RewardModelRole.compute_scores, batch)

    @property
    def has_reference(self) -> bool:
        """Whether the run has a reference policy: a role of its own, or a LoRA policy's base model."""
        return self.reference is not None or (self.policy is not None and self.cfg.policy.lora is not None)

    def reference_log_probs(self, batch: Batch, temperature: float | None = None) -> Batch:
        """The reference's ``log_probs`` (at the sampling temperature unless ``temperature`` is given); with LoRA
        the policy's, adapters off."""
        if self.reference is None and self.has_reference:
            return self.policy.dp(PolicyRole.compute_log_probs, batch, temperature, False)
        return self.reference.dp(ReferenceRole.compute_log_probs, batch, temperature)

    def teacher_log_probs(self, batch: Batch) -> Batch:
        """The distillation teacher's ``log_probs`` of the sampled tokens (same temperature as the policy's)."""
        return self.teacher.dp(ReferenceRole.compute_log_probs, batch)

    def critic_scores(self, batch: Batch) -> Batch:
        """The trained scalar-head model's ``scores`` at each row's last real token (a reward model in training)."""
        return self.critic.dp(CriticRole.compute_scores, batch)

    def values(self, batch: Batch) -> Batch:
        return self.critic.dp(CriticRole.compute_values, batch)

    def update_policy(self, batch: Batch) -> StepResult:
        return self.policy.dp_split(PolicyRole.update, batch)[0]  # metrics are reduced over DP already

    def update_critic(self, batch: Batch) -> StepResult:
        return self.critic.dp_split(CriticRole.update, batch)[0]

    def train_policy(self, batch: Batch, objective: algos.LMObjective) -> StepResult:
        """One optimizer step of an offline objective (SFT, DPO) on the policy; whole groups (pairs) per shard."""
        return self.policy.dp_split(PolicyRole.train, batch, objective)[0]

    def train_critic(self, batch: Batch, objective: algos.ScalarObjective) -> StepResult:
        """One optimizer step of an offline objective on the scalar-head model (reward-model training)."""
        return self.critic.dp_split(CriticRole.train, batch, objective)[0]

    def memory_peaks(self) -> dict[str, float]:
        """Peak memory of the busiest worker process since the previous call."""
        if self.policy is None:  # a reward model trained alone: its own processes
            per_rank = self.critic.all(CriticRole.memory_peaks)
        else:
            per_rank = self.policy.all(PolicyRole.memory_peaks)
        return {k: max(r[k] for r in per_rank) for k in per_rank[0]}

    def save(self, ckpt_dir: Path, step: int) -> None:
        if self.policy is not None:
            self.policy.all(PolicyRole.save_checkpoint, str(ckpt_dir / "policy"), step, str(self.source))
        if self.critic is not None:
            self.critic.all(CriticRole.save_checkpoint, str(ckpt_dir / "critic"), step, str(self.source))

    def load(self, ckpt_dir: Path) -> None:
        self._held = None  # the policy's weights change: whatever the rollout pool holds is not known to match
        if self.policy is not None:
            self.policy.all(PolicyRole.load_checkpoint, str(ckpt_dir / "policy"))
        if self.critic is not None:
            self.critic.all(CriticRole.load_checkpoint, str(ckpt_dir / "critic"))

    def shutdown(self) -> None:
        """Kill the workers and the run's private Ray cluster (its raylet, GCS and agents), so that no process
        of the run outlives it. At a clean exit (no exception on its way out, or a stop signal's
        :class:`RunStopped`) the private cluster's session directory goes too; a failed run keeps it (Ray's logs)."""
        failure = sys.exc_info()[1]  # called from a `finally`: the exception the run is failing with, if any
        if self.placement is not None:
            self.placement.shutdown()
        if self.owns_ray:
            import ray

            ray.shutdown(wait_for_processes=self.ray_session is not None)  # no process left writing into it
            if self.ray_session is not None and (failure is None or isinstance(failure, RunStopped)):
                _remove_session(self.ray_session)


def _start_ray(address: str | None) -> tuple[bool, Path | None]:
    """Join the Ray cluster at ``address``, or start one private to this run: never an unrelated cluster
    that happens to run on the machine (``ray.init()`` without an address would join the newest one).
    Whether this call connected (False: the caller had connected already, e.g. tests, notebooks), and the
    session directory of the cluster it started (None when it joined one)."""
    import ray

    if ray.is_initialized():
        return False, None
    if address and address != "local":
        _check_reachable(address)
        logger.info("joining the Ray cluster at %s", address)
    else:
        address = "local"
        logger.info("starting a private Ray cluster for this run (cluster.ray_address or RAY_ADDRESS joins one)")
        _quiet_ray_start()
    # a private cluster starts no idle workers for the driver (one per CPU otherwise): megarl's actors carry a
    # runtime env (their thread counts), so Ray never hands them one
    system = {"prestart_worker_first_driver": False} if address == "local" else None
    start = time.monotonic()
    try:
        context = ray.init(address=address, log_to_driver=True, include_dashboard=False, _system_config=system)
    except (ConnectionError, TimeoutError, RuntimeError, ValueError) as e:
        what = f"join the Ray cluster at {address}" if address != "local" else "start a private Ray cluster"
        raise ClusterError(f"could not {what}: {type(e).__name__}: {e}. Check that the address is right and the "
                           "cluster is up (`ray status --address ...`), or that the machine has free memory, ports "
                           "and /tmp space for a local one; unset cluster.ray_address and RAY_ADDRESS to start a "
                           "private cluster.") from e
    if address != "local":
        return True, None
    session = Path(context.address_info["session_dir"])
    logger.info("private Ray cluster up in %.0f s; its logs: %s (removed at a clean exit)", time.monotonic() - start,
                session / "logs")
    return True, session


# Ray's start-up notices on the driver: a new private cluster turns token authentication on and says so, and says
# it started, on every run; the line above replaces both. Filters of these two loggers only: warnings of
# auth failures, a disabled authentication or anything else Ray logs still show.
_RAY_NOTICES = {"ray._private.authentication.authentication_token_setup": "Token authentication is enabled for this",
                "ray._private.worker": "Started a local Ray instance"}


class _DropNotice(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def _quiet_ray_start() -> None:
    for name, prefix in _RAY_NOTICES.items():
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropNotice) for f in log.filters):
            log.addFilter(_DropNotice(prefix))


def _remove_session(session: Path) -> None:
    """Remove a private cluster's session directory (Ray leaves one per ``ray.init`` under its temp dir,
    ``/tmp/ray``), and the ``session_latest`` link there if it points to it, once the cluster's processes exited."""
    latest = session.parent / "session_latest"
    if latest.is_symlink() and os.path.realpath(latest) == os.path.realpath(session):
        latest.unlink(missing_ok=True)
    for _ in range(3):  # a worker process still exiting may create a file meanwhile
        shutil.rmtree(session, ignore_errors=True)
        if not session.exists():
            return
        time.sleep(0.5)
    logger.warning("could not remove the Ray session directory %s", session)


def _check_reachable(address: str) -> None:
    """Fail in seconds when nothing listens at a ``host:port`` address: ``ray.init`` would retry for minutes."""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return  # "auto", ray:// client addresses: Ray's own checks
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as e:
        raise ClusterError(f"no Ray cluster answers at {address} ({e}); from cluster.ray_address or RAY_ADDRESS. "
                           "Start it first (`ray start --head`), fix the address, or unset both to start a private "
                           "Ray cluster for the run.") from e


class Conversions:
    """The one-time HF -> Megatron conversions of a run (named ``(source, target)`` pairs): a source that is a megarl
    checkpoint is used as is, a complete target is reused (resume), the rest are converted at the main pool's
    layout. With Ray they run in one child process (the driver never joins a torch.distributed world), started
    here so that Ray and the workers start meanwhile, with the driver's environment and CUDA hidden: it converts
    in host memory (:mod:`megarl.checkpoint.cpu_only`). The child is forked from ``multiprocessing``'s fork server,
    which has imported the converter: a driver that runs several trainers (a test session, a sweep) imports
    megatron-core for its conversions once. With the local launcher, in this process (it joins a world of one
    anyway), before this returns."""

    def __init__(self, cluster: ClusterConfig, pairs: dict[str, tuple[Path, Path]]) -> None:
        pool = cluster.pool()
        self.paths: dict[str, Path] = {}
        jobs = []
        for name, (src, target) in pairs.items():
            self.paths[name] = src if is_checkpoint(src) else target
            if self.paths[name] == target and not is_checkpoint(target):
                logger.info("converting %s to a Megatron checkpoint (tp=%d, pp=%d) in %s", src, pool.tp, pool.pp,
                            target)
                jobs.append((str(src), str(target), pool.tp, pool.pp))
        self._executor = self._future = None
        if not jobs:
            return
        if cluster.launcher is Launcher.LOCAL:
            _convert(jobs)
            return
        forkserver.preload("megarl.checkpoint.convert")
        self._executor = concurrent.futures.ProcessPoolExecutor(1, mp_context=forkserver.context(),
                                                                initializer=_child_env, initargs=(dict(os.environ),))
        self._future = self._executor.submit(_convert, jobs)

    def result(self) -> dict[str, Path]:
        """The Megatron checkpoint of every pair, by name, once converted (a conversion's error is raised here)."""
        if self._future is not None:
            try:
                self._future.result()
            finally:
                self.close()
        return self.paths

    def close(self) -> None:
        """Wait for the child process to exit (a conversion in progress finishes first)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None


def _child_env(driver_env: dict[str, str]) -> None:
    """The conversion child's environment, set before it converts: the driver's (a fork server's child starts
    with the server's), with CUDA hidden."""
    os.environ.clear()
    os.environ.update(driver_env)
    cpu_only.hide_cuda()


def _convert(jobs: list[tuple[str, str, int, int]]) -> None:
    from megarl.checkpoint.convert import convert_hf_to_megatron

    for src, dst, tp, pp in jobs:
        convert_hf_to_megatron(src, dst, tp=tp, pp=pp)
