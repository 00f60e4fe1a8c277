"""PolicyRole: the actor. Token log-probs / entropies (forward only) and PPO updates.

Batch fields (right-padded rows, [B, S]): ``input_ids``, ``attention_mask`` (1 on prompt+response
tokens), ``response_mask`` (1 on response tokens that count); for :meth:`update` also
``advantages`` and ``old_log_probs`` (token-aligned: entry i belongs to token i), or, without
``AlgorithmConfig.recomputes_old_log_probs``, ``rollout_log_probs`` instead; with both, the update applies
``algorithm.rollout_correction`` to ``pi_old / pi_rollout`` (:mod:`megarl.algos.correction`). Results come
back only from each DP rank's owner (last PP stage, TP rank 0); other ranks return None.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megarl import algos
from megarl.algos.config import AlgorithmConfig
from megarl.checkpoint.format import read_meta
from megarl.checkpoint.training import load_training_checkpoint, save_training_checkpoint
from megarl.controller.role import Role, WorkerContext
from megarl.controller.spec import Timeouts
from megarl.data.batch import Batch, prompt_lists
from megarl.engine.config import EngineConfig
from megarl.engine.engine import Extreme, MegatronEngine
from megarl.engine.packing import row_log_probs
from megarl.engine.results import StepResult
from megarl.errors import ConfigError
from megarl.metrics.memory import peaks, take_peaks
from megarl.models import lora
from megarl.models.spec import spec_from_hf_config
from megarl.parallel import collectives
from megarl.parallel.init import process_groups
from megarl.roles.hybrid import HybridRollout
from megarl.roles.results import WeightSync
from megarl.roles.split import WeightSender
from megarl.rollout.base import SamplingParams
from megarl.rollout.config import RolloutConfig
from megarl.rollout.mismatch import mismatch_error
from megarl.rollout.rows import generation_rows


@dataclasses.dataclass(frozen=True)
class RankResources:
    """One policy rank's measured state (bytes): for the benchmark's per-rank table and the planner check."""

    rank: int
    coords: dict[str, int]
    params: int
    grads: int
    optimizer: int
    reshard_bytes_sent: int
    reshard_bytes_received: int
    host_rss: int


class PolicyRole(Role):
    """The policy: trains with Megatron (:meth:`update`) and, with ``rollout``, generates with a colocated
    rollout engine. A rollout phase is :meth:`sync_weights` (train -> rollout), any number of
    :meth:`generate` calls (sampling only: training, a ReMax baseline, evaluation), then :meth:`to_train`."""

    def __init__(self, ctx: WorkerContext, *, checkpoint_dir: str, engine: EngineConfig, algorithm: AlgorithmConfig,
                 temperature: float, rollout: RolloutConfig | None = None, seed: int = 0,
                 trainable: bool = True, rollout_ranks: int | None = None) -> None:
        super().__init__(ctx)
        hf_config = read_meta(checkpoint_dir).hf_config
        self.spec = spec_from_hf_config(hf_config)
        self.algorithm, self.temperature = algorithm, temperature
        self.engine = MegatronEngine(self.spec, ctx.layout, engine, checkpoint_dir=checkpoint_dir, trainable=trainable,
                                     groups=process_groups())
        self.rollout_config = rollout
        self.rollout: HybridRollout | None = None  # a colocated rollout engine
        self.sender: WeightSender | None = None  # or rollout engines on a pool of their own (split placement)
        if rollout is not None and rollout_ranks is not None:
            self.sender = WeightSender(ctx, self.spec, self.engine, rollout, rollout_ranks)
        elif rollout is not None:
            pad = self.spec.pad_token_id if self.spec.pad_token_id is not None else 0
            self.rollout = HybridRollout(ctx, self.spec, hf_config, self.engine, rollout, pad, seed=seed)

    def close(self) -> None:
        if self.rollout is not None:
            self.rollout.rollout.close()
        if self.sender is not None:
            self.sender.member.link = None

    def sync_weights(self, version: int = 0) -> WeightSync:
        """Train -> rollout (collective): the rollout engine wakes up with the current training weights, which
        the rows it generates record as ``policy_version``."""
        return self._hybrid().to_rollout(version)

    # split placement: the rollout engines are a pool of their own (megarl.roles.split)

    def open_weight_link(self, timeouts: Timeouts) -> tuple[str, int]:
        """Rank 0: open the rendezvous of the weight link on a free port; (host, port) for every member."""
        return self._sender().member.open(self.ctx.node_ip, timeouts)

    def join_weight_link(self, host: str, port: int, timeouts: Timeouts) -> int:
        """Collective with the rollout pool's :meth:`~megarl.roles.split.RolloutRole.join_weight_link`; the
        link's size (training ranks + rollout ranks)."""
        sender = self._sender()
        sender.member.join(host, port, self.ctx.rank, sender.link_size, self.ctx.device, timeouts)
        return sender.link_size

    def push_weights(self) -> WeightSync:
        """Collective with the rollout pool's :meth:`~megarl.roles.split.RolloutRole.receive_weights`."""
        return self._sender().push()

    def _sender(self) -> WeightSender:
        if self.sender is None:
            raise ConfigError("this policy's rollout engines are colocated (no rollout pool of their own)")
        return self.sender

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch | None:
        """Sample ``params.n`` responses per prompt with the synced rollout engine (collective; no training
        forward, no checks: the same call serves training rollouts, baselines and evaluation).

        ``prompts``: ``prompt_ids`` [N, P] right-padded and ``prompt_lengths`` [N] (this DP rank's share),
        plus any per-prompt fields (e.g. a global prompt id), which are copied to each of the prompt's rows.
        Returns training rows (:func:`megarl.rollout.rows.rollout_batch`) grouped by prompt, with
        ``rollout/*`` metrics in ``meta["metrics"]``, on each DP rank's owner (None elsewhere).
        """
        ids = prompt_lists(prompts)
        outputs, metrics = self._hybrid().generate(ids, params)
        batch = generation_rows(prompts, ids, outputs, self.rollout.rollout.pad_token_id, metrics, self.rollout.version)
        return batch if self.ctx.is_collect_rank else None

    def to_train(self) -> float:
        """Rollout -> train (collective): the rollout engine sleeps, training state returns; its seconds."""
        return self._hybrid().to_train()

    def _hybrid(self) -> HybridRollout:
        if self.rollout is None:
            raise ConfigError("this policy was built without a rollout engine; pass rollout=RolloutConfig(...).")
        return self.rollout

    def compute_log_probs(self, batch: Batch, temperature: float | None = None, adapters: bool = True) -> Batch | None:
        """``log_probs`` and ``entropy`` [B, S], token-aligned, zero outside ``attention_mask``; at the sampling
        temperature the role was built with, or ``temperature`` (1: the model's own, for offline objectives).
        ``adapters=False``: a LoRA policy's base model (its reference policy)."""
        temperature = self.temperature if temperature is None else temperature
        if adapters:
            return _log_probs(self.engine, self.ctx, batch, temperature)
        if self.engine.lora is None:
            raise ConfigError("adapters=False asks for a LoRA policy's base model, but this policy has no adapters "
                              "(policy.lora is null): the reference is a role of its own.")
        with lora.adapters_disabled():
            return _log_probs(self.engine, self.ctx, batch, temperature)

    def update(self, batch: Batch) -> StepResult:
        """One optimizer step of the policy loss over this mini-batch (all DP ranks' shards together): each
        micro-batch's token log-probs and entropies, then :func:`megarl.algos.policy_objective` (correction
        weights, top-entropy mask, policy loss, entropy bonus, KL loss and their metrics).

        Without ``algorithm.recomputes_old_log_probs`` this is the only step on the rollout batch, at the
        weights that sampled it: this forward's detached log-probs are the old ones (ratio 1). With a
        rollout engine it then also reports ``rollout/logprob_abs_diff`` (global token mean against the
        batch's ``rollout_log_probs``) and raises :class:`~megarl.rollout.mismatch.RolloutMismatchError`
        over the engine's ``max_logprob_abs_diff`` before the optimizer step; with ``kl_loss_coef``, ``kl``:
        the token-mean KL(policy || reference) of these log-probs (what the trainer otherwise reports as
        ``actor/kl``).
        """
        a, vocab, temperature, tp = self.algorithm, self.spec.vocab_size, self.temperature, self.engine.groups.tp
        recompute = a.recomputes_old_log_probs
        normalizer = global_normalizer(batch["response_mask"], self.engine.groups.dp)
        gap = (None if recompute or self.rollout_config is None
               else _RolloutGap(batch["response_mask"], normalizer, self.rollout_config))
        # where the mismatch correction applies (the rollout's log-probs came and it corrects something), its
        # ratio extremes are reduced by max / min, not summed
        corrects = "rollout_log_probs" in batch and a.rollout_correction.active

        def loss_fn(logits: torch.Tensor, mb: dict[str, torch.Tensor]):
            lp, ent = row_log_probs(logits, mb, vocab_size=vocab, temperature=temperature, group=tp)
            inputs = algos.ObjectiveInputs(lp, ent, mb["advantages"], mb["response_mask"],
                                           old_log_probs=mb["old_log_probs"] if recompute else None,
                                           rollout_log_probs=mb.get("rollout_log_probs"),
                                           ref_log_probs=mb.get("ref_log_probs"))
            out = algos.policy_objective(a, inputs, normalizer)
            if gap is None:
                return out.loss, out.metrics
            diff = gap.add(lp, mb["rollout_log_probs"], mb["response_mask"].to(lp.dtype))
            return out.loss, out.metrics | {"rollout/logprob_abs_diff": diff}

        return self.engine.train_step(batch, loss_fn, _CORRECTION_EXTREMES if corrects else None)

    def train(self, batch: Batch, objective: algos.LMObjective) -> StepResult:
        """One optimizer step of an offline objective (:mod:`megarl.algos.offline`: SFT, DPO, ...) over this
        mini-batch (all DP ranks' shards together), on the per-token log-probs and entropies at temperature 1:
        the data's own tokens, not samples of the policy."""
        vocab, tp = self.spec.vocab_size, self.engine.groups.tp
        counts = offline_counts(batch, self.engine.groups.dp)

        def loss_fn(logits: torch.Tensor, mb: dict[str, torch.Tensor]):
            lp, ent = row_log_probs(logits, mb, vocab_size=vocab, temperature=1.0, group=tp)
            return objective.loss(lp, ent, mb, counts)

        return self.engine.train_step(with_sample_mask(batch), loss_fn, group=objective.group)

    def memory_peaks(self) -> dict[str, float]:
        """This process's peak host (and device) memory since the last call, then a new phase starts
        (the process hosts every colocated role, so this covers them all)."""
        return take_peaks()

    def resources(self) -> RankResources:
        """What this rank holds and moved: training-state bytes and the latest weight sync's traffic."""
        sync = next((s.last_transfer for s in (self.rollout, self.sender) if s is not None), None)
        return RankResources(rank=self.ctx.rank, coords=self.ctx.coords._asdict(), **self.engine.state_bytes(),
                             reshard_bytes_sent=sync.bytes_sent if sync else 0,
                             reshard_bytes_received=sync.bytes_received if sync else 0,
                             host_rss=peaks().host_rss)

    def save_checkpoint(self, out_dir: str, step: int, source_dir: str) -> None:
        """Collective: model + optimizer + scheduler + RNG to ``out_dir`` (atomic)."""
        save_training_checkpoint(self.engine, out_dir, step=step, source_dir=source_dir)

    def load_checkpoint(self, ckpt_dir: str) -> int:
        """Collective: restore what :meth:`save_checkpoint` wrote; returns its step."""
        return load_training_checkpoint(self.engine, ckpt_dir)


class ReferenceRole(Role):
    """The frozen reference policy: forward-only log-probs (no optimizer, no gradients)."""

    def __init__(self, ctx: WorkerContext, *, checkpoint_dir: str, engine: EngineConfig, temperature: float) -> None:
        super().__init__(ctx)
        self.temperature = temperature
        spec = spec_from_hf_config(read_meta(checkpoint_dir).hf_config)
        self.engine = MegatronEngine(spec, ctx.layout, engine, checkpoint_dir=checkpoint_dir, trainable=False,
                                     groups=process_groups())

    def compute_log_probs(self, batch: Batch, temperature: float | None = None) -> Batch | None:
        """``log_probs`` and ``entropy`` [B, S] of the reference model (see PolicyRole)."""
        return _log_probs(self.engine, self.ctx, batch, self.temperature if temperature is None else temperature)


_CORRECTION_EXTREMES = {"mismatch/ratio_max": Extreme.MAX, "mismatch/ratio_min": Extreme.MIN}


def _log_probs(engine: MegatronEngine, ctx: WorkerContext, batch: Batch, temperature: float) -> Batch | None:
    vocab, tp = engine.spec.vocab_size, engine.groups.tp

    def per_token(logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        lp, ent = row_log_probs(logits, mb, vocab_size=vocab, temperature=temperature, group=tp)
        mask = mb["attention_mask"].to(lp.dtype)
        return {"log_probs": lp * mask, "entropy": ent * mask}

    out = engine.forward(batch, per_token)
    return Batch.from_dict(out) if out is not None and ctx.is_collect_rank else None


class _RolloutGap:
    """|training - rollout| log-probs over response tokens, accumulated over one update's micro-batches.

    :meth:`add` returns a micro-batch's share of the global token mean (summed over micro-batches and
    DP ranks by the engine) and, once this rank's last token is seen, checks its shard's mean against
    ``limit`` (as the check after generation does) - in the loss function, so before the optimizer step.
    """

    def __init__(self, response_mask: torch.Tensor, normalizer: algos.LossNormalizer, rollout: RolloutConfig) -> None:
        self.shard_tokens = float(response_mask.sum())
        self.total_tokens = normalizer.token_count
        self.limit, self.lora_sync = rollout.max_logprob_abs_diff, rollout.lora_sync
        self.abs_sum = self.tokens = 0.0

    def add(self, log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        diff = ((log_probs.detach().double() - rollout_log_probs.double()).abs() * mask.double()).sum()
        self.abs_sum += diff.item()
        self.tokens += float(mask.sum())
        if self.limit is not None and self.tokens >= self.shard_tokens > 0:
            mean = self.abs_sum / self.tokens
            if mean > self.limit:
                raise mismatch_error(mean, self.limit, self.lora_sync)
        return diff / self.total_tokens


def offline_counts(batch: Batch, dp_group: dist.ProcessGroup) -> algos.Counts:
    """An offline objective's counts over the whole batch (every DP rank's shard)."""
    counts = collectives.all_reduce(algos.Counts.of(batch["response_mask"], torch.ones(len(batch))), group=dp_group)
    return algos.Counts(tokens=counts[0], rows=counts[1])


def with_sample_mask(batch: Batch) -> Batch:
    """``batch`` with ``sample_mask`` (1 on every row: the engine zeroes it on idle micro-batches)."""
    return batch.update(Batch.from_dict({"sample_mask": torch.ones(len(batch))}))


def global_normalizer(response_mask: torch.Tensor, dp_group: dist.ProcessGroup) -> algos.LossNormalizer:
    """Token and sequence counts over the whole batch (every DP rank's shard, summed over ``dp_group``)."""
    counts = collectives.all_reduce(algos.LossNormalizer.of(response_mask.double()).as_tensor(), group=dp_group)
    return algos.LossNormalizer.from_tensor(counts)
