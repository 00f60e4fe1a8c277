"""The training run's configuration: typed dataclasses, loaded from YAML with ``key.path=value`` overrides.

One dataclass per concern, at most three levels deep (``policy.optim.lr``); defaults live in the
fields; unknown keys are errors naming the nearest valid key (:mod:`megarl.config.loader`).
:func:`check_config` validates what can be checked without starting a worker (paths, layouts,
batch divisibility, algorithm/role consistency) and raises :class:`ConfigError`; it never rewrites.
Pure module: no Ray, no process groups.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from pathlib import Path
from typing import Any

import yaml

from megarl.algos.advantages import AdvantageConfig, AdvantageEstimator
from megarl.algos.kl import KLControllerConfig, KLEstimator
from megarl.algos.losses import PolicyLossConfig
from megarl.config.loader import from_dict
from megarl.controller import allocator
from megarl.engine.config import EngineConfig, MicroBatchConfig, Precision
from megarl.errors import ConfigError
from megarl.parallel.layout import ParallelLayout
from megarl.resharding.plan import check_vllm_groups
from megarl.rewards.base import OnError
from megarl.rollout.config import RolloutBackend


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    path: str = ""  # HF model directory or megarl (Megatron) checkpoint directory
    tokenizer: str | None = None  # default: the model directory (its hf/ subdir for a megarl checkpoint)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    train: str = ""  # .jsonl or .parquet with a prompt column
    val: str | None = None
    prompt_key: str = "prompt"
    row_adapter: str | None = None  # "path/to/file.py:function" mapping each raw row to {prompt, ...}
    max_prompt_length: int = 512  # tokens; longer prompts are dropped (and counted)
    apply_chat_template: bool = True
    batch_size: int = 8  # prompts per step
    shuffle: bool = True


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    n: int = 4  # responses per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_at_eos: bool = True  # the tokenizer's eos token ends a response
    stop_token_ids: tuple[int, ...] = ()  # more ids that end a response (e.g. Llama-3's <|eot_id|>)
    val_n: int = 1
    val_temperature: float = 0.0
    backend: RolloutBackend = RolloutBackend.EMBEDDED
    tp: int = 1
    dtype: str = "float32"
    bucket_mb: float = 64.0
    max_batch_size: int = 64
    max_logprob_abs_diff: float | None = None  # raise when rollout and training log-probs differ more
    offload_train_state: bool | None = None  # None: offload grads/optimizer/params around rollout on GPU only
    gpu_memory_utilization: float = 0.5  # vLLM: share of the GPU for weights + KV cache
    kv_cache_mb: float | None = None  # vLLM: KV cache size (None: from gpu_memory_utilization on GPU, 1 GiB on CPU)
    max_model_len: int | None = None  # vLLM: prompt + response tokens (None: the model config's)
    enforce_eager: bool = False  # vLLM: no CUDA graphs


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    advantage: AdvantageConfig = AdvantageConfig(estimator=AdvantageEstimator.GRPO)
    policy_loss: PolicyLossConfig = PolicyLossConfig()
    entropy_coef: float = 0.0
    kl_penalty: KLControllerConfig | None = None  # KL to the reference subtracted from the reward
    kl_loss_coef: float = 0.0  # KL to the reference as a loss term (GRPO style); 0 = off
    kl_estimator: KLEstimator = KLEstimator.K3
    value_clip: float | None = 0.2  # critic (GAE only)
    ppo_epochs: int = 1
    mini_batches: int = 1  # optimizer steps per epoch
    # A training-model forward after each rollout for the PPO ratio's old log-probs (and the rollout
    # check). None = auto: only where something needs them; with one optimizer step per batch
    # (ppo_epochs = mini_batches = 1) and no kl_penalty, the update's own forward is at the same
    # weights and stands in (ratio 1, as TRL and verl do), measuring rollout/logprob_abs_diff and
    # applying rollout.max_logprob_abs_diff there. true: always; false where they are needed: ConfigError.
    recompute_old_log_probs: bool | None = None

    @property
    def needs_reference(self) -> bool:
        return self.kl_penalty is not None or self.kl_loss_coef > 0

    def old_log_probs_needed_because(self) -> str | None:
        """Why old log-probs must come from a forward of their own; None when the update's can stand in."""
        if self.ppo_epochs != 1 or self.mini_batches != 1:
            return (f"ppo_epochs={self.ppo_epochs} x mini_batches={self.mini_batches} optimizer steps per batch: "
                    "after the first, the policy is no longer the one that sampled")
        if self.kl_penalty is not None:
            return "kl_penalty subtracts KL(old policy || reference) from the rewards before the update"
        return None

    @property
    def recomputes_old_log_probs(self) -> bool:
        """``recompute_old_log_probs`` with auto (None) resolved."""
        if self.recompute_old_log_probs is None:
            return self.old_log_probs_needed_because() is not None
        return self.recompute_old_log_probs

    @property
    def needs_critic(self) -> bool:
        return self.advantage.estimator is AdvantageEstimator.GAE

    @property
    def needs_greedy_baseline(self) -> bool:
        """ReMax: each step also samples one greedy response per prompt; its reward is the baseline."""
        return self.advantage.estimator is AdvantageEstimator.REMAX


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """A response's reward: ``function_weight * function score + reward_model.weight * model score``
    over the sources that are set (at least one)."""

    function: str | None = "integer_answer"  # a built-in key or "path/to/file.py:function"; null: none
    function_weight: float = 1.0
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # keyword options of a built-in
    on_error: OnError = OnError.RAISE  # failures of the function (not of the reward model)
    error_score: float = 0.0


@dataclasses.dataclass(frozen=True)
class RewardModelSection:
    """A reward model worker (HF ``*ForSequenceClassification``, one label, or its megarl checkpoint)
    scoring each sequence at its last token. It runs on the policy's pool and layout, frozen, and reads
    the policy's token ids as they are: its tokenizer must be the policy's (no re-tokenization)."""

    path: str = ""  # HF directory (converted once to <output_dir>/reward_model_checkpoint) or megarl checkpoint
    weight: float = 1.0  # its score's weight in the reward
    tokenizer: str | None = None  # default: the model directory (its hf/ subdir for a megarl checkpoint)
    micro_batch: MicroBatchConfig = MicroBatchConfig()
    precision: Precision = Precision.FP32

    def engine(self) -> EngineConfig:
        # frozen, forward only: its one micro-batch setting is the forward one; the optimizer is unused
        return EngineConfig(forward_micro_batch=self.micro_batch, precision=self.precision)


@dataclasses.dataclass(frozen=True)
class TrainerSection:
    total_steps: int = 10
    output_dir: str = "outputs/run"
    save_every: int = 0  # steps between checkpoints; 0 = only at the end
    keep_checkpoints: int = 2
    val_every: int = 0  # 0 = no validation
    resume: bool = True  # continue from the latest complete checkpoint in output_dir
    seed: int = 1
    tensorboard: bool = True
    wandb_project: str | None = None  # log to Weights & Biases when set (needs `wandb`)


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """One colocated pool for policy, reference, critic and reward model; dp fills nodes * devices_per_node.

    ``launcher``: ``ray`` hosts the pool in Ray worker processes (any size); ``local`` hosts its one rank
    in the driver process itself (one device; no Ray, no worker processes: the lightest way to run a
    small model on one GPU or on a machine's CPU cores, which torch's threads then share).

    ``allocator``: the host memory allocator of megarl's processes (see :mod:`megarl.controller.allocator`):
    ``auto`` (tcmalloc, else jemalloc, if installed; else glibc), ``tcmalloc``, ``jemalloc`` or ``system``."""

    launcher: str = "ray"  # "ray" | "local"
    allocator: str = "auto"
    nodes: int = 1
    devices_per_node: int = 1
    device: str = "auto"  # "auto" | "cpu" | "gpu"
    cpus_per_device: float = 1.0
    tp: int = 1
    pp: int = 1
    vpp: int | None = None

    def layout(self) -> ParallelLayout:
        return ParallelLayout.for_world(self.nodes * self.devices_per_node, tp=self.tp, pp=self.pp, vpp=self.vpp)


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
    reward_model: RewardModelSection | None = None  # e.g. reward_model.path=... adds one
    trainer: TrainerSection = TrainerSection()


# ------------------------------------------------------------------------------------------ loading


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """YAML file (or nothing) + ``a.b.c=value`` overrides (values parsed as YAML scalars)."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError as e:
            raise ConfigError(f"config file {path} does not exist.") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key.path=value (e.g. policy.optim.lr=1e-5).")
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section.")
        node[parts[-1]] = yaml.safe_load(raw) if raw else ""
    return from_dict(TrainConfig, data)


def to_plain(cfg: Any) -> Any:
    """The config as plain YAML-able data (enums by value)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, enum.Enum):
        return cfg.value
    if isinstance(cfg, dict):
        return {k: to_plain(v) for k, v in cfg.items()}
    if isinstance(cfg, list | tuple):
        return [to_plain(v) for v in cfg]
    return cfg


def dump_config(cfg: TrainConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(to_plain(cfg), sort_keys=False))


# --------------------------------------------------------------------------------------- validation


def check_config(cfg: TrainConfig) -> None:
    """Everything checkable before workers start; raises ConfigError with what to change."""
    if cfg.cluster.device not in ("auto", "cpu", "gpu"):
        raise ConfigError(f"cluster.device must be 'auto', 'cpu' or 'gpu', found {cfg.cluster.device!r}.")
    if cfg.cluster.launcher not in ("ray", "local"):
        raise ConfigError(f"cluster.launcher must be 'ray' or 'local', found {cfg.cluster.launcher!r}.")
    allocator.resolve(cfg.cluster.allocator)
    layout = cfg.cluster.layout()
    if cfg.cluster.launcher == "local" and layout.world_size != 1:
        raise ConfigError(f"cluster.launcher=local runs one rank in the driver process, but nodes x devices_per_node "
                          f"= {layout.world_size}; set both to 1 (tp=pp=1) or use cluster.launcher=ray.")
    if not cfg.model.path or not Path(cfg.model.path).is_dir():
        raise ConfigError(f"model.path {cfg.model.path!r} is not a directory; give an HF model directory or a "
                          "megarl checkpoint (tools/convert_hf_to_megatron.py writes one).")
    if not cfg.data.train:
        raise ConfigError("data.train is empty; give a .jsonl or .parquet prompt file.")
    d, r, a = cfg.data, cfg.rollout, cfg.algorithm
    if d.batch_size % layout.dp:
        raise ConfigError(f"data.batch_size={d.batch_size} must be divisible by the data-parallel size {layout.dp} "
                          f"({layout}); change one of them.")
    rows = d.batch_size * r.n
    if rows % (a.mini_batches * layout.dp):
        raise ConfigError(f"batch_size*n = {rows} responses per step must split into algorithm.mini_batches="
                          f"{a.mini_batches} x dp={layout.dp} equal parts.")
    if a.advantage.estimator in (AdvantageEstimator.GRPO, AdvantageEstimator.RLOO) and r.n < 2:
        raise ConfigError(f"{a.advantage.estimator.value} compares responses to the same prompt; set rollout.n >= 2.")
    if r.backend is RolloutBackend.EMBEDDED and r.tp != 1:
        raise ConfigError(f"the embedded rollout engine runs one full model per rank: rollout.tp must be 1, found "
                          f"{r.tp}; use rollout.backend=vllm for tensor-parallel generation.")
    if r.backend is RolloutBackend.VLLM:
        check_vllm_groups(layout, r.tp)
    if r.temperature == 0:
        raise ConfigError("rollout.temperature=0 (greedy) gives no exploration to learn from; use > 0 for training "
                          "(val_temperature may be 0).")
    t = cfg.trainer
    if t.total_steps < 1 or t.save_every < 0 or t.val_every < 0 or t.keep_checkpoints < 1:
        raise ConfigError("trainer.total_steps and keep_checkpoints must be >= 1, save_every/val_every >= 0.")
    if t.val_every and not d.val:
        raise ConfigError(f"trainer.val_every={t.val_every} but data.val is not set; give a validation file or "
                          "set val_every=0.")
    if a.ppo_epochs < 1 or a.mini_batches < 1:
        raise ConfigError("algorithm.ppo_epochs and mini_batches must be >= 1.")
    if a.recompute_old_log_probs is False and (why := a.old_log_probs_needed_because()):
        raise ConfigError(f"algorithm.recompute_old_log_probs=false, but the old log-probs are needed apart from the "
                          f"update's own forward ({why}). Set algorithm.recompute_old_log_probs=true or leave it "
                          "unset (auto), or take one optimizer step per batch without kl_penalty.")
    _check_reward(cfg)


def _check_reward(cfg: TrainConfig) -> None:
    """At least one reward source, finite weights, an existing reward-model directory. (That it is a
    reward model sharing the policy's tokenizer is checked once the tokenizers load, before any worker
    starts: :func:`megarl.trainer.trainer.check_reward_model`.)"""
    rw, rm = cfg.reward, cfg.reward_model
    if rw.function is None and rm is None:
        raise ConfigError("no reward source: set reward.function (a built-in key or 'file.py:function') and/or "
                          "reward_model.path (a sequence-classification reward model).")
    for name, weight in (("reward.function_weight", rw.function_weight),
                         ("reward_model.weight", rm.weight if rm is not None else 0.0)):
        if not math.isfinite(weight):
            raise ConfigError(f"{name} must be a finite number, found {weight}.")
    if rm is not None and (not rm.path or not Path(rm.path).is_dir()):
        raise ConfigError(f"reward_model.path {rm.path!r} is not a directory; give an HF *ForSequenceClassification "
                          "directory (num_labels=1) or a megarl checkpoint of one.")
