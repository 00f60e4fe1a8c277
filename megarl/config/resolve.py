"""The one step that turns a checked :class:`TrainConfig` into what the run uses: every ``null``-means-megarl-
decides field decided, so the dumped ``<output_dir>/config.yaml`` shows the run as it ran.

Decided here (on the driver, before any worker starts): the tokenizer directories, whether old log-probs
get a forward of their own (``algorithm.recompute_old_log_probs``), the forward-only micro-batching of
each engine, and the role -> pool placement. Left to the workers, because only the machine they land on
knows: ``cluster.pools.*.device: auto`` and ``rollout.engine.offload_train_state: null`` (both follow
whether the worker has a GPU), and ``cluster.allocator: auto`` (logged by every process).

:func:`sampling_params` builds a generation call's parameters from the rollout section. Pure module.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megarl.checkpoint.format import HF_SUBDIR, is_checkpoint
from megarl.config.train import ModelConfig, RolloutSection, TrainConfig
from megarl.engine.config import EngineConfig
from megarl.rollout.base import SamplingConfig, SamplingParams


def resolve(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with megarl's decisions made (idempotent: resolving a resolved config changes nothing)."""
    a = cfg.algorithm
    rm = cfg.reward_model
    if rm is not None:
        rm = dataclasses.replace(rm, model=_model(rm.model), engine=_engine(rm.engine))
    (pool,) = cfg.cluster.pools
    placement = {r.value: cfg.cluster.placement.get(r.value, pool) for r in cfg.roles()}
    return dataclasses.replace(
        cfg,
        model=_model(cfg.model),
        policy=_engine(cfg.policy),
        critic=_engine(cfg.critic),
        algorithm=dataclasses.replace(a, recompute_old_log_probs=a.recomputes_old_log_probs),
        reward_model=rm,
        cluster=dataclasses.replace(cfg.cluster, placement=placement),
    )


def hf_files(path: str | Path) -> Path:
    """Where a model directory's HF files (config.json, tokenizer) are: itself, or a megarl checkpoint's hf/."""
    return Path(path) / HF_SUBDIR if is_checkpoint(path) else Path(path)


def _model(model: ModelConfig) -> ModelConfig:
    return dataclasses.replace(model, tokenizer=str(hf_files(model.tokenizer or model.path)))


def _engine(engine: EngineConfig) -> EngineConfig:
    return dataclasses.replace(engine, forward_micro_batch=engine.forward_batching)


def sampling_params(sampling: SamplingConfig, rollout: RolloutSection, stop_token_ids: tuple[int, ...],
                    seed: int | None = None) -> SamplingParams:
    """One generation call's parameters: ``sampling`` (training's or validation's), the section's response
    limit, the stop ids (the tokenizer's eos, when ``stop_at_eos``, and ``rollout.stop_token_ids``)."""
    fields = {f.name: getattr(sampling, f.name) for f in dataclasses.fields(SamplingConfig)}
    return SamplingParams(**fields, max_new_tokens=rollout.max_new_tokens, stop_token_ids=stop_token_ids, seed=seed)


def stop_token_ids(rollout: RolloutSection, eos_token_id: int | None) -> tuple[int, ...]:
    eos = (eos_token_id,) if rollout.stop_at_eos and eos_token_id is not None else ()
    return tuple(dict.fromkeys(eos + rollout.stop_token_ids))
