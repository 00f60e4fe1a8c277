"""PolicyRole: the actor. Token log-probs / entropies (forward only) and PPO updates.

Batch fields (right-padded rows, [B, S]): ``input_ids``, ``attention_mask`` (1 on prompt+response
tokens), ``response_mask`` (1 on response tokens that count); for :meth:`update` also
``advantages`` and ``old_log_probs`` (token-aligned: entry i belongs to token i), or, without
``PolicyConfig.recompute_old_log_probs``, ``rollout_log_probs`` instead. Results come back only from
each DP rank's owner (last PP stage, TP rank 0); other ranks return None.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megarl import algos
from megarl.checkpoint import mcore_io
from megarl.controller.role import Role, WorkerContext
from megarl.data.batch import Batch
from megarl.engine.checkpoint import load_training_checkpoint, save_training_checkpoint
from megarl.engine.config import EngineConfig
from megarl.engine.engine import MegatronEngine
from megarl.engine.vocab_parallel import token_log_probs
from megarl.errors import ConfigError
from megarl.metrics import trace
from megarl.metrics.memory import peaks, reset_peaks
from megarl.models.spec import spec_from_hf_config
from megarl.parallel.init import comm_device
from megarl.rollout.base import SamplingParams
from megarl.workers.hybrid import (
    HybridRollout,
    RolloutConfig,
    RolloutMismatchError,
    baseline_fields,
    logprob_abs_diff,
    rollout_batch,
)


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    loss: algos.PolicyLossConfig = algos.PolicyLossConfig()
    entropy_coef: float = 0.0
    temperature: float = 1.0  # must equal the rollout temperature
    kl_loss_coef: float = 0.0  # > 0: add coef * KL(policy || reference) to the loss (needs ``ref_log_probs``)
    kl_estimator: algos.KLEstimator = algos.KLEstimator.K3
    # True: generate() forwards the training model for ``old_log_probs``. False: it does not, and update()
    # uses its own forward's detached log-probs as old (exact only when it is the sole optimizer step on
    # a rollout batch: ratio 1) and compares them to ``rollout_log_probs`` there (rollout.logprob_check).
    recompute_old_log_probs: bool = True


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
    def __init__(self, ctx: WorkerContext, checkpoint_dir: str, engine: EngineConfig, policy: PolicyConfig,
                 trainable: bool = True, rollout: RolloutConfig | None = None) -> None:
        super().__init__(ctx)
        hf_config = mcore_io.read_meta(checkpoint_dir).hf_config
        self.spec = spec_from_hf_config(hf_config)
        self.policy = policy
        self.engine = MegatronEngine(self.spec, ctx.layout, engine, checkpoint_dir=checkpoint_dir, trainable=trainable)
        self.rollout = None
        if rollout is not None:
            pad = self.spec.pad_token_id if self.spec.pad_token_id is not None else 0
            self.rollout = HybridRollout(ctx, self.spec, hf_config, self.engine, rollout, pad)

    def close(self) -> None:
        if self.rollout is not None:
            self.rollout.rollout.close()

    def generate(self, prompts: Batch, params: SamplingParams, baseline: SamplingParams | None = None) -> Batch | None:
        """Sample ``params.n`` responses per prompt with the colocated rollout engine (current weights).

        ``prompts``: ``prompt_ids`` [N, P] right-padded and ``prompt_lengths`` [N] (this DP rank's share).
        Returns training rows (see :func:`megarl.workers.hybrid.rollout_batch`) grouped by prompt, plus
        ``old_log_probs`` from the training model when ``rollout.logprob_check`` and
        ``policy.recompute_old_log_probs`` are on (the PPO ratio's denominator, so the trainer need not
        recompute it; otherwise :meth:`update` does the check); metrics in ``meta["metrics"]``.

        ``baseline`` (one response per prompt, e.g. greedy for ReMax) is sampled after them in the same
        weight sync; each row then carries its prompt's baseline sequence (``baseline_input_ids``, ...:
        :func:`megarl.workers.hybrid.baseline_fields`). Baseline responses get no log-probs and no check.
        """
        if self.rollout is None:
            raise ConfigError("this policy was built without a rollout engine; pass rollout=RolloutConfig(...).")
        cfg = self.rollout.config
        if cfg.logprob_check and params.temperature not in (0.0, self.policy.temperature):
            raise ConfigError(
                f"sampling temperature {params.temperature} differs from policy.temperature "
                f"{self.policy.temperature}: training log-probs would be of another distribution. Set them equal."
            )
        ids = [row[: int(n)].tolist() for row, n in zip(prompts["prompt_ids"], prompts["prompt_lengths"], strict=True)]
        if baseline is not None and baseline.n != 1:
            raise ConfigError(f"a baseline is one response per prompt; found baseline n={baseline.n}.")
        runs, metrics = self.rollout.generate_many(ids, [params] if baseline is None else [params, baseline])
        pad = self.rollout.rollout.pad_token_id
        batch = rollout_batch(ids, runs[0], pad)
        if baseline is not None:
            batch = batch.update(baseline_fields(ids, runs[1], batch["prompt_index"], pad))
        per_prompt = [k for k in prompts.tensors.keys() if k not in ("prompt_ids", "prompt_lengths")]  # noqa: SIM118
        if per_prompt:  # e.g. a global prompt id: copied to each of the prompt's responses
            batch = batch.update(Batch.from_dict({k: prompts[k][batch["prompt_index"]] for k in per_prompt}))
        metrics["rollout/num_tokens"] = float(batch["response_lengths"].sum())
        if cfg.logprob_check and self.policy.recompute_old_log_probs:
            start = time.perf_counter()
            with trace.span("old_log_probs", cat="log_probs"):
                lp = self.compute_log_probs(batch.select("input_ids", "attention_mask"))
            metrics["timing/old_log_probs_s"] = time.perf_counter() - start
            if lp is not None:
                batch = batch.update(Batch.from_dict({"old_log_probs": lp["log_probs"]}))
                diff = logprob_abs_diff(lp["log_probs"], batch["rollout_log_probs"], batch["response_mask"])
                metrics["rollout/logprob_abs_diff"] = diff
                if cfg.max_logprob_abs_diff is not None and diff > cfg.max_logprob_abs_diff:
                    raise _mismatch(diff, cfg.max_logprob_abs_diff)
        if not self.ctx.is_collect_rank:
            return None
        batch.meta["metrics"] = metrics
        return batch

    def compute_log_probs(self, batch: Batch) -> Batch | None:
        """``log_probs`` and ``entropy`` [B, S], token-aligned, zero outside ``attention_mask``."""
        return _log_probs(self.engine, self.ctx, batch, self.policy.temperature)

    def update(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of the policy loss over this mini-batch (all DP ranks' shards together).

        Without ``policy.recompute_old_log_probs`` this is the only step on the rollout batch, at the
        weights that sampled it: this forward's detached log-probs are the old ones (ratio 1). With
        ``rollout.logprob_check`` it then also reports ``rollout/logprob_abs_diff`` (global token mean)
        and raises :class:`RolloutMismatchError` over ``max_logprob_abs_diff`` before the optimizer
        step; with ``kl_loss_coef``, ``kl``: the token-mean KL(policy || reference) of these log-probs
        (what the trainer otherwise reports from the old log-probs as ``actor/kl``).
        """
        cfg, vocab = self.policy, self.spec.vocab_size
        normalizer = global_normalizer(batch["response_mask"])
        check = self.rollout.config if self.rollout is not None and self.rollout.config.logprob_check else None
        gap = (None if cfg.recompute_old_log_probs or check is None
               else _RolloutGap(batch["response_mask"], normalizer, check.max_logprob_abs_diff))

        def loss_fn(logits: torch.Tensor, mb: dict[str, torch.Tensor]):
            lp, ent = token_log_probs(logits, mb["input_ids"], vocab_size=vocab, temperature=cfg.temperature)
            mask = mb["response_mask"].to(lp.dtype)
            old = mb["old_log_probs"] if cfg.recompute_old_log_probs else lp.detach()
            out = algos.compute_policy_loss(cfg.loss, lp, old, mb["advantages"], mask, normalizer)
            entropy = algos.aggregate_entropy(ent, mask, cfg.loss.aggregation, normalizer, cfg.loss.norm_constant)
            loss = out.loss - cfg.entropy_coef * entropy if cfg.entropy_coef else out.loss
            # token-mean metrics of this micro-batch, weighted so that they add up to global means
            weight = mask.sum() / normalizer.token_count
            metrics = {k: v * weight for k, v in out.metrics().items() if k != "loss"}
            if cfg.kl_loss_coef:
                kl = algos.kl_loss(lp, mb["ref_log_probs"], mask, cfg.kl_estimator, cfg.loss.aggregation, normalizer,
                                   cfg.loss.norm_constant)
                loss = loss + cfg.kl_loss_coef * kl
                metrics["kl_loss"] = kl.detach()
                if not cfg.recompute_old_log_probs:
                    per_token = algos.kl_divergence(lp.detach(), mb["ref_log_probs"], cfg.kl_estimator)
                    metrics["kl"] = algos.masked_mean(per_token, mask) * weight
            if gap is not None:
                metrics["rollout/logprob_abs_diff"] = gap.add(lp, mb["rollout_log_probs"], mask)
            return loss, {"pg_loss": out.loss.detach(), "entropy": entropy.detach(), **metrics}

        return self.engine.train_step(batch, loss_fn)


    def memory_peaks(self) -> dict[str, float]:
        """This process's peak host (and device) memory since the last call, then a new phase starts
        (the process hosts every colocated role, so this covers them all)."""
        out = peaks().metrics()
        reset_peaks()
        return out

    def resources(self) -> RankResources:
        """What this rank holds and moved: training-state bytes and the latest weight sync's traffic."""
        sync = self.rollout.last_transfer if self.rollout is not None else None
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

    def __init__(self, ctx: WorkerContext, checkpoint_dir: str, engine: EngineConfig, temperature: float = 1.0):
        super().__init__(ctx)
        self.temperature = temperature
        spec = spec_from_hf_config(mcore_io.read_meta(checkpoint_dir).hf_config)
        self.engine = MegatronEngine(spec, ctx.layout, engine, checkpoint_dir=checkpoint_dir, trainable=False)

    def compute_log_probs(self, batch: Batch) -> Batch | None:
        """``log_probs`` and ``entropy`` [B, S] of the reference model (see PolicyRole)."""
        return _log_probs(self.engine, self.ctx, batch, self.temperature)


def _log_probs(engine: MegatronEngine, ctx: WorkerContext, batch: Batch, temperature: float) -> Batch | None:
    vocab = engine.spec.vocab_size

    def per_token(logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        lp, ent = token_log_probs(logits, mb["input_ids"], vocab_size=vocab, temperature=temperature)
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

    def __init__(self, response_mask: torch.Tensor, normalizer: algos.LossNormalizer, limit: float | None) -> None:
        self.shard_tokens = float(response_mask.sum())
        self.total_tokens = normalizer.token_count
        self.limit = limit
        self.abs_sum = self.tokens = 0.0

    def add(self, log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        diff = ((log_probs.detach().double() - rollout_log_probs.double()).abs() * mask.double()).sum()
        self.abs_sum += diff.item()
        self.tokens += float(mask.sum())
        if self.limit is not None and self.tokens >= self.shard_tokens > 0:
            mean = self.abs_sum / self.tokens
            if mean > self.limit:
                raise _mismatch(mean, self.limit)
        return diff / self.total_tokens


def _mismatch(diff: float, limit: float) -> RolloutMismatchError:
    return RolloutMismatchError(
        f"rollout log-probs differ from the training model's by {diff:.3g} on average (limit {limit}); the "
        "weight sync or the name mapping is broken, or the rollout dtype is too coarse for this limit."
    )


def global_normalizer(response_mask: torch.Tensor) -> algos.LossNormalizer:
    """Token and sequence counts over the whole batch (every DP rank's shard)."""
    counts = algos.LossNormalizer.of(response_mask.double()).as_tensor().to(comm_device())
    dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
    return algos.LossNormalizer.from_tensor(counts)
