"""Trainer configuration: loading, overrides, and bad input rejected before any worker starts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megarl.config.checks import check_config
from megarl.config.train import TrainConfig, dump_config, load_config
from megarl.engine.config import EngineConfig
from megarl.errors import ConfigError, LayoutError
from megarl.trainer.callbacks import STAGES, Callback

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "grpo_addition_tiny" / "config.yaml"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from megarl.testing.addition import make_task

    return make_task(tmp_path_factory.mktemp("addition"), train_rows=64, val_rows=8)


def _overrides(task, **extra):
    base = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl"}
    return [f"{k}={v}" for k, v in (base | extra).items()]


def test_example_config_loads_with_overrides(task):
    cfg = load_config(EXAMPLE, _overrides(task, **{"policy.optim.lr": "1e-4", "rollout.sampling.n": "4"}))
    assert cfg.policy.optim.lr == 1e-4 and cfg.rollout.sampling.n == 4  # "1e-4" parsed as a float, not a string
    assert cfg.algorithm.advantage.estimator == "grpo" and cfg.cluster.pool().tp == 2
    check_config(cfg)


def test_resolved_config_round_trips(task, tmp_path):
    cfg = load_config(EXAMPLE, _overrides(task))
    dump_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


@pytest.mark.parametrize("override, error, match", [
    ("policy.optim.lrr=1", ConfigError, "did you mean 'lr'"),
    ("rollout.sampling.temprature=1", ConfigError, "did you mean 'temperature'"),
    ("rollout.n=4", ConfigError, "unknown config key 'rollout.n'"),
    ("algorithm.advantage.estimator=ppo", ConfigError, "unknown advantage estimator .ppo."),
    ("cluster.pools.main.tp=3", LayoutError, "not divisible by tp"),
    ("cluster.pools.main.tp=1 data.batch_size=3", ConfigError, "divisible by the data-parallel size 2"),
    ("rollout.sampling.n=1", ConfigError, "rollout.sampling.n >= 2"),
    ("rollout.engine.tp=2", ConfigError, "rollout.engine.tp must be 1"),
    ("rollout.engine.backend=vllm cluster.pools.main.tp=2 rollout.engine.tp=4", ConfigError,
     "positive divisor of the world size 2"),
    ("model.path=/nonexistent/model", ConfigError, "is not a directory"),
    ("trainer.val_every=5", None, None),  # valid: data.val is set
    # the example takes 2 mini-batches per batch: no update's forward can stand in for the old log-probs
    ("algorithm.recompute_old_log_probs=false", ConfigError, "mini_batches=2 optimizer steps per batch"),
    ("algorithm.recompute_old_log_probs=false algorithm.mini_batches=1 algorithm.kl_penalty.coef=0.1",
     ConfigError, "kl_penalty subtracts"),
    ("algorithm.recompute_old_log_probs=false algorithm.mini_batches=1", None, None),
    ("oops", ConfigError, "key.path=value"),
    ("cluster.launcher=threads", ConfigError, r"'threads' is not one of \['ray', 'local'\]"),
    ("cluster.allocator=mimalloc", ConfigError,
     r"'mimalloc' is not one of \['auto', 'system', 'tcmalloc', 'jemalloc'\]"),
    ("cluster.allocator=system", None, None),
    ("policy.optim.optimizer=sgd", ConfigError, "distributed optimizer supports Adam only"),
    ("policy.optim.optimizer=sgd policy.optim.use_distributed_optimizer=false", None, None),
    ("cluster.launcher=local", ConfigError, r"the pools are {'main': 2} \(devices each\)"),  # the example has 2 devices
    ("cluster.launcher=local cluster.pools.main.devices_per_node=1 cluster.pools.main.tp=1", None, None),
    ("rollout.engine.prefix_cache_mb=-1", ConfigError, "prefix_cache_mb must be >= 0"),
    ("algorithm.advantage.norm_by_std=false", ConfigError,
     "'algorithm.advantage.norm_by_std' was replaced: write scale_rewards: group for norm_by_std: true"),
    ("rollout.engine.backend=vllm rollout.engine.prefix_cache_mb=64", ConfigError,
     "prefix_cache_mb=64.0 is the embedded engine's"),
])
def test_bad_config_is_named(task, override, error, match):
    overrides = [*_overrides(task), *override.split()]
    if error is None:
        check_config(load_config(EXAMPLE, overrides))
        return
    with pytest.raises(error, match=match):
        check_config(load_config(EXAMPLE, overrides))


def test_a_config_file_that_is_not_a_mapping_is_named(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- model\n- data\n")
    with pytest.raises(ConfigError, match=r"list.yaml: expected a mapping of sections .*found list \['model'"):
        load_config(path, ["trainer.total_steps=1"])


@pytest.mark.slow
def test_cli_rejects_bad_input_before_starting_workers(task, tmp_path):
    """Unknown key, invalid layout, missing dataset column, missing model dir, unknown allocator, an advantage
    estimator plug-in that returns the wrong thing, ``megarl run`` with a step program of the wrong signature: exit 2
    with
    one paragraph, no traceback, no Ray, no conversion output. The command re-executes itself with Ray's
    jemalloc preloaded before it imports torch (Python's import log: torch once, the CLI twice)."""
    bad_rows = tmp_path / "bad.jsonl"
    bad_rows.write_text('{"question": "1+1=", "answer": "2"}\n')
    (tmp_path / "algo.py").write_text("def estimate(inputs, config):\n    return inputs.token_rewards\n")
    (tmp_path / "program.py").write_text("def step(run, batch):\n    return {}\n")
    train, run_program = ["-m", "megarl.train"], ["-m", "megarl.cli.main", "run", str(tmp_path / "program.py")]
    cases = [
        (["policy.optim.lrr=1"], "did you mean 'lr'"),
        (["cluster.pools.main.tp=3"], "not divisible by tp"),
        ([f"data.train={bad_rows}"], "prompt"),
        (["model.path=/nonexistent/model"], "is not a directory"),
        (["cluster.allocator=mimalloc"], "expected one of auto, system, tcmalloc, jemalloc, found 'mimalloc'"),
        ([f"algorithm.advantage.estimator={tmp_path / 'algo.py'}:estimate"],  # a plug-in (#43): called once here
         f"advantage estimator '{tmp_path / 'algo.py'}:estimate' returned Tensor; expected Advantages"),
        ([], f"program '{tmp_path / 'program.py'}:step' has signature (run, batch), which cannot be called as "
             "step(run: megarl.program.Run)", run_program),  # megarl run with a step program of the wrong shape
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("MEGARL_ALLOCATOR", "LD_PRELOAD")} | {"RAY_ADDRESS": ""}
    for i, (extra, match, *command) in enumerate(cases):
        out = tmp_path / f"run{i}"
        proc = subprocess.run(
            [sys.executable, *(command[0] if command else train), str(EXAMPLE), *_overrides(task),
             f"trainer.output_dir={out}",
             *extra], capture_output=True, text=True, env=env | {"PYTHONPROFILEIMPORTTIME": str(int(i == 0))},
            cwd=ROOT, timeout=120)
        assert proc.returncode == 2, proc.stderr
        if i == 0:
            imported = re.findall(r"^import time:.*\|\s*([\w.]+)$", proc.stderr, re.M)
            assert imported.count("megarl.cli.main") == 2 and imported.count("torch") == 1
            assert imported.index("torch") > imported.index("megarl.cli.main", imported.index("megarl.cli.main") + 1)
        assert match in proc.stderr and "Traceback" not in proc.stderr
        assert "Ray" not in proc.stderr  # no cluster was started
        assert not (out / "initial_checkpoint").exists()  # (a wall-clock bound here failed under CI load)


def test_callbacks_are_a_protocol():
    class Recorder:
        def __init__(self):
            self.events = []

        def on_stage_end(self, stage, step, batch):
            self.events.append((stage, step))

        def on_step_end(self, step, metrics):
            self.events.append(("end", step))

    class Incomplete:
        def on_step_end(self, step, metrics):
            pass

    assert isinstance(Recorder(), Callback)
    assert not isinstance(Incomplete(), Callback)
    assert STAGES == ("rollout", "baseline", "reward", "advantages", "step", "validation")


def test_defaults_live_in_the_dataclasses():
    cfg = TrainConfig()
    plain = yaml.safe_load(yaml.safe_dump({"trainer": {"total_steps": 3}}))
    assert load_config(None, [f"trainer.total_steps={plain['trainer']['total_steps']}"]).trainer.total_steps == 3
    assert cfg.rollout.sampling.n == 4 and cfg.trainer.resume is True


@pytest.mark.parametrize("extra, recomputes", [
    ({}, True),  # the example: 2 mini-batches
    ({"algorithm.mini_batches": 1}, False),  # one optimizer step per batch, KL only as a loss term
    ({"algorithm.mini_batches": 1, "algorithm.ppo_epochs": 2}, True),
    ({"algorithm.mini_batches": 1, "algorithm.kl_penalty.coef": 0.1}, True),  # KL in the reward
    ({"algorithm.mini_batches": 1, "algorithm.recompute_old_log_probs": "true"}, True),  # asked for
])
def test_old_log_probs_recomputed_only_where_needed(task, extra, recomputes):
    cfg = load_config(EXAMPLE, _overrides(task, **extra))
    check_config(cfg)
    assert cfg.algorithm.recompute_old_log_probs in (None, True)  # auto stays auto: validation rewrites nothing
    assert cfg.algorithm.recomputes_old_log_probs is recomputes


# ------------------------------------------------------------------------------------- reward sources


def _reward_model_dir(out, *, vocab_size=None, tokenizer="addition", architecture="Qwen2ForSequenceClassification"):
    """A reward model's config.json and tokenizer (no weights: nothing here loads them)."""
    from transformers import Qwen2Config

    from megarl.testing import addition, tiny

    tok = addition.make_tokenizer(out) if tokenizer == "addition" else tiny.make_tokenizer(out)
    Qwen2Config(vocab_size=vocab_size or len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0,
                architectures=[architecture]).save_pretrained(str(out))
    return out


@pytest.mark.parametrize("override, match", [
    ("reward_model.model.path=/nonexistent/rm", "reward_model.model.path '/nonexistent/rm' is not a directory"),
    ("reward.function=null", "no reward source"),
    ("reward.function_weight=.nan", "reward.function_weight must be a finite number"),
])
def test_bad_reward_config_is_named(task, override, match):
    with pytest.raises(ConfigError, match=match):
        check_config(load_config(EXAMPLE, [*_overrides(task), override]))


def test_reward_model_alone_is_a_reward_source(task, tmp_path):
    rm = _reward_model_dir(tmp_path / "rm")
    cfg = load_config(EXAMPLE, [*_overrides(task), "reward.function=null", f"reward_model.model.path={rm}",
                                "reward_model.weight=0.5", "reward_model.engine.forward_micro_batch.max_tokens=256"])
    check_config(cfg)
    assert cfg.reward.function is None and cfg.reward_model.weight == 0.5
    assert cfg.reward_model.engine.forward_batching.max_tokens == 256  # a reward model only runs forward
    assert TrainConfig().reward_model is None and TrainConfig().reward.function_weight == 1.0


@pytest.mark.parametrize("role", ["reward_model", "teacher"])
def test_frozen_roles_take_no_optim_settings(tmp_path, role):
    """A reward model and a teacher are never trained: their engine has no optim keys (the policy's 14 would
    be 28 keys doing nothing); a config setting any is told so, naming each key it set, in a file as on the
    command line, and the resolved config written beside a run has none."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{role}.engine.optim.lr=1e-5", f"{role}.engine.optim.clip_grad=0"])
    assert str(e.value) == (f"config keys '{role}.engine.optim.lr', '{role}.engine.optim.clip_grad': frozen roles "
                            "are not trained: optim settings do nothing; remove them.")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({role: {"engine": {"optim": {"optimizer": "sgd"}}}}))
    with pytest.raises(ConfigError, match=rf"config key '{role}.engine.optim.optimizer': frozen roles are not "
                                          "trained: optim settings do nothing; remove them"):
        load_config(tmp_path / "run.yaml")
    cfg = load_config(None, [f"{role}.engine.precision=bfloat16", f"{role}.engine.forward_micro_batch.max_size=8"])
    engine = getattr(cfg, role).engine
    assert engine.precision.value == "bfloat16" and engine.forward_batching.max_size == 8
    # trainable roles keep theirs; the frozen engine is still an EngineConfig, as the roles take it
    assert load_config(None, ["policy.optim.lr=1e-5", "critic.optim.lr=1e-5"]).critic.optim.lr == 1e-5
    assert isinstance(engine, EngineConfig)
    dump_config(cfg, tmp_path / "config.yaml")
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert "optim" not in written[role]["engine"] and "optim" in written["policy"]
    assert load_config(tmp_path / "config.yaml") == cfg


@pytest.mark.parametrize("kind, match", [
    ("other_tokenizer", "reward_model's tokenizer .* re-tokenizing responses is not supported"),
    ("fewer_ids", "the reward_model embeds 10 token ids, the policy .* emits up to 15"),
    ("causal_lm", r"holds a \['Qwen2ForCausalLM'\] model; the reward_model needs an HF \*ForSeq"),
])
def test_reward_model_must_share_the_policys_tokens(task, tmp_path, kind, match):
    """Refused by the trainer after loading the tokenizers, before any output, conversion or worker."""
    from megarl.trainer.trainer import Trainer

    rm = tmp_path / "rm"
    if kind == "other_tokenizer":  # a byte-level BPE vocabulary: same size class, other ids
        _reward_model_dir(rm, tokenizer="bpe", vocab_size=300)
    elif kind == "fewer_ids":
        _reward_model_dir(rm, vocab_size=10)
    else:
        _reward_model_dir(rm, architecture="Qwen2ForCausalLM")
    out = tmp_path / "out"
    cfg = load_config(EXAMPLE, [*_overrides(task), f"reward_model.model.path={rm}", f"trainer.output_dir={out}"])
    check_config(cfg)  # the paths are fine; the tokens are not
    with pytest.raises(ConfigError, match=match):
        Trainer(cfg)
    assert not out.exists()


def test_teacher_must_be_a_causal_lm_reading_the_policys_tokens(task, tmp_path):
    """The same checks for the distillation teacher: a reward model (scalar head) is refused."""
    from megarl.trainer.trainer import Trainer

    teacher = tmp_path / "teacher"
    _reward_model_dir(teacher)
    out = tmp_path / "out"
    cfg = load_config(EXAMPLE, [*_overrides(task), f"teacher.model.path={teacher}", f"trainer.output_dir={out}"])
    check_config(cfg)
    assert [r.value for r in cfg.roles()][-1] == "teacher"
    with pytest.raises(ConfigError, match=r"the teacher needs an HF \*ForCausalLM checkpoint"):
        Trainer(cfg)
    assert not out.exists()


@pytest.mark.parametrize("estimator", ["remax", "grpo"])
def test_remax_runs_a_greedy_baseline(task, estimator):
    cfg = load_config(EXAMPLE, [*_overrides(task), f"algorithm.advantage.estimator={estimator}"])
    check_config(cfg)  # ReMax is accepted now
    assert cfg.algorithm.needs_greedy_baseline is (estimator == "remax")


# ------------------------------------------------------------------------------------- TRL options (docs/trl.md)


@pytest.mark.parametrize("overrides, match", [
    (["algorithm.kl_loss_coef=0", "algorithm.kl_loss_bias_correction=true"],
     r"kl_loss_bias_correction=true weights the KL loss term, but kl_loss_coef=0.0 adds none; set kl_loss_coef > 0"),
    (["algorithm.kl_clamp=false", "algorithm.kl_estimator=kl"],
     "kl_clamp=false unclamps the low_var_kl estimator only, found kl_estimator=kl"),
    (["algorithm.kl_clamp=false", "algorithm.kl_loss_coef=0"], "kl_clamp=false, but the run has no KL term"),
    (["algorithm.top_entropy_quantile=1.5"], r"top_entropy_quantile must lie in \[0, 1\].*found 1.5"),
    (["algorithm.top_entropy_quantile=-0.1"], r"top_entropy_quantile must lie in \[0, 1\]"),
    (["algorithm.advantage.estimator=rloo", "algorithm.advantage.scale_rewards=batch"],
     "scale_rewards=batch scales GRPO's advantages, but the estimator is rloo"),
    (["algorithm.advantage.scale_rewards=std"], r"'std' is not one of \['group', 'batch', 'none'\]"),
])
def test_bad_trl_option_is_named(task, overrides, match):
    with pytest.raises(ConfigError, match=match):
        check_config(load_config(EXAMPLE, [*_overrides(task), *overrides]))


def test_trl_options_accepted(task):
    cfg = load_config(EXAMPLE, [*_overrides(task), "algorithm.kl_loss_bias_correction=true", "algorithm.kl_clamp=false",
                                "algorithm.top_entropy_quantile=0.2", "algorithm.advantage.scale_rewards=batch",
                                "algorithm.advantage.eps=1e-4"])
    check_config(cfg)
    a = cfg.algorithm
    assert a.kl_loss_bias_correction and not a.kl_clamp and a.top_entropy_quantile == 0.2
    assert a.advantage.scale_rewards.value == "batch" and a.advantage.eps == 1e-4
    default = TrainConfig().algorithm  # megarl's defaults, not TRL's (docs/trl.md says which differ)
    assert (default.kl_clamp, default.kl_loss_bias_correction, default.top_entropy_quantile) == (True, False, 1.0)


def test_a_lora_policy_is_its_own_reference_unless_one_is_placed(task):
    """policy.lora: no reference role (the base model, adapters off, is the reference); a reference placed on a pool
    of its own is built there (a frozen base copy), and the run passes its checks."""
    lora = {"policy.lora.rank": 4, "cluster.pools.main.devices_per_node": 1, "cluster.pools.main.tp": 1}
    own = load_config(EXAMPLE, _overrides(task, **lora))
    check_config(own)
    assert [r.value for r in own.roles()] == ["policy", "rollout"]
    placed = load_config(EXAMPLE, _overrides(task, **lora, **{"cluster.pools.ref.devices_per_node": 1,
                                                               "cluster.placement.reference": "ref"}))
    check_config(placed)
    assert [r.value for r in placed.roles()] == ["policy", "rollout", "reference"]
