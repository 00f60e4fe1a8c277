"""Plug-ins: advantage estimators, policy losses and dynamic sampling's group filters, built-in or a user's, through
one registry each.

A plug-in is a function marked by a decorator: :func:`advantage_estimator`, :func:`policy_loss` or
:func:`group_filter`. Given a name,
the decorator also registers it under that name (every built-in is registered this way, in
:mod:`megarl.algos.advantages` and :mod:`megarl.algos.losses`); without one, the function is found by path. A
config names a plug-in either way: ``algorithm.advantage.estimator: grpo`` or ``path/to/file.py:dr_grpo``,
``algorithm.policy_loss.loss: ppo_clip`` or ``path/to/file.py:my_loss``, ``algorithm.dynamic_sampling.criterion:
differing_rewards`` or ``path/to/file.py:my_filter`` (docs/programming.md §2).

The contracts (the built-ins' own):

* advantage estimator: ``fn(inputs: AdvantageInputs, config: AdvantageConfig) -> Advantages`` (or an
  ``(advantages, returns)`` pair), both ``[batch, response_len]`` floating tensors; positions outside
  ``inputs.mask`` are set to 0 whatever the function returns there. ``needs`` names the inputs beyond the token
  rewards and the mask it reads: ``values`` (a critic's: the run gets a critic), ``group_ids`` (the prompt of
  each response: a group-relative estimator, which dynamic sampling and ``n >= 2`` go with),
  ``baseline_rewards`` (the reward of the prompt's greedy response: the run samples one, as ReMax).
* policy loss: ``fn(log_prob, old_log_prob, advantages, mask, config: PolicyLossConfig, normalizer:
  LossNormalizer | None) -> PolicyLossOutput`` with a scalar differentiable ``loss``; aggregate the per-token
  loss with :func:`megarl.algos.aggregate_loss` (``config.aggregation``, ``normalizer``) so that micro-batches
  and data-parallel ranks add up to the global batch's loss.
* group filter (dynamic sampling's criterion): ``fn(scores, group_ids, num_groups) -> keep`` with ``scores``
  ``[rows]`` (each response's reward), ``group_ids`` ``[rows]`` (its prompt, ``0..num_groups-1``) and ``keep`` a
  ``[num_groups]`` bool tensor: the prompt groups worth training on.

:func:`check_plugins` calls the configured ones once on a tiny synthetic batch before any worker starts; a
wrong signature, type, shape or dtype is a :class:`~megarl.errors.ConfigError` (exit 2) naming the file, the
function, what was expected and what was found. Workers resolve a path again in their own process (the config
carries the spec string, not the function). Must not import: torch.distributed, megatron, Ray, vLLM.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from megarl.config.user_code import load_function
from megarl.errors import ConfigError

ESTIMATOR = "advantage estimator"
POLICY_LOSS = "policy loss"
GROUP_FILTER = "group filter"
REWARD_STAGE = "reward stage"
ROLLOUT_FUNCTION = "rollout function"
ESTIMATOR_INPUTS = ("values", "group_ids", "baseline_rewards")  # what ``needs`` may name
_SIGNATURES = {ESTIMATOR: "fn(inputs: AdvantageInputs, config: AdvantageConfig) -> Advantages",
               POLICY_LOSS: "fn(log_prob, old_log_prob, advantages, mask, config: PolicyLossConfig, "
                            "normalizer) -> PolicyLossOutput",
               GROUP_FILTER: "fn(scores, group_ids, num_groups) -> keep ([num_groups] bool)",
               REWARD_STAGE: "fn(inputs: RewardStageInputs) -> scores ([rows] float)",
               ROLLOUT_FUNCTION: "fn(requests: list[RolloutRequest], ctx: RolloutContext) -> list[RolloutSample]"}
_ARITY = {ESTIMATOR: 2, POLICY_LOSS: 6, GROUP_FILTER: 3, REWARD_STAGE: 1, ROLLOUT_FUNCTION: 2}
_DECORATORS = {ESTIMATOR: "advantage_estimator", POLICY_LOSS: "policy_loss", GROUP_FILTER: "group_filter",
               REWARD_STAGE: "reward_stage", ROLLOUT_FUNCTION: "rollout_function"}


@dataclasses.dataclass(frozen=True)
class Plugin:
    """A marked function and what the run must provide for it."""

    kind: str  # ESTIMATOR or POLICY_LOSS
    name: str  # its registered name, or the spec it was loaded from
    fn: Callable[..., Any]
    needs: frozenset[str] = frozenset()  # estimators: inputs beyond token_rewards and mask (ESTIMATOR_INPUTS)
    sequence_ratio: bool = False  # policy losses: the importance ratio is per sequence (GSPO); the KL loss follows
    dual_clip: bool = False  # policy losses: takes PolicyLossConfig.clip_ratio_c (PPO's dual-clip)

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


_REGISTRY: dict[str, dict[str, Plugin]] = {kind: {} for kind in _SIGNATURES}


@dataclasses.dataclass(frozen=True)
class RewardStageInputs:
    """What a reward stage sees of a round's responses (``rows`` of them): the reward so far and each earlier
    source's own scores, the texts, the dataset rows and the group structure."""

    scores: torch.Tensor  # [rows] the reward so far: the weighted sum of the sources and stages before this one
    sources: dict[str, torch.Tensor]  # each earlier source's own [rows] scores by name (function, model, cost, ...)
    prompts: list[str]  # each response's prompt text
    responses: list[str]  # each response's text (multi-turn: the model's last turn)
    rows: list[dict[str, Any]]  # each response's dataset row (its columns)
    group_ids: torch.Tensor  # [rows] the prompt of each response (0..groups-1 in this round)
    response_lengths: torch.Tensor  # [rows] the model's tokens
    finish_reasons: list[str]  # "stop" or "length" (cut at max_new_tokens)


def advantage_estimator(name: str | None = None, *, needs: Iterable[str] = ()) -> Callable[[Callable], Callable]:
    """Mark ``fn`` as an advantage estimator reading ``needs`` (module docstring); with ``name``, register it."""
    needs = frozenset(needs)
    if not needs <= set(ESTIMATOR_INPUTS):
        raise ConfigError(f"advantage_estimator(needs=...) takes {list(ESTIMATOR_INPUTS)}; found "
                          f"{sorted(needs - set(ESTIMATOR_INPUTS))}")
    return _marker(ESTIMATOR, name, needs=needs)


def policy_loss(name: str | None = None, *, sequence_ratio: bool = False,
                dual_clip: bool = False) -> Callable[[Callable], Callable]:
    """Mark ``fn`` as a policy loss (module docstring); with ``name``, register it. ``sequence_ratio``: its ratio is
    a sequence's (the KL loss then uses the sequence-level ratio too); ``dual_clip``: it reads ``clip_ratio_c``."""
    return _marker(POLICY_LOSS, name, sequence_ratio=sequence_ratio, dual_clip=dual_clip)


def group_filter(name: str | None = None) -> Callable[[Callable], Callable]:
    """Mark ``fn`` as a dynamic-sampling group filter (module docstring); with ``name``, register it."""
    return _marker(GROUP_FILTER, name)


def reward_stage(name: str | None = None) -> Callable[[Callable], Callable]:
    """Mark ``fn`` as a reward stage (module docstring); with ``name``, register it."""
    return _marker(REWARD_STAGE, name)


def rollout_function(name: str | None = None) -> Callable[[Callable], Callable]:
    """Mark ``fn`` as a rollout function (:mod:`megarl.multiturn.custom`); with ``name``, register it."""
    return _marker(ROLLOUT_FUNCTION, name)


def _marker(kind: str, name: str | None, **traits: Any) -> Callable[[Callable], Callable]:
    def mark(fn: Callable) -> Callable:
        plugin = Plugin(kind, name or getattr(fn, "__qualname__", repr(fn)), fn, **traits)
        fn.__megarl_plugin__ = plugin
        if name is not None:
            if name in _REGISTRY[kind] and _REGISTRY[kind][name].fn is not fn:
                raise ConfigError(f"{kind} {name!r} is registered already (by {_REGISTRY[kind][name].fn.__module__})")
            _REGISTRY[kind][name] = plugin
        return fn

    return mark


def registered(kind: str) -> list[str]:
    """The names registered for ``kind``."""
    return sorted(_REGISTRY[kind])


def is_spec(key: str) -> bool:
    """Whether ``key`` names a function by path (``file.py:function``) rather than a registered name."""
    return ":" in key


@functools.cache
def resolve(kind: str, key: str) -> Plugin:
    """The plug-in ``key`` names: a registered name, or ``path/to/file.py:function`` (imported once per process;
    a function without the decorator counts as one that needs nothing)."""
    if not is_spec(key):
        if key not in _REGISTRY[kind]:
            near = difflib.get_close_matches(key, registered(kind), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"unknown {kind} {key!r}{hint}; the registered ones: {registered(kind)}, or give a "
                              "function by path as 'path/to/file.py:function'")
        return _REGISTRY[kind][key]
    fn = load_function(key, kind, (None,) * _ARITY[kind], _SIGNATURES[kind])
    found = getattr(fn, "__megarl_plugin__", None)
    if found is not None and found.kind != kind:
        raise ConfigError(f"{kind} {key!r} is marked as a {found.kind} (@{_decorator(found.kind)}); expected "
                          f"@{_decorator(kind)}")
    return dataclasses.replace(found, name=key) if found is not None else Plugin(kind, key, fn)


def _decorator(kind: str) -> str:
    return _DECORATORS[kind]


# ------------------------------------------------------------------------------------------ checks


def check_plugins(estimator: str, loss: str, advantage_config: Any, loss_config: Any,
                  criterion: str | None = None, stages: Iterable[str] = ()) -> None:
    """Call the configured estimator, policy loss, group filter (``criterion``; None: no dynamic sampling) and reward
    stages once on a tiny synthetic batch (float32, 4 responses of 3 tokens to 2 prompts, the last token of one
    masked): a :class:`ConfigError` naming what was expected and found if one fails or returns the wrong thing; an
    unknown name, likewise. Built-ins are trusted (their tests check them)."""
    for stage in stages:
        found = resolve(REWARD_STAGE, stage)
        if is_spec(stage):
            _check_stage(found)
    found_estimator, found_loss = resolve(ESTIMATOR, estimator), resolve(POLICY_LOSS, loss)
    if is_spec(estimator):
        _check_estimator(found_estimator, advantage_config)
    if is_spec(loss):
        _check_loss(found_loss, loss_config)
    if criterion is not None and is_spec(criterion):
        _check_filter(resolve(GROUP_FILTER, criterion))
    elif criterion is not None:
        resolve(GROUP_FILTER, criterion)


def _synthetic() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(4, 3)
    mask[1, 2] = 0.0
    rewards = torch.zeros(4, 3)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 0.5, 0.0])
    return {"mask": mask, "rewards": rewards, "values": torch.rand(4, 3, generator=g),
            "group_ids": torch.tensor([0, 0, 1, 1]), "baseline": torch.tensor([0.5, 0.5, 0.0, 0.0]),
            "log_prob": -torch.rand(4, 3, generator=g) - 0.1, "old": -torch.rand(4, 3, generator=g) - 0.1,
            "advantages": torch.randn(4, 3, generator=g)}


def _check_estimator(plugin: Plugin, config: Any) -> None:
    from megarl.algos.advantages import AdvantageInputs, checked_advantages

    x = _synthetic()
    inputs = AdvantageInputs(x["rewards"], x["mask"], values=x["values"], group_ids=x["group_ids"],
                             baseline_rewards=x["baseline"])
    try:
        out = plugin(inputs, config)
    except Exception as e:  # noqa: BLE001 - the user's function raised: say so, with what it was given
        raise ConfigError(f"{ESTIMATOR} {plugin.name!r} raised {type(e).__name__}: {e} when called on a synthetic "
                          f"batch (4 responses x 3 tokens, float32); expected {_SIGNATURES[ESTIMATOR]}") from e
    checked_advantages(out, x["mask"], plugin.name)


def _check_loss(plugin: Plugin, config: Any) -> None:
    from megarl.algos.losses import PolicyLossOutput

    x = _synthetic()
    log_prob = x["log_prob"].clone().requires_grad_(True)
    try:
        out = plugin(log_prob, x["old"], x["advantages"], x["mask"], config, None)
    except Exception as e:  # noqa: BLE001 - the user's function raised
        raise ConfigError(f"{POLICY_LOSS} {plugin.name!r} raised {type(e).__name__}: {e} when called on a synthetic "
                          f"batch (4 responses x 3 tokens, float32); expected {_SIGNATURES[POLICY_LOSS]}") from e
    where = f"{POLICY_LOSS} {plugin.name!r}"
    if not isinstance(out, PolicyLossOutput):
        raise ConfigError(f"{where} returned {type(out).__name__}; expected a megarl.algos.PolicyLossOutput (loss, "
                          "clip_frac, dual_clip_frac, approx_kl_k1, approx_kl_k3)")
    if not isinstance(out.loss, torch.Tensor) or out.loss.dim() != 0 or not out.loss.is_floating_point():
        found = f"shape {tuple(out.loss.shape)}, {out.loss.dtype}" if isinstance(out.loss, torch.Tensor) else (
            type(out.loss).__name__)
        raise ConfigError(f"{where}: its loss must be a scalar floating tensor, found {found}; aggregate the "
                          "per-token loss with megarl.algos.aggregate_loss")
    if not out.loss.requires_grad:
        raise ConfigError(f"{where}: its loss does not depend on log_prob (no gradient would reach the policy); "
                          "expected a loss differentiable in log_prob")


def _check_filter(plugin: Plugin) -> None:
    scores, groups = torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([0, 0, 1, 1])
    try:
        keep = plugin(scores, groups, 2)
    except Exception as e:  # noqa: BLE001 - the user's function raised
        raise ConfigError(f"{GROUP_FILTER} {plugin.name!r} raised {type(e).__name__}: {e} when called on a synthetic "
                          f"batch (4 responses to 2 prompts); expected {_SIGNATURES[GROUP_FILTER]}") from e
    checked_keep(keep, 2, plugin.name)


def _check_stage(plugin: Plugin) -> None:
    inputs = RewardStageInputs(
        scores=torch.tensor([1.0, 0.0, 0.5, 0.0]), sources={"function": torch.tensor([1.0, 0.0, 0.5, 0.0])},
        prompts=["1+1=", "1+1=", "2+2=", "2+2="], responses=["2", "3", "4", "x"],
        rows=[{"answer": "2"}, {"answer": "2"}, {"answer": "4"}, {"answer": "4"}], group_ids=torch.tensor([0, 0, 1, 1]),
        response_lengths=torch.tensor([1, 1, 1, 3]), finish_reasons=["stop", "stop", "stop", "length"])
    try:
        out = plugin(inputs)
    except Exception as e:  # noqa: BLE001 - the user's function raised
        raise ConfigError(f"{REWARD_STAGE} {plugin.name!r} raised {type(e).__name__}: {e} when called on a synthetic "
                          f"round (4 responses to 2 prompts); expected {_SIGNATURES[REWARD_STAGE]}") from e
    checked_stage_scores(out, 4, plugin.name)


def checked_stage_scores(scores: Any, rows: int, name: str) -> torch.Tensor:
    """A reward stage's return, checked: a ``[rows]`` floating tensor of finite values, as float32."""
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point() or scores.shape != (rows,):
        found = f"shape {tuple(scores.shape)}, {scores.dtype}" if isinstance(scores, torch.Tensor) else (
            type(scores).__name__)
        raise ConfigError(f"{REWARD_STAGE} {name!r} must return a floating tensor of shape ({rows},) (one score per "
                          f"response, added to its reward), found {found}")
    if not torch.isfinite(scores).all():
        raise ConfigError(f"{REWARD_STAGE} {name!r} returned non-finite scores ({scores.tolist()[:8]}); expected "
                          "finite numbers")
    return scores.float()


def checked_keep(keep: Any, num_groups: int, name: str) -> torch.Tensor:
    """A group filter's return, checked: a ``[num_groups]`` bool tensor."""
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.shape != (num_groups,):
        found = f"shape {tuple(keep.shape)}, {keep.dtype}" if isinstance(keep, torch.Tensor) else type(keep).__name__
        raise ConfigError(f"{GROUP_FILTER} {name!r} must return a bool tensor of shape ({num_groups},) (one entry "
                          f"per prompt group: keep it or not), found {found}")
    return keep
