"""The one step that turns a checked :class:`TrainConfig` into what the run uses: every ``null``-means-megarl-
decides field decided, so the dumped ``<output_dir>/config.yaml`` shows the run as it ran.

Decided here (on the driver, before any worker starts): the layout sizes set to ``auto`` (the planner's cheapest
fitting layout, :func:`megarl.config.auto.decide_layout`, its reason in ``cluster.pools.NAME.auto_reason``), every
path made absolute (workers may run in another directory, or on another machine with a shared filesystem), the
tokenizer directories, whether old log-probs get a forward of their own (``algorithm.recompute_old_log_probs``), the
forward-only micro-batching of each engine, the role -> pool placement, the embedded engine's prefix cache
(``rollout.engine.prefix_cache_mb``) and vLLM's share of the GPU and context length
(``rollout.engine.gpu_memory_utilization``, ``max_model_len``). Left to the workers, because only the machine
they land on knows: ``cluster.pools.*.device: auto`` and ``rollout.engine.offload_train_state: null`` (both follow
whether the worker has a GPU), and ``cluster.allocator: auto`` (logged by every process).

:func:`sampling_params` builds a generation call's parameters from the rollout section. Pure module.
"""

from __future__ import annotations

import dataclasses
import os

from megarl.checkpoint.format import hf_files
from megarl.config.auto import decide_layout
from megarl.config.train import ModelConfig, RolloutSection, TrainConfig
from megarl.engine.config import EngineConfig
from megarl.rewards.rules import BUILTIN_REWARDS
from megarl.rollout.base import SamplingConfig, SamplingParams
from megarl.rollout.config import RolloutBackend, RolloutConfig


def resolve(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with megarl's decisions made (idempotent: resolving a resolved config changes nothing)."""
    cfg = decide_layout(cfg)  # first: what follows reads the layout
    a, d = cfg.algorithm, cfg.data
    rm, cm = cfg.reward_model, cfg.cost_model
    if rm is not None:
        rm = dataclasses.replace(rm, model=_model(rm.model), engine=_engine(rm.engine))
    if cm is not None:
        cm = dataclasses.replace(cm, model=_model(cm.model), engine=_engine(cm.engine))
    teacher = cfg.teacher
    if teacher is not None:
        teacher = dataclasses.replace(teacher, model=_model(teacher.model), engine=_engine(teacher.engine))
    functions = {name: dataclasses.replace(spec, function=_reward_spec(spec.function))
                 for name, spec in cfg.reward.functions.items()}
    reward = dataclasses.replace(cfg.reward, function=_reward_spec(cfg.reward.function), functions=functions)
    placement = cfg.cluster.role_pools(cfg.roles())
    return dataclasses.replace(
        cfg,
        rollout=dataclasses.replace(cfg.rollout, engine=_rollout_engine(cfg)),
        model=_model(cfg.model),
        data=dataclasses.replace(d, train=_path(d.train), val=d.val and _path(d.val),
                                 row_adapter=d.row_adapter and _file_spec(d.row_adapter)),
        reward=reward,
        trainer=dataclasses.replace(cfg.trainer, output_dir=_path(cfg.trainer.output_dir)),
        policy=_engine(cfg.policy),
        critic=_engine(cfg.critic),
        algorithm=dataclasses.replace(a, recompute_old_log_probs=(
            a.recomputes_old_log_probs or cfg.rollout.max_version_lag > 0)),  # stale samples: pi_old != pi_rollout
        reward_model=rm,
        cost_model=cm,
        teacher=teacher,
        cluster=dataclasses.replace(cfg.cluster, placement=placement),
    )


def _rollout_engine(cfg: TrainConfig) -> RolloutConfig:
    """``prefix_cache_mb: null`` decided: the embedded engine keeps finished rows' KV (1 GiB) only for
    conversations, whose next turn continues them; single-turn prompts never do, and vLLM has its own. For vLLM,
    ``gpu_memory_utilization: null`` by where the engines run and ``max_model_len: null`` from the budgets."""
    engine, r = cfg.rollout.engine, cfg.rollout
    if engine.prefix_cache_mb is None:
        keep = r.multi_turn.enabled and engine.backend is RolloutBackend.EMBEDDED
        engine = dataclasses.replace(engine, prefix_cache_mb=1024.0 if keep else 0.0)
    if engine.backend is not RolloutBackend.VLLM:
        return engine
    engine = dataclasses.replace(engine, gpu_memory_utilization=engine.memory_utilization(
        dedicated=cfg.cluster.rollout_apart))
    if engine.max_model_len is None and not r.multi_turn.enabled:  # a conversation's prompt is the environment's
        engine = dataclasses.replace(engine, max_model_len=cfg.data.max_prompt_length + r.max_new_tokens)
    return engine


def _path(path: str) -> str:
    """Absolute, relative to the driver's working directory (symbolic links kept)."""
    return os.path.abspath(os.path.expanduser(path))


def _reward_spec(function: str | None) -> str | None:
    """A reward function's spec with a file's path made absolute (a built-in key as it is)."""
    if function is not None and function not in BUILTIN_REWARDS and ":" in function:  # "path/to/file.py:name"
        return _file_spec(function)
    return function


def _file_spec(spec: str) -> str:
    """``path/to/file.py:name`` with the file's path made absolute."""
    path, sep, name = spec.rpartition(":")
    return f"{_path(path)}{sep}{name}"


def _model(model: ModelConfig) -> ModelConfig:
    path = _path(model.path)
    return dataclasses.replace(model, path=path, tokenizer=str(hf_files(_path(model.tokenizer or path))))


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
