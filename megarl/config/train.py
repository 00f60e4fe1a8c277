"""A training run's configuration: one tree of typed dataclasses, read from YAML with ``key.path=value`` overrides.

The tree nests the components' own configs rather than copying their fields: ``rollout.sampling`` is
the rollout engine's :class:`~megarl.rollout.base.SamplingConfig`, ``rollout.engine`` its
:class:`~megarl.rollout.config.RolloutConfig`, ``policy`` / ``critic`` the training engine's
:class:`~megarl.engine.config.EngineConfig` (the frozen roles' ``engine`` the same less ``optim``),
``algorithm`` the algorithms' own :class:`~megarl.algos.config.AlgorithmConfig`, ``cluster.pools`` the
controller's :class:`~megarl.controller.spec.PoolSpec`. So every default is defined once, in its field (a test walks
the tree and fails on a repeated one), and every choice is an enum.

``null`` means "decided by megarl" where a field says so; :func:`megarl.config.resolve.resolve` makes
those decisions before any worker starts and the run writes the result to ``<output_dir>/config.yaml``.
:func:`check_config` validates everything checkable without starting a worker and raises
:class:`ConfigError` naming what to change; it never rewrites. ``docs/config.md`` is generated from this
module (``python -m megarl.config.reference``). Pure module: no Ray, no process groups, no megatron-core.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import yaml

from megarl.algos.config import AlgorithmConfig
from megarl.algos.offline import BradleyTerryObjective, DPOObjective, KTOObjective, SFTObjective
from megarl.config.loader import from_dict, read_data
from megarl.controller.spec import Launcher, PoolSpec, Timeouts
from megarl.data.examples import ExampleKind, Truncation
from megarl.data.prompts import PromptConfig
from megarl.engine.config import EngineConfig, OptimConfig
from megarl.errors import ConfigError
from megarl.host import allocator
from megarl.multiturn.config import MultiTurnConfig
from megarl.parallel.layout import ParallelLayout
from megarl.rewards.base import OnError
from megarl.rollout.base import SamplingConfig
from megarl.rollout.config import RolloutConfig


class Role(enum.Enum):
    """The roles a run places on its pools (``cluster.placement`` keys)."""

    POLICY = "policy"  # trains; hosts the rollout engines unless they have a pool of their own
    ROLLOUT = "rollout"  # the rollout engines: inside the policy's processes, or on a pool of their own (split)
    REFERENCE = "reference"
    CRITIC = "critic"
    REWARD_MODEL = "reward_model"
    COST_MODEL = "cost_model"  # a second classifier, scored beside the reward model (Safe-RLHF's cost)
    TEACHER = "teacher"  # on-policy distillation


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    path: str = ""  # HF model directory or megarl (Megatron) checkpoint directory
    tokenizer: str | None = None  # null: the model directory's (its hf/ subdir for a megarl checkpoint)


@dataclasses.dataclass(frozen=True)
class DataConfig(PromptConfig):
    """Prompt files and how a step draws from them; how rows become prompts is :class:`PromptConfig`'s."""

    train: str = ""  # .jsonl or .parquet with a prompt column
    val: str | None = None  # prompts of the validation (evaluation) set
    row_adapter: str | None = None  # "path/to/file.py:function" mapping each raw row to {prompt, ...}
    batch_size: int = 8  # prompts per step
    shuffle: bool = True  # a fresh permutation of the training prompts every epoch


class Schedule(enum.Enum):
    """How generation and training take turns (:mod:`megarl.trainer.experience`)."""

    SYNC = "sync"  # generate, then train on it: every sample from the weights being trained (version lag 0)
    ONE_STEP_OFF = "one_step_off"  # step k+1's generation runs while step k trains (lag 1; needs a rollout pool)
    ASYNC = "async"  # the rollout pool generates into a buffer all along (lag <= rollout.asynchronous.max_staleness)


class OnStale(enum.Enum):
    WAIT = "wait"  # generation waits, so that no sample gets more than max_staleness versions old
    DROP = "drop"  # generation runs on; prompt groups staler than max_staleness are dropped (async/dropped_groups)


@dataclasses.dataclass(frozen=True)
class AsyncConfig:
    """``rollout.schedule: async`` (:mod:`megarl.trainer.asynchronous`): the rollout pool generates into a buffer
    of finished prompt groups while the trainer takes ``data.batch_size`` of them per step."""

    max_staleness: int = 1  # eta: a sample's oldest token is at most this many versions behind the trained weights
    on_stale: OnStale = OnStale.WAIT  # wait | drop
    push_every: int = 1  # K: weights pushed to the rollout pool every K updates (wait: K <= max_staleness + 1)
    buffer_batches: int = 2  # finished prompt groups held (and generated ahead), in batches of data.batch_size
    partial_chunk_tokens: int | None = None  # partial rollouts: tokens per generation call; a weight push lands
    # between calls and in-flight responses continue under the new weights (each token keeps its version);
    # null: whole responses per call (a push waits for them)


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    sampling: SamplingConfig = SamplingConfig(n=4)  # training responses
    validation: SamplingConfig = SamplingConfig(temperature=0.0)  # evaluation: greedy, one response per prompt
    max_new_tokens: int = 64  # response length limit (training and validation)
    stop_at_eos: bool = True  # the tokenizer's eos token ends a response
    stop_token_ids: tuple[int, ...] = ()  # more ids that end a response (e.g. Llama-3's <|eot_id|>)
    engine: RolloutConfig = RolloutConfig()
    schedule: Schedule = Schedule.SYNC  # sync | one_step_off | async (both overlap generation and training;
    # they need cluster.placement.rollout on a pool of its own, and train on older samples with the old
    # log-probs recomputed and algorithm.rollout_correction weighting them)
    asynchronous: AsyncConfig = AsyncConfig()  # rollout.schedule=async only
    multi_turn: MultiTurnConfig = MultiTurnConfig()  # conversations with an environment or tools (docs/multiturn.md)
    # a rollout function, "path/to/file.py:function": a generation loop of your own over the rollout engines in place
    # of one call per prompt (docs/programming.md §2)
    function: str | None = None

    @property
    def max_version_lag(self) -> int:
        """How many updates behind the trained weights a sample may be (the schedule guarantees it)."""
        return {Schedule.SYNC: 0, Schedule.ONE_STEP_OFF: 1, Schedule.ASYNC: self.asynchronous.max_staleness}[
            self.schedule]


@dataclasses.dataclass(frozen=True)
class RewardFunctionConfig:
    """One reward function: what scores a response, its weight, its options, what its failures do. A function
    given by path is called as its signature says (``megarl.rewards.conventions``): ``(prompt, response, row)``,
    the row's other columns as one mapping; keyword style ``(prompt, response, **columns)``, each column a
    keyword (``completion`` also names the response; a parameter without a default is a column the rows must
    have); or TRL's batch style ``(prompts, completions, **columns) -> list[float]``, called once per batch
    with each column a list. One whose scores are all equal over its first 3 scored batches gets a warning."""

    function: str | None = "integer_answer"  # a built-in key or "path/to/file.py:function" (any convention); null: none
    function_weight: float = 1.0  # its score's weight in the reward
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # keyword options of a built-in
    on_error: OnError = OnError.RAISE  # failures of the function (not of the reward model)
    error_score: float = 0.0  # the score of a row the function failed on (on_error: score)


# names a reward function cannot take: the other sources' (batch fields <source>_scores, reward/<source>_mean)
RESERVED_REWARD_NAMES = ("function", "model", "cost", "overlong", "environment", "baseline")


@dataclasses.dataclass(frozen=True)
class RewardConfig(RewardFunctionConfig):
    """A response's reward: ``function_weight * function score + reward_model.weight * model score``
    over the sources that are set (at least one). Several reward functions (TRL's ``reward_funcs`` with
    ``reward_weights``): ``function: null`` and one ``functions.NAME`` entry each (``function``,
    ``function_weight``, ``options``, ``on_error``, ``error_score``), their weighted scores summed; each is
    logged as ``reward/NAME_mean`` and ``reward/NAME_std``. A function given by path is called as its
    signature says: ``(prompt, response, row)``, keyword style ``(prompt, response, **columns)`` or TRL's
    batch style ``(prompts, completions, **columns) -> list[float]`` (see ``reward.functions.<name>``)."""

    functions: dict[str, RewardFunctionConfig] = dataclasses.field(default_factory=dict)  # NAME -> function
    # NAME -> a reward stage, "path/to/file.py:function" or a registered name, run in this order after the other
    # sources: fn(inputs: RewardStageInputs) -> [rows] scores added to the reward, logged as reward/NAME_mean
    # (docs/programming.md §2)
    stages: dict[str, str] = dataclasses.field(default_factory=dict)

    def named_functions(self) -> dict[str, RewardFunctionConfig]:
        """Every reward function by its metric name: ``function`` for the single one, else ``functions``."""
        return {"function": self} if self.function is not None else dict(self.functions)
    # DAPO soft overlong penalty, added to the reward: 0 up to max_new_tokens - overlong_buffer tokens, then a
    # linear ramp to -overlong_penalty_factor at max_new_tokens (megarl.algos.dapo); multi-turn: a conversation's
    # tokens after the prompt against rollout.multi_turn.max_total_tokens (docs/multiturn.md)
    overlong_buffer: int = 0  # tokens of the ramp; 0 = off
    overlong_penalty_factor: float = 1.0  # the penalty at max_new_tokens


@dataclasses.dataclass(frozen=True)
class FrozenEngineConfig(EngineConfig):
    """The engine of a frozen role (reward model, teacher): forward passes only. Its keys are the training
    engine's (``policy``) less ``optim``: nothing trains a frozen role, so a config setting ``optim`` is told
    that it does nothing."""

    REFUSED_KEYS: ClassVar[dict[str, str]] = {
        "optim": "frozen roles are not trained: optim settings do nothing; remove them",
        "lora": "frozen roles are not trained: adapters would stay zero; remove lora (a LoRA policy's reference is "
                "its base model already)"}

    # no config key (init=False): kept at its default so that the role's MegatronEngine takes this as the
    # EngineConfig it is; a frozen engine (trainable=False) builds no optimizer and never reads it
    optim: OptimConfig = dataclasses.field(default=OptimConfig(), init=False, repr=False)
    lora: None = dataclasses.field(default=None, init=False, repr=False)


@dataclasses.dataclass(frozen=True)
class RewardModelSection:
    """A reward model worker (HF ``*ForSequenceClassification``, one label, or its megarl checkpoint)
    scoring each sequence at its last token. It runs frozen on the policy's pool and layout and reads
    the policy's token ids as they are: its tokenizer must be the policy's (no re-tokenization)."""

    model: ModelConfig = ModelConfig()  # HF directory (converted once to <output_dir>/reward_model_checkpoint)
    weight: float = 1.0  # its score's weight in the reward
    engine: FrozenEngineConfig = FrozenEngineConfig()  # forward only: forward_micro_batch and precision matter


@dataclasses.dataclass(frozen=True)
class CostModelSection(RewardModelSection):
    """A cost model (Safe-RLHF): a second sequence classifier like the reward model (its tokenizer the policy's,
    converted once to ``<output_dir>/cost_model_checkpoint``), scored in the same stage and at the same time when
    the two are on pools of their own. Its scores are each row's ``cost_scores`` (``reward/cost_mean``) for a
    program's constraint (docs/programming.md §3: a Lagrange multiplier in ``run.state``); ``weight`` adds them to
    the reward as a fixed penalty instead (negative: a cost lowers the reward)."""

    model: ModelConfig = ModelConfig()  # HF directory (converted once to <output_dir>/cost_model_checkpoint)
    weight: float = 0.0  # its score's weight in the reward (0: kept apart, for a program's constraint)


@dataclasses.dataclass(frozen=True)
class TeacherSection:
    """On-policy distillation: a frozen teacher (any causal LM that reads the policy's token ids; converted
    once to ``<output_dir>/teacher_checkpoint``, placed on the policy's pool) scores every sampled token; the
    token's reward gains ``kl_coef * (log pi_teacher - log pi_policy)``, the negative per-token reverse KL,
    alone (reward.function_weight: 0) or beside the outcome reward, under any advantage estimator."""

    model: ModelConfig = ModelConfig()  # HF directory or megarl checkpoint (a run's checkpoints/step_N/policy too)
    kl_coef: float = 1.0  # weight of the per-token reward -(log pi_policy - log pi_teacher)
    engine: FrozenEngineConfig = FrozenEngineConfig()  # forward only: forward_micro_batch and precision matter


class CorruptCheckpoint(enum.Enum):
    """What a resume does when the newest checkpoint fails verification (its files' checksums)."""

    FALLBACK = "fallback"  # move it aside (step_N.corrupt) and resume from the newest intact one
    FAIL = "fail"  # stop with the file and the reason


@dataclasses.dataclass(frozen=True)
class TrainerSection:
    """The run: its length, outputs, checkpoints and what it does on faults. One run holds its
    ``output_dir`` (a lock); SIGTERM/SIGINT stop it after the current step (exit status 75)."""

    total_steps: int = 10  # training steps (one batch of prompts each)
    output_dir: str = "outputs/run"  # checkpoints, metrics.jsonl, TensorBoard events, config.yaml
    save_every: int = 0  # steps between checkpoints; 0 = only at the end
    keep_checkpoints: int = 2  # the newest step checkpoints kept on disk
    val_every: int = 0  # steps between validations (sampling data.val with rollout.validation); 0 = none
    resume: bool = True  # continue from the newest intact checkpoint in output_dir
    on_corrupt_checkpoint: CorruptCheckpoint = CorruptCheckpoint.FALLBACK  # a checkpoint failing its checksums
    save_on_signal: bool = True  # on SIGTERM/SIGINT, checkpoint the last finished step before stopping
    max_restarts: int = 2  # lost workers (a dead or hung process or node) replaced, resuming from a checkpoint
    restart_window_s: float = 3600.0  # ... at most max_restarts times within this many seconds
    seed: int = 1  # sampling, data order and worker seeds
    tensorboard: bool = True  # write TensorBoard event files to output_dir
    wandb_project: str | None = None  # log to Weights & Biases when set (needs `wandb`)
    program: str = "rl"  # the step: a built-in (PROGRAMS) or path/to/file.py:function (docs/programming.md §3)


@dataclasses.dataclass(frozen=True)
class BuiltinProgram:
    """A built-in step program: ``module:function``; for an offline program the examples it reads from ``data.train``
    (docs/offline.md §2 lists the columns of each kind; None: prompts the policy answers); the roles it needs beyond
    RL's, or (offline) all its roles, the trained one first. RL's roles follow from the algorithm
    (:meth:`TrainConfig.roles`)."""

    target: str
    examples: ExampleKind | None = None
    roles: tuple[Role, ...] = ()

    @property
    def offline(self) -> bool:
        """Trains on a dataset's own tokens: no rollout engine, no reward."""
        return self.examples is not None


# the built-in step programs by name
PROGRAMS = {
    "rl": BuiltinProgram("megarl.recipes.rl:step"),
    "sft": BuiltinProgram("megarl.recipes.offline:sft", ExampleKind.SFT, (Role.POLICY,)),
    "dpo": BuiltinProgram("megarl.recipes.offline:dpo", ExampleKind.PREFERENCE, (Role.POLICY, Role.REFERENCE)),
    "kto": BuiltinProgram("megarl.recipes.offline:kto", ExampleKind.UNPAIRED, (Role.POLICY, Role.REFERENCE)),
    "reward_model": BuiltinProgram("megarl.recipes.offline:reward_model", ExampleKind.PREFERENCE, (Role.CRITIC,)),
    "online_dpo": BuiltinProgram("megarl.recipes.online_dpo:step", None, (Role.REFERENCE,)),
}
PROGRAM_SIGNATURE = "step(run: megarl.program.Run) -> dict[str, float]"


def _one_pool() -> dict[str, PoolSpec]:
    return {"main": PoolSpec()}


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """Where the roles run. ``pools`` are named sets of devices, each with the megatron-core layout of the
    processes on it; ``placement`` maps roles to pools. The policy (and the rollout engine inside it) runs on
    its entry's pool, or the first pool; every other role on its entry's pool, or the policy's. Roles on one
    pool share its processes (colocation, the default: one pool); a role on a pool of its own runs in
    processes of its own, beside the policy's (split placement). The rollout engines (``placement.rollout``)
    live in the policy's processes unless they have a pool of their own: then that pool's layout is
    ``tp = rollout.engine.tp``, ``pp = cp = 1``, one rollout replica per data-parallel rank, and weights travel to
    it over a process group joining both pools after each update (:mod:`megarl.roles.split`).

    ``launcher: local`` hosts the one rank in the driver process itself (one device; no Ray, no worker
    processes: the lightest way to run a small model on one GPU or on a machine's CPU cores)."""

    launcher: Launcher = Launcher.RAY  # ray: Ray worker processes; local: one rank in the driver process
    ray_address: str | None = None  # join this Ray cluster (or $RAY_ADDRESS); null: start one private to the run
    allocator: allocator.Allocator = allocator.DEFAULT  # host malloc of megarl's processes
    timeouts: Timeouts = Timeouts()
    worker_env: dict[str, str] = dataclasses.field(default_factory=dict)  # extra environment of the workers
    pools: dict[str, PoolSpec] = dataclasses.field(default_factory=_one_pool)
    placement: dict[str, str] = dataclasses.field(default_factory=dict)  # role -> pool; missing: the policy's

    def pool_name(self, role: Role = Role.POLICY) -> str:
        """The pool hosting ``role`` (see the class docstring)."""
        policy = self.placement.get(Role.POLICY.value) or next(iter(self.pools))
        return self.placement.get(role.value) or policy

    def role_pools(self, roles: Sequence[Role]) -> dict[str, str]:
        """The placement of ``roles``, every one named: role -> pool."""
        return {r.value: self.pool_name(r) for r in roles}

    def pool(self, role: Role = Role.POLICY) -> PoolSpec:
        """The pool hosting ``role``; by default the policy's (which hosts the rollout engine)."""
        return self.pools[self.pool_name(role)]

    def layout(self, role: Role = Role.POLICY) -> ParallelLayout:
        return self.pool(role).layout()

    @property
    def rollout_apart(self) -> bool:
        """Whether the rollout engines run on a pool of their own (split placement)."""
        return self.pool_name(Role.ROLLOUT) != self.pool_name(Role.POLICY)


@dataclasses.dataclass(frozen=True)
class OfflineSection:
    """The offline programs' settings (``trainer.program``: ``sft``, ``dpo``, ``kto``, ``reward_model``;
    docs/offline.md): how examples are cut and each objective's hyper-parameters (:mod:`megarl.algos.offline`); ``dpo``
    also serves ``online_dpo``. A step is one optimizer step on ``data.batch_size`` examples (pairs for ``dpo`` and
    ``reward_model``)."""

    max_length: int | None = 1024  # tokens of prompt + completion per row, as TRL counts them (null: no limit)
    truncation: Truncation = Truncation.KEEP_START  # what a longer row keeps (keep_end: sft and dpo only)
    completion_only_loss: bool | None = None  # sft: the loss on completion tokens only (null: for prompt/completion)
    assistant_only_loss: bool = False  # sft on messages: the loss on the assistant's tokens ({% generation %})
    # dpo / kto: the reference's log-probs of every training example computed once, on first use, instead of each step
    precompute_ref_log_probs: bool = False
    sft: SFTObjective = SFTObjective()
    dpo: DPOObjective = DPOObjective()
    kto: KTOObjective = KTOObjective()
    reward_model: BradleyTerryObjective = BradleyTerryObjective()

    def __post_init__(self) -> None:
        if self.max_length is not None and self.max_length < 2:
            raise ConfigError(f"offline.max_length must be >= 2 tokens or null, found {self.max_length}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutSection = RolloutSection()
    cluster: ClusterConfig = ClusterConfig()
    policy: EngineConfig = EngineConfig()
    critic: EngineConfig = EngineConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    reward: RewardConfig = RewardConfig()
    reward_model: RewardModelSection | None = None  # e.g. reward_model.model.path=... adds one
    cost_model: CostModelSection | None = None  # e.g. cost_model.model.path=... adds one (Safe-RLHF's cost)
    teacher: TeacherSection | None = None  # on-policy distillation: teacher.model.path=... adds one
    offline: OfflineSection = OfflineSection()
    trainer: TrainerSection = TrainerSection()

    @property
    def builtin_program(self) -> BuiltinProgram | None:
        """``trainer.program``'s built-in, None for a program by path (which reads prompts)."""
        return PROGRAMS.get(self.trainer.program)

    @property
    def example_kind(self) -> ExampleKind | None:
        """The examples an offline program reads; None: prompts (RL, online DPO, a program by path)."""
        program = self.builtin_program
        return None if program is None else program.examples

    def roles(self) -> list[Role]:
        """The roles this run needs, the trained one first. A LoRA policy is its own reference (its base model,
        adapters off): no reference role, unless ``cluster.placement.reference`` puts a frozen copy of the base on
        a pool to compute it there."""
        roles = self._roles()
        if self.policy.lora is None or Role.REFERENCE.value in self.cluster.placement:
            return roles
        return [r for r in roles if r is not Role.REFERENCE]

    def _roles(self) -> list[Role]:
        program = self.builtin_program
        if program is not None and program.offline:
            return list(program.roles)
        a = self.algorithm
        classifiers = ((Role.REWARD_MODEL, self.reward_model is not None),
                       (Role.COST_MODEL, self.cost_model is not None))
        if program is not None and program.roles:  # a program of its own roles over the rollout (online DPO)
            return [Role.POLICY, Role.ROLLOUT, *program.roles] + [r for r, on in classifiers if on]
        optional = ((Role.REFERENCE, a.needs_reference), (Role.CRITIC, a.needs_critic), *classifiers,
                    (Role.TEACHER, self.teacher is not None))
        return [Role.POLICY, Role.ROLLOUT] + [r for r, on in optional if on]


# ------------------------------------------------------------------------------------------ loading


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainConfig:
    """YAML file (or nothing) + ``a.b.c=value`` overrides (values parsed as YAML scalars)."""
    return from_dict(TrainConfig, read_data(path, overrides))


def to_plain(cfg: Any) -> Any:
    """The config as plain YAML-able data (enums by value; fields that are no config keys, ``init=False``, left out)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.init}
    if isinstance(cfg, enum.Enum):
        return cfg.value
    if isinstance(cfg, dict):
        return {k: to_plain(v) for k, v in cfg.items()}
    if isinstance(cfg, list | tuple):
        return [to_plain(v) for v in cfg]
    return cfg


def dump_config(cfg: TrainConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(to_plain(cfg), sort_keys=False))
