"""PolicyRole: the actor. Token log-probs / entropies (forward only) and PPO updates.

Batch fields (right-padded rows, [B, S]): ``input_ids``, ``attention_mask`` (1 on prompt+response
tokens), ``response_mask`` (1 on response tokens that count); for :meth:`update` also
``old_log_probs`` and ``advantages`` (token-aligned: entry i belongs to token i). Results come back
only from each DP rank's owner (last PP stage, TP rank 0); other ranks return None.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megarl import algos
from megarl.checkpoint import mcore_io
from megarl.controller.role import Role, WorkerContext
from megarl.data.batch import Batch
from megarl.engine.config import EngineConfig
from megarl.engine.engine import MegatronEngine
from megarl.engine.vocab_parallel import token_log_probs
from megarl.models.spec import spec_from_hf_config


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    loss: algos.PolicyLossConfig = algos.PolicyLossConfig()
    entropy_coef: float = 0.0
    temperature: float = 1.0  # must equal the rollout temperature


class PolicyRole(Role):
    def __init__(self, ctx: WorkerContext, checkpoint_dir: str, engine: EngineConfig, policy: PolicyConfig,
                 trainable: bool = True) -> None:
        super().__init__(ctx)
        self.spec = spec_from_hf_config(mcore_io.read_meta(checkpoint_dir).hf_config)
        self.policy = policy
        self.engine = MegatronEngine(self.spec, ctx.layout, engine, checkpoint_dir=checkpoint_dir, trainable=trainable)

    def compute_log_probs(self, batch: Batch) -> Batch | None:
        """``log_probs`` and ``entropy`` [B, S], token-aligned, zero outside ``attention_mask``."""
        return _log_probs(self.engine, self.ctx, batch, self.policy.temperature)

    def update(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of the policy loss over this mini-batch (all DP ranks' shards together)."""
        cfg, vocab = self.policy, self.spec.vocab_size
        normalizer = global_normalizer(batch["response_mask"])

        def loss_fn(logits: torch.Tensor, mb: dict[str, torch.Tensor]):
            lp, ent = token_log_probs(logits, mb["input_ids"], vocab_size=vocab, temperature=cfg.temperature)
            mask = mb["response_mask"].to(lp.dtype)
            out = algos.compute_policy_loss(cfg.loss, lp, mb["old_log_probs"], mb["advantages"], mask, normalizer)
            entropy = algos.aggregate_entropy(ent, mask, cfg.loss.aggregation, normalizer, cfg.loss.norm_constant)
            loss = out.loss - cfg.entropy_coef * entropy if cfg.entropy_coef else out.loss
            # token-mean metrics of this micro-batch, weighted so that they add up to global means
            weight = mask.sum() / normalizer.token_count
            metrics = {k: v * weight for k, v in out.metrics().items() if k != "loss"}
            return loss, {"pg_loss": out.loss.detach(), "entropy": entropy.detach(), **metrics}

        return self.engine.train_step(batch, loss_fn)


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


def global_normalizer(response_mask: torch.Tensor) -> algos.LossNormalizer:
    """Token and sequence counts over the whole batch (every DP rank's shard)."""
    counts = algos.LossNormalizer.of(response_mask.double()).as_tensor()
    dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
    return algos.LossNormalizer.from_tensor(counts)
