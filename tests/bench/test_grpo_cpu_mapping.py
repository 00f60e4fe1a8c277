"""benchmarks/grpo_cpu.py's megarl -> TRL GRPOConfig mapping and grpo_parity.py's pure helpers (issue #26).

The expected TRL arguments are written out by hand from the example config (examples/grpo_addition_tiny) and
the benchmark's overrides, not derived from the code under test. No timing, no TRL import.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from megarl.config.resolve import resolve
from megarl.config.train import load_config

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # grpo_parity imports grpo_cpu as a sibling
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return sys.modules[name]


grpo_cpu = _load("grpo_cpu")
grpo_parity = _load("grpo_parity")


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Path:
    from megarl.testing.addition import make_task

    return make_task(tmp_path_factory.mktemp("task"))


def _cfg(task: Path, case, *extra: str):
    overrides = [*grpo_cpu.megarl_overrides(task, case, task / "out"), *extra]
    return resolve(load_config(grpo_cpu.EXAMPLE, overrides))


@pytest.mark.parametrize("name", ["tiny", "30m"])
def test_trl_args_by_hand(task, name):
    case = grpo_cpu.CASES[name]
    args = grpo_cpu.trl_args(_cfg(task, case), case)
    seq = 4 + case.max_new_tokens  # "a+b=" + the response
    micro = min(64, 8192 // seq)  # policy.micro_batch defaults: 64 rows, 8192 tokens
    want = {
        # the example: 16 prompts x 16, lr 2e-3, clip 1.0, KL 0.001, entropy 0.01, seed 1
        "num_generations": 16, "per_device_train_batch_size": micro, "gradient_accumulation_steps": 256 // micro,
        "steps_per_generation": 256 // micro, "num_iterations": 1, "learning_rate": 2e-3, "max_grad_norm": 1.0,
        "beta": 0.001, "entropy_coef": 0.01, "seed": 1, "max_completion_length": case.max_new_tokens,
        "max_steps": case.warmup + case.steps, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
        "epsilon": 0.2, "epsilon_high": 0.2, "loss_type": "dapo", "scale_rewards": "group",
        "weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8,
        # TRL_BEHAVIOUR: megarl computes TRL's bias-corrected KL
        "use_bias_correction_kl": True, "top_entropy_quantile": 1.0, "mask_truncated_completions": False,
    }
    assert {k: args[k] for k in want} == want
    if case.stop_at_eos:
        assert "generation_kwargs" not in args
    else:  # megarl samples eos and goes on: TRL must not stop at it (nor suppress it)
        assert args["generation_kwargs"] == {"eos_token_id": []}


def test_trl_behaviour_is_what_trl_computes(task):
    a = _cfg(task, grpo_cpu.CASES["tiny"]).algorithm
    assert a.kl_loss_bias_correction is True and a.kl_clamp is False
    assert a.advantage.eps == 1e-4  # TRL's `std_rewards + 1e-4`
    assert not a.rollout_correction.active  # TRL weights only vLLM's samples


@pytest.mark.parametrize("extra, named", [
    ("algorithm.kl_clamp=true", "kl_clamp"),
    ("algorithm.advantage.eps=1e-6", "advantage.eps"),
    ("algorithm.rollout_correction.truncate=token", "rollout_correction"),
    ("algorithm.mini_batches=2", "mini_batches"),
    ("rollout.sampling.min_p=0.1", "min_p"),
])
def test_trl_args_refuses_what_trl_cannot_do(task, extra, named):
    case = grpo_cpu.CASES["tiny"]
    with pytest.raises(SystemExit, match=named):
        grpo_cpu.trl_args(_cfg(task, case, extra), case)


def test_kl_bias_correction_maps_both_ways(task):
    case = grpo_cpu.CASES["tiny"]
    args = grpo_cpu.trl_args(_cfg(task, case, "algorithm.kl_loss_bias_correction=false"), case)
    assert args["use_bias_correction_kl"] is False


def test_remaining_differences_name_eos_only_without_stop():
    tiny, big = (grpo_cpu.remaining_differences(grpo_cpu.CASES[n]) for n in ("tiny", "30m"))
    assert not any(d.startswith("Eos") for d in tiny)
    assert any(d.startswith("Eos") for d in big)
    assert all(any(d.startswith(k) for d in tiny) for k in ("Samples", "Entropy", "Arithmetic"))


def test_permutation_p_by_hand():
    # x = [3, 4], y = [1, 2]: of the 6 splits of {1, 2, 3, 4} into pairs, |mean difference| >= 2 only for
    # {3, 4} | {1, 2} and {1, 2} | {3, 4}: p = 2/6
    assert grpo_parity.permutation_p([3.0, 4.0], [1.0, 2.0]) == pytest.approx(2 / 6)
    assert grpo_parity.permutation_p([1.0, 2.0], [1.0, 2.0]) == 1.0
    # every split but the observed one and its mirror moves an x below a y: the difference shrinks by >= 0.02
    assert grpo_parity.permutation_p([0.5, 0.6, 0.7, 0.8, 0.9], [0.1, 0.2, 0.3, 0.4, 0.45]) == pytest.approx(2 / 252)


def test_weight_diff_by_hand():
    start = {"w": torch.zeros(2), "b": torch.ones(1)}
    theirs = {"w": torch.tensor([3.0, 4.0]), "b": torch.tensor([1.0])}  # update |(3, 4)| = 5, b unchanged
    ours = {"w": torch.tensor([3.0, 4.3]), "b": torch.tensor([1.0]), "extra": torch.ones(1)}
    d = grpo_parity.weight_diff(ours, theirs, start)
    assert d["params"]["w"]["max_abs"] == pytest.approx(0.3)
    assert d["params"]["w"]["rel"] == pytest.approx(0.3 / 5)
    assert d["params"]["w"]["rel_update"] == pytest.approx(0.3 / 5)
    assert d["params"]["b"]["rel_update"] == 0.0  # equal and not updated
    assert d["rel"] == pytest.approx(0.3 / (25 + 1) ** 0.5)
    assert d["rel_update"] == pytest.approx(0.3 / 5)
    assert "extra" not in d["params"]


def test_replay_rows_group_by_prompt():
    # rows [prompt | response | pad]; prompts 1 and 0 interleaved: TRL needs each prompt's responses together
    batch = {"input_ids": torch.tensor([[5, 6, 7, 0], [8, 9, 1, 0], [5, 6, 2, 3], [8, 9, 4, 1]]),
             "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]]),
             "response_mask": torch.tensor([[0, 0, 1, 0], [0, 0, 1, 0], [0, 0, 1, 1], [0, 0, 1, 1]]),
             "prompt_uid": torch.tensor([1, 0, 1, 0])}
    assert grpo_parity.replay_rows(batch) == [([8, 9], [1], 1), ([8, 9], [4, 1], 3), ([5, 6], [7], 0),
                                              ([5, 6], [2, 3], 2)]
