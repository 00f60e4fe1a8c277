"""Engine configuration: optimizer, LR schedule, micro-batching (typed, defaults live here only)."""

from __future__ import annotations

import dataclasses
import enum

from megarl.errors import ConfigError


class OptimizerName(enum.Enum):
    ADAM = "adam"  # AdamW (decoupled weight decay), megatron-core's
    SGD = "sgd"


class LRDecay(enum.Enum):
    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"


class Precision(enum.Enum):
    AUTO = "auto"  # bfloat16 on CUDA, float32 on CPU: resolved where the device is known (resolve)
    FP32 = "float32"
    BF16 = "bfloat16"  # bf16 params, fp32 master weights and grads (GPU)

    def resolve(self, cuda: bool) -> Precision:
        """The precision on a device: ``AUTO`` is bfloat16 on CUDA (``cuda``), float32 on CPU; others are themselves."""
        if self is not Precision.AUTO:
            return self
        return Precision.BF16 if cuda else Precision.FP32


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    optimizer: OptimizerName = OptimizerName.ADAM  # adam: AdamW (decoupled weight decay); sgd
    lr: float = 1e-6  # peak learning rate
    min_lr: float = 0.0  # floor of the decay
    weight_decay: float = 0.0  # decoupled (AdamW) weight decay
    adam_beta1: float = 0.9  # Adam's first-moment decay
    adam_beta2: float = 0.999  # Adam's second-moment decay
    adam_eps: float = 1e-8  # Adam's denominator epsilon
    sgd_momentum: float = 0.0  # SGD only
    clip_grad: float = 1.0  # global grad-norm clip; 0 disables
    lr_warmup_steps: int = 0  # linear warm-up from lr/W to lr over W optimizer steps
    lr_decay: LRDecay = LRDecay.CONSTANT  # schedule after warm-up, from lr to min_lr
    lr_decay_steps: int = 1  # optimizer steps over which the LR decays (after warm-up)
    use_distributed_optimizer: bool = True  # megatron-core's: optimizer state sharded over DP (Adam only)
    max_consecutive_nonfinite: int = 3  # skipped steps in a row (NaN/inf loss or grads) before aborting

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"need 0 <= min_lr <= lr and lr > 0, found lr={self.lr}, min_lr={self.min_lr}")
        if self.lr_warmup_steps < 0 or self.lr_decay_steps < 1:
            raise ConfigError("lr_warmup_steps must be >= 0 and lr_decay_steps >= 1")
        if self.optimizer is OptimizerName.SGD and self.use_distributed_optimizer:
            raise ConfigError("megatron-core's distributed optimizer supports Adam only, found optimizer: sgd with "
                              "use_distributed_optimizer: true; set use_distributed_optimizer: false for SGD.")


@dataclasses.dataclass(frozen=True)
class MicroBatchConfig:
    """Micro-batches are formed per DP rank by token budget, longest sequences first: packed (the engine's
    ``packing``) first fit while the sum of their lengths stays within ``max_tokens``; else greedily while ``size *
    longest <= max_tokens``, each micro-batch cut to its own longest sequence. At most ``max_size`` rows each."""

    max_tokens: int = 8192  # tokens per micro-batch (packed: real tokens; padded: rows x longest row)
    max_size: int = 64  # rows per micro-batch

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.max_size < 1:
            raise ConfigError(f"micro-batch max_tokens and max_size must be >= 1, found {self.max_tokens}, "
                              f"{self.max_size}")


LORA_TARGETS = ("qkv", "proj", "fc1", "fc2")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters on the model's linears (megarl/models/lora.py): only the adapters train, the base weights
    stay frozen (and serve as the reference policy). ``targets`` are megatron-core's fused linears: ``qkv`` (q, k
    and v: one A, their B stacked), ``proj`` (o_proj), ``fc1`` (gate and up: one A), ``fc2`` (down_proj); in an MoE
    layer ``fc1`` / ``fc2`` are every expert's."""

    rank: int = 8  # r: the adapter's inner dimension (A is [r, in], B is [out, r])
    alpha: float = 16.0  # the update is (alpha / r) * B A, as peft's lora_alpha
    dropout: float = 0.0  # on the adapter's input in training updates, as peft's lora_dropout
    # the linears adapted, of qkv, proj, fc1, fc2 (all four: peft's "all-linear" for these models)
    targets: list[str] = dataclasses.field(default_factory=lambda: list(LORA_TARGETS))

    def __post_init__(self) -> None:
        if self.rank < 1 or self.alpha <= 0 or not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora needs rank >= 1, alpha > 0 and 0 <= dropout < 1, found rank={self.rank}, "
                              f"alpha={self.alpha}, dropout={self.dropout}")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ConfigError(f"lora.targets must be distinct names out of {list(LORA_TARGETS)} (q/k/v is 'qkv', "
                              f"gate/up 'fc1', down_proj 'fc2', o_proj 'proj'), found {self.targets}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


# Forward-only passes by default take the training micro-batch's token budget, which bounds the logits
# and each layer's transient activations as in training, but FORWARD_ROWS times its row cap: without a
# backward nothing else accumulates, and for short rows (where the row cap binds) fewer, larger micro-batches
# cost fewer per-op overheads (2-layer model, 256 rows of 5 tokens on CPU: reference log-probs 33 -> 17 ms).
# Not the budget too: on CPU, larger tensors than training's only add page faults (30M model, 17k tokens).
FORWARD_ROWS = 4


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    optim: OptimConfig = OptimConfig()
    micro_batch: MicroBatchConfig = MicroBatchConfig()  # forward-backward passes (updates)
    forward_micro_batch: MicroBatchConfig | None = None  # forward-only passes; null: micro_batch with 4x its rows
    # auto: bfloat16 on CUDA, float32 on CPU; float32; or bfloat16 weights with fp32 main grads and optimizer state
    precision: Precision = Precision.AUTO
    seed: int = 1234  # initialisation of weights the checkpoint lacks (e.g. a critic's new value head)
    moe_aux_loss_coef: float = 0.0  # MoE models: weight of the router's load-balancing loss in updates; 0: off
    router_replay: bool = False  # MoE models: route every token to the rollout's recorded experts (R3)
    sequence_parallel: bool | None = None  # tp > 1; null: MoE models only (training needs it); true: all; false: off
    lora: LoRAConfig | None = None  # null: every weight trains; else only low-rank adapters (docs/lora.md)
    # true: each micro-batch's rows packed into one token stream (no padding computed; megarl/engine/packing.py),
    # the micro-batch budget then counting real tokens; false: rows right-padded to the micro-batch's longest
    packing: bool = True

    def __post_init__(self) -> None:
        if self.moe_aux_loss_coef < 0:
            raise ConfigError(f"moe_aux_loss_coef must be >= 0, found {self.moe_aux_loss_coef}")

    def uses_sequence_parallel(self, moe: bool, tp: int) -> bool:
        """Whether a model (``moe``: a Mixture-of-Experts one) runs with sequence parallelism at ``tp``."""
        wanted = moe if self.sequence_parallel is None else self.sequence_parallel
        return wanted and tp > 1

    @property
    def forward_batching(self) -> MicroBatchConfig:
        """Micro-batching of forward-only passes (old/reference log-probs, values, reward scores):
        ``forward_micro_batch``, or by default ``micro_batch`` with :data:`FORWARD_ROWS` times its rows."""
        if self.forward_micro_batch is not None:
            return self.forward_micro_batch
        return dataclasses.replace(self.micro_batch, max_size=self.micro_batch.max_size * FORWARD_ROWS)
