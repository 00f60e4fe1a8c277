"""CriticRole (values + clipped value-loss updates) and RewardModelRole (sequence scores).

Both put a scalar head on the decoder. A critic starts from an HF sequence-classification
checkpoint (its ``score`` head) or from a causal LM (a fresh, seeded head replaces the LM head).
Values are token-aligned like log-probs: ``values[:, i]`` is the head applied to the state that
produced token ``i`` (the hidden state at position ``i - 1``); position 0 gets 0. A reward model
scores each sequence at its last real token, as `transformers`' sequence classifiers do.
"""

from __future__ import annotations

import torch

from megarl import algos
from megarl.checkpoint.format import read_meta
from megarl.checkpoint.training import load_training_checkpoint, save_training_checkpoint
from megarl.controller.role import Role, WorkerContext
from megarl.data.batch import Batch
from megarl.engine.config import EngineConfig
from megarl.engine.engine import Extreme, MegatronEngine
from megarl.engine.packing import rows_of
from megarl.engine.results import StepResult
from megarl.metrics.memory import take_peaks
from megarl.models.spec import Head, spec_from_hf_config
from megarl.parallel.init import process_groups
from megarl.roles.policy import global_normalizer, offline_counts, with_sample_mask

VALUE_LOSS_AGGREGATION = algos.LossAggregation.TOKEN_MEAN  # the value loss averages over every response token


def _scalar_engine(ctx: WorkerContext, checkpoint_dir: str, engine: EngineConfig, trainable: bool) -> MegatronEngine:
    spec = spec_from_hf_config(read_meta(checkpoint_dir).hf_config)
    exclude = ("output_layer.",) if spec.head is Head.LM else ()  # a causal LM: new head, LM head not loaded
    return MegatronEngine(spec.with_head(Head.SCALAR), ctx.layout, engine, checkpoint_dir=checkpoint_dir,
                          trainable=trainable, load_exclude=exclude, groups=process_groups())


def _token_values(output: torch.Tensor, mb: dict) -> torch.Tensor:
    """A micro-batch's head outputs -> token-aligned values [b, s] (the state before each token)."""
    v = rows_of(output, mb).squeeze(-1).float()
    return torch.cat([v.new_zeros(v.shape[0], 1), v[:, :-1]], dim=1)


class CriticRole(Role):
    def __init__(self, ctx: WorkerContext, *, checkpoint_dir: str, engine: EngineConfig, value_clip: float | None,
                 trainable: bool = True) -> None:
        """``value_clip``: the clipped value loss's range around the old values (None: unclipped)."""
        super().__init__(ctx)
        self.value_clip = value_clip
        self.engine = _scalar_engine(ctx, checkpoint_dir, engine, trainable)

    def compute_values(self, batch: Batch) -> Batch | None:
        """``values`` [B, S], token-aligned, zero outside ``attention_mask``."""
        out = self.engine.forward(batch, lambda o, mb: {"values": _token_values(o, mb) * mb["attention_mask"]})
        return Batch.from_dict(out) if out is not None and self.ctx.is_collect_rank else None

    def update(self, batch: Batch) -> StepResult:
        """One optimizer step of the (clipped) value loss; needs ``old_values`` and ``returns``."""
        normalizer = global_normalizer(batch["response_mask"], self.engine.groups.dp)

        def loss_fn(output: torch.Tensor, mb: dict[str, torch.Tensor]):
            values = _token_values(output, mb)
            mask = mb["response_mask"].to(values.dtype)
            out = algos.value_loss(values, mb["old_values"], mb["returns"], mask, self.value_clip,
                                   VALUE_LOSS_AGGREGATION, normalizer)
            weight = mask.sum() / normalizer.token_count
            return out.loss, {"vf_loss": out.loss.detach(), "vf_clip_frac": out.clip_frac * weight}

        return self.engine.train_step(batch, loss_fn)

    def train(self, batch: Batch, objective: algos.ScalarObjective) -> StepResult:
        """One optimizer step of an offline objective on each row's score (the head at its last real token):
        reward-model training (:class:`megarl.algos.BradleyTerryObjective`)."""
        counts = offline_counts(batch, self.engine.groups.dp)

        def loss_fn(output: torch.Tensor, mb: dict[str, torch.Tensor]):
            scores = _at_last_token(rows_of(output, mb).squeeze(-1).float(), mb["attention_mask"])
            return objective.loss(scores, mb, counts)

        extremes = {k: Extreme(v) for k, v in objective.extremes().items()}
        return self.engine.train_step(with_sample_mask(batch), loss_fn, extremes, group=objective.group)

    def compute_scores(self, batch: Batch) -> Batch | None:
        """``scores`` [B]: the head at each row's last real token, as a reward model scores (evaluation of a reward
        model in training)."""
        return _last_token_scores(self.engine, self.ctx, batch)

    def memory_peaks(self) -> dict[str, float]:
        """This process's peak memory since the last call (see PolicyRole.memory_peaks)."""
        return take_peaks()

    def save_checkpoint(self, out_dir: str, step: int, source_dir: str) -> None:
        """Collective: model + optimizer + scheduler + RNG to ``out_dir`` (atomic), recorded as a sequence
        classifier: a reward model's or critic's checkpoint loads with its head (``reward_model.model.path``)."""
        save_training_checkpoint(self.engine, out_dir, step=step, source_dir=source_dir)

    def load_checkpoint(self, ckpt_dir: str) -> int:
        return load_training_checkpoint(self.engine, ckpt_dir)


class RewardModelRole(Role):
    def __init__(self, ctx: WorkerContext, *, checkpoint_dir: str, engine: EngineConfig) -> None:
        super().__init__(ctx)
        self.engine = _scalar_engine(ctx, checkpoint_dir, engine, trainable=False)

    def compute_scores(self, batch: Batch) -> Batch | None:
        """``scores`` [B]: the head at each sequence's last real token (``attention_mask`` right-padded)."""
        return _last_token_scores(self.engine, self.ctx, batch)


def _last_token_scores(engine: MegatronEngine, ctx: WorkerContext, batch: Batch) -> Batch | None:
    out = engine.forward(batch, lambda o, mb: {"raw": rows_of(o, mb).squeeze(-1).float()})
    if out is None or not ctx.is_collect_rank:
        return None
    return Batch.from_dict({"scores": _at_last_token(out["raw"], batch["attention_mask"])})


def _at_last_token(per_token: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[b, s] -> [b]: each right-padded row's value at its last real token (a row of none: its first)."""
    last = (attention_mask.sum(-1).long() - 1).clamp(min=0)
    return per_token.gather(1, last.unsqueeze(1)).squeeze(1)
