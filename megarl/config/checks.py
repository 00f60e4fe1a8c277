"""Everything checkable about a run's config before a worker starts (:func:`check_config`): the cluster and layout,
the program and its data, the algorithm's terms, the rollout, rewards and schedules. Each check raises
:class:`~megarl.errors.ConfigError` naming what to change; none rewrites the config. A refusal is only for a
combination that cannot mean anything, with that reason in its message. Pure module: no Ray, no process groups, no
megatron-core (the config tree itself is :mod:`megarl.config.train`).
"""

from __future__ import annotations

import math
from pathlib import Path

from megarl.algos.advantages import RewardScale, estimator
from megarl.algos.config import AlgorithmConfig
from megarl.algos.kl import KLEstimator
from megarl.algos.plugins import ROLLOUT_FUNCTION, check_plugins, is_spec, resolve
from megarl.config.auto import decide_layout
from megarl.config.train import (
    PROGRAM_SIGNATURE,
    PROGRAMS,
    RESERVED_REWARD_NAMES,
    BuiltinProgram,
    OnStale,
    RewardConfig,
    Role,
    Schedule,
    TrainConfig,
)
from megarl.config.user_code import load_function
from megarl.controller.spec import Launcher, PlacementConfig
from megarl.errors import ConfigError
from megarl.host import allocator
from megarl.parallel.layout import ParallelLayout
from megarl.resharding.plan import check_vllm_groups
from megarl.rollout.config import ROUTER_REPLAY_TP_REASON, LoRASync, RolloutBackend, vllm_lora_rank


def check_config(cfg: TrainConfig) -> None:
    """Everything checkable before workers start; raises ConfigError with what to change. Layout sizes set to
    ``auto`` are checked as :func:`megarl.config.resolve.resolve` will decide them (the planner's choice)."""
    if not cfg.model.path or not Path(cfg.model.path).is_dir():
        raise ConfigError(f"model.path {cfg.model.path!r} is not a directory; give an HF model directory or a "
                          "megarl checkpoint (tools/convert_hf_to_megatron.py writes one).")
    cfg = decide_layout(cfg)
    _check_cluster(cfg)
    layout = cfg.cluster.layout()
    if not cfg.data.train:
        raise ConfigError("data.train is empty; give a .jsonl or .parquet prompt file.")
    _check_program(cfg.trainer.program)
    d = cfg.data
    t = cfg.trainer
    if t.total_steps < 1 or t.save_every < 0 or t.val_every < 0 or t.keep_checkpoints < 1:
        raise ConfigError("trainer.total_steps and keep_checkpoints must be >= 1, save_every/val_every >= 0.")
    if t.max_restarts < 0 or t.restart_window_s <= 0:
        raise ConfigError(f"trainer.max_restarts must be >= 0 and restart_window_s > 0, found {t.max_restarts} and "
                          f"{t.restart_window_s}.")
    if t.val_every and not d.val:
        raise ConfigError(f"trainer.val_every={t.val_every} but data.val is not set; give a validation file or "
                          "set val_every=0.")
    program = cfg.builtin_program
    if program is not None and program.offline:
        _check_offline(cfg, program)
        return
    _check_rl(cfg, layout)
    if cfg.trainer.program == "online_dpo" and cfg.rollout.sampling.n < 2:
        raise ConfigError(f"trainer.program=online_dpo pairs each prompt's best response with its worst: set "
                          f"rollout.sampling.n >= 2 (TRL samples 2), found {cfg.rollout.sampling.n}.")


def _check_rl(cfg: TrainConfig, layout: ParallelLayout) -> None:
    """An RL program's: its algorithm, rollout, rewards."""
    d, r, a = cfg.data, cfg.rollout, cfg.algorithm
    # the plug-ins first: every later check reads what the estimator needs (a user's is called once here)
    check_plugins(a.advantage.estimator, a.policy_loss.loss, a.advantage, a.policy_loss,
                  a.dynamic_sampling.criterion if a.dynamic_sampling is not None else None, cfg.reward.stages.values())
    if d.batch_size % layout.dp:
        raise ConfigError(f"data.batch_size={d.batch_size} must be divisible by the data-parallel size {layout.dp} "
                          f"({layout}); change one of them.")
    rows = d.batch_size * r.sampling.n
    for role in (Role.POLICY, Role.CRITIC) if a.needs_critic else (Role.POLICY,):  # the roles that update
        dp = cfg.cluster.layout(role).dp
        if rows % (a.mini_batches * dp):
            raise ConfigError(f"batch_size*n = {rows} responses per step must split into algorithm.mini_batches="
                              f"{a.mini_batches} x dp={dp} ({role.value}'s pool {cfg.cluster.pool_name(role)!r}) "
                              "equal parts.")
    if "group_ids" in estimator(a.advantage).needs and r.sampling.n < 2:
        raise ConfigError(f"advantage estimator {a.advantage.estimator} compares responses to the same prompt; set "
                          "rollout.sampling.n >= 2.")
    _check_rollout(cfg, layout)
    if r.multi_turn.enabled:
        _check_multi_turn(cfg)
    if r.function is not None:
        if r.multi_turn.enabled:
            raise ConfigError("rollout.function and rollout.multi_turn.enabled both replace the generation loop (a "
                              "rollout function is a loop of its own; multi-turn is megarl's loop over an "
                              "environment): set one. A rollout function can run an environment or tools itself.")
        resolve(ROLLOUT_FUNCTION, r.function)  # its signature; called once when the tokenizer is loaded
    if a.ppo_epochs < 1 or a.mini_batches < 1:
        raise ConfigError("algorithm.ppo_epochs and mini_batches must be >= 1.")
    if a.recompute_old_log_probs is False and (why := a.old_log_probs_needed_because()):
        raise ConfigError(f"algorithm.recompute_old_log_probs=false, but the old log-probs are needed apart from the "
                          f"update's own forward ({why}). Set algorithm.recompute_old_log_probs=true or leave it "
                          "unset (auto), or take one optimizer step per batch without kl_penalty.")
    _check_reward(cfg)
    _check_dapo(cfg)
    _check_loss_terms(cfg.algorithm)


def _check_offline(cfg: TrainConfig, program: BuiltinProgram) -> None:
    """An offline program's: whole examples (pairs) per data-parallel shard; no section it would not use."""
    trained = program.roles[0]
    dp = cfg.cluster.layout(trained).dp
    if cfg.data.batch_size % dp:
        raise ConfigError(f"data.batch_size={cfg.data.batch_size} examples per step must split into dp={dp} equal "
                          f"shards ({trained.value}'s pool {cfg.cluster.pool_name(trained)!r}); change one of them.")
    unused = [name for name, section in (("reward_model", cfg.reward_model), ("cost_model", cfg.cost_model),
                                         ("teacher", cfg.teacher)) if section is not None]
    if unused:
        raise ConfigError(f"trainer.program={cfg.trainer.program} trains on data.train's own tokens; "
                          f"{', '.join(unused)} would score samples it never draws: remove "
                          f"{'it' if len(unused) == 1 else 'them'} (a reward model trained by the reward_model "
                          "program is used by an RL run's reward_model.model.path).")


def _check_program(program: str) -> None:
    """A built-in program's name, or a function by path that takes one argument (the run)."""
    if is_spec(program):
        load_function(program, "program", (None,), PROGRAM_SIGNATURE)
    elif program not in PROGRAMS:
        raise ConfigError(f"trainer.program={program!r} is neither a built-in program ({', '.join(PROGRAMS)}) nor "
                          f"a function by path ('path/to/file.py:step', {PROGRAM_SIGNATURE}).")


def _check_loss_terms(a: AlgorithmConfig) -> None:
    """The TRL-style options (docs/trl.md) only where they change something."""
    if a.kl_loss_bias_correction and not a.kl_loss_coef > 0:
        raise ConfigError(f"algorithm.kl_loss_bias_correction=true weights the KL loss term, but kl_loss_coef="
                          f"{a.kl_loss_coef} adds none; set kl_loss_coef > 0 (TRL's beta, e.g. 0.001) or "
                          "kl_loss_bias_correction=false.")
    if not a.kl_clamp:
        if a.kl_estimator is not KLEstimator.K3:
            raise ConfigError(f"algorithm.kl_clamp=false unclamps the low_var_kl estimator only, found kl_estimator="
                              f"{a.kl_estimator.value}; set kl_estimator=low_var_kl or leave kl_clamp true.")
        if not a.needs_reference:
            raise ConfigError("algorithm.kl_clamp=false, but the run has no KL term (kl_loss_coef=0, kl_penalty "
                              "unset); set kl_loss_coef > 0 or leave kl_clamp true.")
    if not 0.0 <= a.top_entropy_quantile <= 1.0:
        raise ConfigError(f"algorithm.top_entropy_quantile must lie in [0, 1] (the share of highest-entropy tokens "
                          f"trained on; 1 = all, the paper's 0.2), found {a.top_entropy_quantile}.")
    adv = a.advantage
    if adv.scale_rewards is not RewardScale.GROUP and adv.estimator != "grpo" and not is_spec(adv.estimator):
        raise ConfigError(f"algorithm.advantage.scale_rewards={adv.scale_rewards.value} scales GRPO's advantages, "
                          f"but the estimator is {adv.estimator}; use estimator=grpo or remove scale_rewards.")


def _check_dapo(cfg: TrainConfig) -> None:
    a, r = cfg.algorithm, cfg.reward
    if a.dynamic_sampling is not None and "group_ids" not in estimator(a.advantage).needs:
        raise ConfigError(f"algorithm.dynamic_sampling keeps prompt groups whose rewards differ, which matters to "
                          f"group-relative estimators (grpo, rloo, or a plug-in declaring needs=('group_ids',)); "
                          f"found {a.advantage.estimator}. Unset it or use one of those.")
    if r.overlong_buffer and not cfg.rollout.multi_turn.enabled and not (  # multi-turn: _check_multi_turn
            0 < r.overlong_buffer <= cfg.rollout.max_new_tokens):
        raise ConfigError(f"reward.overlong_buffer={r.overlong_buffer} must lie in (0, rollout.max_new_tokens="
                          f"{cfg.rollout.max_new_tokens}] (or 0: off).")
    if r.overlong_buffer < 0 or r.overlong_penalty_factor < 0:
        raise ConfigError(f"reward.overlong_buffer and overlong_penalty_factor must be >= 0, found {r.overlong_buffer} "
                          f"and {r.overlong_penalty_factor}.")


def _check_cluster(cfg: TrainConfig) -> None:
    c = cfg.cluster
    allocator.resolve(c.allocator)
    needed = {r.value for r in cfg.roles()}
    valid = {r.value for r in Role}
    for role, pool in c.placement.items():
        if role not in valid:
            raise ConfigError(f"cluster.placement: unknown role {role!r}; roles: {sorted(valid)}.")
        if pool not in c.pools:
            raise ConfigError(f"cluster.placement.{role}: pool {pool!r} is not in cluster.pools ({sorted(c.pools)}).")
        if role not in needed:
            raise ConfigError(f"cluster.placement.{role}: this run has no {role} (its roles: {sorted(needed)}); "
                              "remove the entry.")
    # the run's placement as the controller will build it: pools that host no role, layouts that do not fit
    PlacementConfig(c.pools, c.role_pools(cfg.roles()))
    if c.launcher is Launcher.LOCAL and (len(c.pools) != 1 or c.layout().world_size != 1):
        raise ConfigError(f"cluster.launcher=local runs one rank in the driver process, but the pools are "
                          f"{ {name: p.world_size for name, p in c.pools.items()} } (devices each); keep one pool "
                          "with nodes = devices_per_node = 1 (tp=pp=1) or use cluster.launcher=ray.")
    if c.rollout_apart:
        _check_rollout_pool(cfg)
    _check_context_parallel(cfg)
    t = c.timeouts
    if t.init_s <= 0 or t.collective_s <= 0 or (t.call_s is not None and t.call_s <= 0):
        raise ConfigError(f"cluster.timeouts must be > 0 seconds (call_s may be null: no limit), found {c.timeouts}.")


def _check_context_parallel(cfg: TrainConfig) -> None:
    """Context parallelism splits packed sequences (megarl/engine/packing.py): every model on a pool with cp > 1
    packs its micro-batches. (A rollout pool's cp: :func:`_check_rollout_pool`.)"""
    sections = {Role.POLICY: ("policy", cfg.policy), Role.REFERENCE: ("policy", cfg.policy),
                Role.CRITIC: ("critic", cfg.critic),
                Role.REWARD_MODEL: ("reward_model.engine", cfg.reward_model and cfg.reward_model.engine),
                Role.COST_MODEL: ("cost_model.engine", cfg.cost_model and cfg.cost_model.engine),
                Role.TEACHER: ("teacher.engine", cfg.teacher and cfg.teacher.engine)}
    for role in cfg.roles():
        name, engine = sections.get(role, (None, None))
        cp = cfg.cluster.pool(role).cp
        if cp > 1 and engine is not None and not engine.packing:
            pool = cfg.cluster.pool_name(role)
            raise ConfigError(f"cluster.pools.{pool}.cp={cp} splits every sequence of the {role.value}'s passes over "
                              f"{cp} ranks, which works on packed micro-batches, but {name}.packing is false: set "
                              f"{name}.packing: true (the default) or cluster.pools.{pool}.cp: 1.")


def _check_multi_turn(cfg: TrainConfig) -> None:
    """Multi-turn rollouts combine with every schedule and algorithm feature (docs/multiturn.md); the overlong
    penalty's ramp lies within the conversation's budget, and conversations are rendered with the chat template."""
    r, buffer = cfg.rollout, cfg.reward.overlong_buffer
    if buffer and not 0 < buffer <= r.multi_turn.max_total_tokens:
        raise ConfigError(f"reward.overlong_buffer={buffer} must lie in (0, rollout.multi_turn.max_total_tokens="
                          f"{r.multi_turn.max_total_tokens}] (or 0: off): with multi-turn rollouts the penalty ramps "
                          "over a conversation's tokens after the prompt up to that budget.")
    if not cfg.data.apply_chat_template:
        raise ConfigError("rollout.multi_turn renders conversations with the chat template: data.apply_chat_template "
                          "must be true (it is false).")


def _check_rollout_pool(cfg: TrainConfig) -> None:
    c, engine = cfg.cluster, cfg.rollout.engine
    name, pool = c.pool_name(Role.ROLLOUT), c.pool(Role.ROLLOUT)
    others = sorted(r.value for r in cfg.roles() if r is not Role.ROLLOUT and c.pool_name(r) == name)
    if others:
        raise ConfigError(f"pool {name!r} hosts the rollout engines and {others}: a rollout pool hosts only the "
                          "rollout engines. Place those roles on another pool.")
    if pool.pp != 1 or pool.tp != engine.tp:
        raise ConfigError(f"the rollout pool {name!r} must have tp = rollout.engine.tp = {engine.tp} and pp = 1 "
                          f"(one rollout replica per data-parallel rank); found tp={pool.tp}, pp={pool.pp}.")
    if pool.cp != 1:
        raise ConfigError(f"cluster.pools.{name}.cp={pool.cp}, but {name!r} is the rollout pool: context parallelism "
                          "splits the sequences of a training pass over ranks holding the same weights, and a rollout "
                          f"pool trains nothing (each of its ranks generates as a rollout replica). Remove cp from "
                          f"cluster.pools.{name} (set it on the policy's pool, {c.pool_name(Role.POLICY)!r}, to train "
                          "with context parallelism).")


def _check_overlapped(cfg: TrainConfig) -> None:
    """The schedules that generate while the policy trains (one_step_off, async)."""
    r, name = cfg.rollout, f"rollout.schedule={cfg.rollout.schedule.value}"
    if not cfg.cluster.rollout_apart:
        raise ConfigError(f"{name} generates while the policy trains, so the rollout engines need a pool of their "
                          "own: add one to cluster.pools and set cluster.placement.rollout to it (or use "
                          "rollout.schedule=sync).")
    if cfg.algorithm.recompute_old_log_probs is False:
        raise ConfigError(f"{name} trains on samples older than the trained weights: the PPO ratio needs old "
                          "log-probs recomputed at the trained weights. Leave algorithm.recompute_old_log_probs "
                          "unset (auto) or set it true.")
    a = r.asynchronous
    if r.schedule is Schedule.ASYNC:
        if a.max_staleness < 0 or a.push_every < 1 or a.buffer_batches < 1:
            raise ConfigError(f"rollout.asynchronous needs max_staleness >= 0, push_every >= 1 and buffer_batches >= "
                              f"1; found {a.max_staleness}, {a.push_every}, {a.buffer_batches}.")
        if a.on_stale is OnStale.WAIT and a.push_every > a.max_staleness + 1:
            raise ConfigError(f"rollout.asynchronous.push_every={a.push_every} with on_stale=wait and max_staleness="
                              f"{a.max_staleness}: generation would wait for weights that come only after samples "
                              f"it has not made yet. Use push_every <= max_staleness + 1 = {a.max_staleness + 1}, or "
                              "on_stale=drop.")
        if a.partial_chunk_tokens is not None and a.partial_chunk_tokens < 1:
            raise ConfigError(f"rollout.asynchronous.partial_chunk_tokens must be >= 1 or null (whole responses); "
                              f"found {a.partial_chunk_tokens}.")


def _check_rollout(cfg: TrainConfig, layout: ParallelLayout) -> None:
    r = cfg.rollout
    if r.max_new_tokens < 1:
        raise ConfigError(f"rollout.max_new_tokens must be >= 1, found {r.max_new_tokens}.")
    if r.engine.backend is RolloutBackend.EMBEDDED and r.engine.tp != 1:
        raise ConfigError(f"the embedded rollout engine runs one full model per rank: rollout.engine.tp must be 1, "
                          f"found {r.engine.tp}; use rollout.engine.backend=vllm for tensor-parallel generation.")
    if r.engine.prefix_cache_mb is not None and r.engine.prefix_cache_mb < 0:
        raise ConfigError(f"rollout.engine.prefix_cache_mb must be >= 0 (0: off) or null, found "
                          f"{r.engine.prefix_cache_mb}.")
    if r.engine.backend is RolloutBackend.VLLM:
        if r.engine.prefix_cache_mb:
            raise ConfigError(f"rollout.engine.prefix_cache_mb={r.engine.prefix_cache_mb} is the embedded engine's; "
                              "vLLM keeps its prefix cache inside its KV cache (rollout.engine.kv_cache_mb / "
                              "gpu_memory_utilization). Unset it.")
        if not cfg.cluster.rollout_apart:  # (a rollout pool's layout is its rollout TP groups: checked above)
            check_vllm_groups(layout, r.engine.tp)
        for name, s in (("sampling", r.sampling), ("validation", r.validation)):
            if s.temperature > 2:  # vLLM's own limit (VLLMValidationError at the first call otherwise)
                raise ConfigError(f"rollout.{name}.temperature={s.temperature}: vLLM accepts at most 2.")
        if cfg.policy.router_replay and r.engine.tp > 1:
            raise ConfigError(ROUTER_REPLAY_TP_REASON.format(tp=r.engine.tp))
        util = r.engine.gpu_memory_utilization
        if util is not None and not 0 < util <= 1:
            raise ConfigError(f"rollout.engine.gpu_memory_utilization must be in (0, 1] or null, found {util}.")
    if r.engine.lora_sync is LoRASync.ADAPTER:
        _check_adapter_sync(cfg)
    if r.schedule is not Schedule.SYNC:
        _check_overlapped(cfg)
    if r.sampling.temperature == 0:
        raise ConfigError("rollout.sampling.temperature=0 (greedy) gives no exploration to learn from; use > 0 for "
                          "training (rollout.validation.temperature may be 0).")


def _check_adapter_sync(cfg: TrainConfig) -> None:
    """``rollout.engine.lora_sync=adapter``: a LoRA policy's adapter, loaded into vLLM's LoRA support. (Expert
    adapters of an MoE model are refused once its config.json is read: megarl.trainer.checks.)"""
    engine, lora = cfg.rollout.engine, cfg.policy.lora
    if lora is None:
        raise ConfigError("rollout.engine.lora_sync=adapter syncs a LoRA policy's adapter alone, but policy.lora is "
                          "not set (the whole policy trains, so every weight changes): set policy.lora (e.g. "
                          "policy.lora.rank=8) or leave rollout.engine.lora_sync=merged.")
    if engine.backend is not RolloutBackend.VLLM:
        raise ConfigError(f"rollout.engine.lora_sync=adapter loads the adapter into vLLM's LoRA support; the "
                          f"{engine.backend.value} engine has none (it takes the merged weights): set "
                          "rollout.engine.backend=vllm or rollout.engine.lora_sync=merged.")
    vllm_lora_rank(lora.rank)  # within vLLM's largest max_lora_rank


def _check_reward(cfg: TrainConfig) -> None:
    """At least one reward source, finite weights, an existing reward-model directory. (That it is a
    reward model sharing the policy's tokenizer is checked once the tokenizers load, before any worker
    starts: :func:`megarl.trainer.checks.check_frozen_models`.)"""
    rw, rm = cfg.reward, cfg.reward_model
    if not rw.named_functions() and rm is None and cfg.teacher is None and not cfg.rollout.multi_turn.enabled:
        raise ConfigError("no reward source: set reward.function (a built-in key or 'file.py:function'), "
                          "reward_model.model.path (a sequence-classification reward model) and/or teacher.model.path "
                          "(on-policy distillation).")
    t = cfg.teacher
    if t is not None and (not t.model.path or not Path(t.model.path).is_dir()):
        raise ConfigError(f"teacher.model.path {t.model.path!r} is not a directory; give an HF causal LM directory or "
                          "a megarl checkpoint (e.g. a run's checkpoints/step_N/policy).")
    if t is not None and not (math.isfinite(t.kl_coef) and t.kl_coef > 0):
        raise ConfigError(f"teacher.kl_coef must be a positive number, found {t.kl_coef}.")
    cm = cfg.cost_model
    for name, weight in (("reward.function_weight", rw.function_weight),
                         ("reward_model.weight", rm.weight if rm is not None else 0.0),
                         ("cost_model.weight", cm.weight if cm is not None else 0.0)):
        if not math.isfinite(weight):
            raise ConfigError(f"{name} must be a finite number, found {weight}.")
    _check_reward_functions(rw)
    for section, model in (("reward_model", rm), ("cost_model", cm)):
        if model is not None and (not model.model.path or not Path(model.model.path).is_dir()):
            raise ConfigError(f"{section}.model.path {model.model.path!r} is not a directory; give an HF "
                              "*ForSequenceClassification directory (num_labels=1) or a megarl checkpoint of one.")


def _check_reward_functions(rw: RewardConfig) -> None:
    """``reward.functions``: instead of ``reward.function``, each entry named, with a function and a finite weight."""
    if rw.functions and rw.function is not None:
        raise ConfigError(f"reward.functions names {sorted(rw.functions)} and reward.function is {rw.function!r} "
                          "(its default unless set): the list replaces the single function. Set reward.function: "
                          "null and list every reward function under reward.functions (e.g. functions.correct."
                          "function=integer_answer), or remove reward.functions.")
    for name in rw.stages:
        if not name.isidentifier() or name in RESERVED_REWARD_NAMES or name in rw.functions:
            raise ConfigError(f"reward.stages.{name}: a reward stage's name must be an identifier (letters, digits, _) "
                              f"other than {list(RESERVED_REWARD_NAMES)} and the reward functions' names "
                              f"{sorted(rw.functions)} (the other reward sources' metric names); rename it.")
    for name, spec in rw.functions.items():
        if not name.isidentifier() or name in RESERVED_REWARD_NAMES:
            raise ConfigError(f"reward.functions.{name}: a reward function's name must be an identifier (letters, "
                              f"digits, _) other than {list(RESERVED_REWARD_NAMES)} (the other reward sources' "
                              "metric names); rename it.")
        if spec.function is None:
            raise ConfigError(f"reward.functions.{name}.function is null; give a built-in key or "
                              "'path/to/file.py:function', or remove the entry.")
        if not math.isfinite(spec.function_weight):
            raise ConfigError(f"reward.functions.{name}.function_weight must be a finite number, found "
                              f"{spec.function_weight}.")
