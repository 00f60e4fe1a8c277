"""The config tree as a whole: each default defined once, the generated reference current, every
example's resolved config equal to its golden file, and what resolution decides.

Regenerate the golden files after an intended change with ``MEGARL_UPDATE_GOLDEN=1 pytest
tests/unit/test_config_schema.py`` (then read the diff), and the reference with
``python -m megarl.config.reference > docs/config.md``.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import typing
from pathlib import Path

import pytest
import yaml

from megarl.config.checks import check_config
from megarl.config.reference import render
from megarl.config.resolve import resolve
from megarl.config.train import RewardModelSection, TeacherSection, TrainConfig, load_config, to_plain
from megarl.controller.spec import GroupOptions
from megarl.engine.config import EngineConfig
from megarl.errors import ConfigError
from megarl.rollout.base import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p.parent.name for p in (ROOT / "examples").glob("*/config.yaml"))
GOLDEN = ROOT / "tests" / "golden"

# Field names that carry a default in more than one class, each naming different things.
DISTINCT = {
    "seed": "trainer.seed (the run's sampling, data order and workers), EngineConfig.seed (initialising weights a "
            "checkpoint lacks), SamplingParams.seed (one generation call; null: fresh), GroupOptions.seed (a worker "
            "group's processes; the trainer passes trainer.seed)",
    "tp": "a pool's training tensor-parallel size vs the rollout engine's",
    "stop_token_ids": "rollout.stop_token_ids (the user's extra ids) vs one call's full list (eos added)",
    "weight": "reward_model.weight (1: the reward model's score is the reward) vs cost_model.weight (0: the cost "
              "is kept apart, for a program's constraint), the one field the cost model's section overrides",
    "function": "reward.function (a reward function: a built-in key or a file's function) vs rollout.function (a "
                "rollout function by path, null: none)",
    "beta": "offline.dpo.beta vs offline.kto.beta: each objective's own regularisation strength (TRL's DPOConfig and "
            "KTOConfig each default it to 0.1)",
}


def _config_classes() -> list[type]:
    """Every dataclass of the YAML tree, plus the per-call and per-group configs built from it."""
    seen: list[type] = []
    stack: list[type] = [TrainConfig, SamplingParams, GroupOptions]
    while stack:
        cls = stack.pop()
        if cls in seen:
            continue
        seen.append(cls)
        for tp in typing.get_type_hints(cls).values():
            parts = [tp, *typing.get_args(tp)]
            parts += [a for p in parts for a in typing.get_args(p)]
            stack += [p for p in parts if dataclasses.is_dataclass(p)]
    return seen


def _own_defaults(cls: type) -> dict[str, object]:
    """Defaults of the fields ``cls`` declares itself (not inherited), except nested sections left at
    their own class's defaults (composition: the default lives in the nested class)."""
    own = cls.__dict__.get("__annotations__", {})
    out = {}
    for f in dataclasses.fields(cls):
        if f.name not in own or not f.init:  # no config key (a frozen engine's optim / lora): no default to set
            continue
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            continue
        if dataclasses.is_dataclass(value) and value == type(value)():
            continue
        out[f.name] = value
    return out


def test_every_default_is_defined_once():
    where = collections.defaultdict(list)
    for cls in _config_classes():
        for name in _own_defaults(cls):
            where[name].append(cls.__name__)
    repeated = {name: owners for name, owners in where.items() if len(owners) > 1}
    assert set(repeated) == set(DISTINCT), (
        f"fields with a default in several config classes: {repeated}. A default lives in one place: nest or "
        "extend the component's config instead of copying its field (or, for a different concept that shares "
        "a name, explain it in DISTINCT).")


def test_the_check_sees_a_mirrored_default():
    """The walk above catches a copy: a section repeating a component's field with its default."""

    @dataclasses.dataclass(frozen=True)
    class Mirror:
        top_p: float = 1.0

    assert "top_p" in _own_defaults(Mirror) and "top_p" in _own_defaults(SamplingParams.__mro__[1])


def test_frozen_roles_take_every_engine_key_but_optim_and_lora():
    """reward_model.engine and teacher.engine: the training engine's keys less its optimizer's and adapters'
    (nothing trains them), with the same defaults; the reference lists no optim or lora section for them."""
    def keys(cls: type) -> set[str]:
        return {f.name for f in dataclasses.fields(cls) if f.init}

    hints = {cls: typing.get_type_hints(cls)["engine"] for cls in (RewardModelSection, TeacherSection)}
    for engine in hints.values():
        assert keys(engine) == keys(EngineConfig) - {"optim", "lora"}
        assert {k: getattr(engine(), k) for k in keys(engine)} == {k: getattr(EngineConfig(), k) for k in keys(engine)}
    text = (ROOT / "docs" / "config.md").read_text()
    assert "## `policy.optim`" in text and "## `critic.optim`" in text
    assert "## `reward_model.engine.optim`" not in text and "## `teacher.engine.optim`" not in text
    assert "## `policy.lora`" in text and "## `reward_model.engine.lora`" not in text


def test_config_reference_is_current():
    assert (ROOT / "docs" / "config.md").read_text() == render(), (
        "docs/config.md is stale: run `python -m megarl.config.reference > docs/config.md`")


def _relative(value, prefix: str):
    """The config with the driver's working directory cut from its (absolute, resolved) paths."""
    if isinstance(value, dict):
        return {k: _relative(v, prefix) for k, v in value.items()}
    return value.removeprefix(prefix) if isinstance(value, str) else value


@pytest.mark.parametrize("name", EXAMPLES)
def test_resolved_example_config_matches_golden(name, tmp_path, monkeypatch):
    # resolved from an empty directory: what the examples' relative paths point at (a `make demo` run's
    # outputs, which the distillation example's teacher is) must not change the result
    monkeypatch.chdir(tmp_path)
    resolved = _relative(to_plain(resolve(load_config(ROOT / "examples" / name / "config.yaml"))), os.getcwd() + os.sep)
    golden = GOLDEN / f"{name}.yaml"
    if os.environ.get("MEGARL_UPDATE_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(yaml.safe_dump(resolved, sort_keys=False))
    assert golden.is_file(), f"{golden} is missing: MEGARL_UPDATE_GOLDEN=1 pytest {__file__}"
    assert resolved == yaml.safe_load(golden.read_text()), (
        f"the resolved config of examples/{name} changed; if intended: MEGARL_UPDATE_GOLDEN=1 pytest {__file__}")


def test_resolution_decides_and_is_idempotent():
    cfg = load_config(ROOT / "examples" / "grpo_addition_tiny" / "config.yaml")
    once = resolve(cfg)
    assert resolve(once) == once
    a = once.algorithm  # two mini-batches per batch: the update's forward cannot stand in for the old log-probs
    assert cfg.algorithm.recompute_old_log_probs is None and a.recompute_old_log_probs is True
    one_step = resolve(load_config(ROOT / "examples" / "grpo_addition_tiny" / "config.yaml",
                                   ["algorithm.mini_batches=1", "data.batch_size=16"]))
    assert one_step.algorithm.recompute_old_log_probs is False
    assert once.cluster.placement == {"policy": "main", "rollout": "main", "reference": "main"}  # KL loss: a reference
    # forward passes: the training micro-batch's token budget, 4x its rows (megarl.engine.config.FORWARD_ROWS)
    fwd = once.policy.forward_micro_batch
    assert (fwd.max_tokens, fwd.max_size) == (8192, 4 * 64)
    # every path absolute, from the driver's working directory (workers may run elsewhere)
    paths = (once.model.path, once.model.tokenizer, once.data.train, once.data.val, once.trainer.output_dir)
    assert paths == tuple(os.path.join(os.getcwd(), p) for p in (cfg.model.path, cfg.model.path, cfg.data.train,
                                                                  cfg.data.val, cfg.trainer.output_dir))
    custom = resolve(load_config(ROOT / "examples" / "grpo_addition_tiny" / "config.yaml",
                                 ["reward.function=rewards/mine.py:score", "data.row_adapter=rows.py:adapt"]))
    assert custom.reward.function == os.path.join(os.getcwd(), "rewards/mine.py") + ":score"
    assert custom.data.row_adapter == os.path.join(os.getcwd(), "rows.py") + ":adapt"
    assert once.reward.function == "integer_answer"  # a built-in key is not a path


@pytest.mark.parametrize("override, match", [
    ("rollout.validation.n=0", "SamplingConfig.n must be an integer >= 1"),
    ("rollout.validation.temperature=-1", "SamplingConfig.temperature must be >= 0"),
    ("rollout.validation.top_p=0", r"SamplingConfig.top_p must be in \(0, 1\]"),
    ("rollout.sampling.temperature=0", "greedy"),
    ("rollout.engine.backend=vllm rollout.validation.temperature=2.5", "vLLM accepts at most 2"),
    ("cluster.placement.critic=main", "this run has no critic"),
    ("cluster.placement.policy=gpus", "pool 'gpus' is not in cluster.pools"),
    ("cluster.pools.second.tp=1", r"pools \['second'\] host no role"),
    ("cluster.pools.ref.devices_per_node=3 cluster.pools.ref.tp=2 cluster.placement.reference=ref",
     r"world size 3 is not divisible by tp\*pp\*cp = 2\*1\*1"),
    ("cluster.pools.main.cp=3", r"world size 2 is not divisible by tp\*pp\*cp = 2\*1\*3"),
    ("cluster.pools.main.tp=1 cluster.pools.main.cp=2 policy.packing=false",
     r"cluster.pools.main.cp=2 splits .* policy's passes .* set policy.packing: true \(the default\)"),
    ("cluster.pools.gen.devices_per_node=2 cluster.pools.gen.cp=2 cluster.placement.rollout=gen",
     r"cluster.pools.gen.cp=2, but 'gen' is the rollout pool: .* on the policy's pool, 'main'"),
    ("cluster.launcher=local cluster.pools.main.devices_per_node=1 cluster.pools.main.tp=1 "
     "cluster.pools.ref.devices_per_node=1 cluster.placement.reference=ref", "keep one pool"),
    ("algorithm.advantage.estimator=gae cluster.pools.c.devices_per_node=3 cluster.placement.critic=c "
     "data.batch_size=2 rollout.sampling.n=1 algorithm.mini_batches=1", r"dp=3 \(critic's pool 'c'\)"),
    ("cluster.timeouts.call_s=0", "cluster.timeouts must be > 0"),
    ("rollout.schedule=one_step_off", "need a pool of their own"),
    ("cluster.pools.gen.devices_per_node=2 cluster.placement.rollout=gen rollout.schedule=one_step_off "
     "algorithm.recompute_old_log_probs=false", "old log-probs recomputed"),
    ("cluster.pools.gen.devices_per_node=2 cluster.placement.rollout=gen cluster.placement.reference=gen",
     r"hosts the rollout engines and \['reference'\]"),
    ("cluster.pools.gen.devices_per_node=2 cluster.placement.rollout=gen rollout.engine.backend=vllm "
     "rollout.engine.tp=2", "tp = rollout.engine.tp = 2 and pp = 1"),
    ("cluster.pools.gen.devices_per_node=2 cluster.pools.gen.tp=2 cluster.placement.rollout=gen",
     "tp = rollout.engine.tp = 1 and pp = 1"),
    ("cluster.pools.gen.devices_per_node=2 cluster.placement.rollout=gen rollout.schedule=async "
     "rollout.asynchronous.push_every=3", r"push_every <= max_staleness \+ 1 = 2"),
    ("cluster.pools.gen.devices_per_node=2 cluster.placement.rollout=gen rollout.schedule=async "
     "rollout.asynchronous.partial_chunk_tokens=0", "partial_chunk_tokens must be >= 1"),
    ("rollout.engine.backend=vllm rollout.engine.lora_sync=adapter", "policy.lora is not set"),
    ("policy.lora.rank=4 rollout.engine.lora_sync=adapter", "the embedded engine has none"),
    ("policy.lora.rank=1024 rollout.engine.backend=vllm rollout.engine.lora_sync=adapter",
     "exceeds vLLM's largest max_lora_rank 512"),
])
def test_check_config_covers_sampling_and_cluster(tmp_path, override, match):
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1="}\n')
    base = [f"model.path={tmp_path}", f"data.train={tmp_path / 'train.jsonl'}"]
    with pytest.raises(ConfigError, match=match):
        check_config(load_config(ROOT / "examples" / "grpo_addition_tiny" / "config.yaml",
                                 [*base, *override.split()]))


@pytest.mark.parametrize("override, layout", [
    ("cluster.pools.main.tp=1 cluster.pools.main.cp=2", "TP1xCP2xPP1xDP1"),
    ("cluster.pools.main.devices_per_node=8 cluster.pools.main.cp=2", "TP2xCP2xPP1xDP2"),
    # vLLM's consecutive TP groups over one replica's CP ranks; LoRA with adapter-only sync
    ("cluster.pools.main.tp=1 cluster.pools.main.cp=2 rollout.engine.backend=vllm rollout.engine.tp=2 "
     "policy.lora.rank=4 rollout.engine.lora_sync=adapter", "TP1xCP2xPP1xDP1"),
    # experts over tp x cp x dp = 4 ranks; a critic on a pool of its own, at CP2 too
    ("cluster.pools.main.devices_per_node=4 cluster.pools.main.tp=1 cluster.pools.main.cp=2 cluster.pools.main.ep=4 "
     "algorithm.advantage.estimator=gae cluster.pools.c.devices_per_node=2 cluster.pools.c.cp=2 "
     "cluster.placement.critic=c", "TP1xCP2xPP1xDP2xEP4"),
    # the rollout engines on a pool of their own, fed by a CP2 x PP2 policy, one step off; the reference apart
    ("cluster.pools.main.devices_per_node=4 cluster.pools.main.tp=1 cluster.pools.main.pp=2 cluster.pools.main.cp=2 "
     "cluster.pools.gen.devices_per_node=2 cluster.placement.rollout=gen rollout.schedule=one_step_off "
     "cluster.pools.ref.devices_per_node=2 cluster.pools.ref.tp=2 cluster.placement.reference=ref",
     "TP1xCP2xPP2xDP1"),
])
def test_context_parallelism_composes(tmp_path, override, layout):
    """``cluster.pools.NAME.cp`` with every engine, LoRA, MoE, split placement and schedule: the check passes and
    the pool's layout has dp = devices / (tp x pp x cp)."""
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1="}\n')
    base = [f"model.path={tmp_path}", f"data.train={tmp_path / 'train.jsonl'}"]
    cfg = load_config(ROOT / "examples" / "grpo_addition_tiny" / "config.yaml", [*base, *override.split()])
    check_config(cfg)
    assert str(cfg.cluster.layout()) == layout


def test_adapter_sync_refuses_an_moe_models_expert_adapters():
    """vLLM 0.32 cannot load megarl's fused expert adapters; attention adapters and dense models are fine (the check
    runs once the model's config.json is read: megarl.trainer.checks)."""
    from megarl.rollout.config import check_adapter_targets

    with pytest.raises(ConfigError, match=r"targets \['qkv', 'fc1'\] on the Mixture-of-Experts model m: .*fused"):
        check_adapter_targets(True, ["qkv", "fc1"], "m")
    check_adapter_targets(True, ["qkv", "proj"], "m")
    check_adapter_targets(False, ["qkv", "fc1", "fc2"], "m")
