"""Step programs on the public API (issue #43, docs/programming.md §3), on the GRPO demo's task with the local
launcher (policy, reference and critic in one rank of the driver process).

References: the built-in step (``megarl train``) for the user's PPO and GRPO listings (examples/programs/
ppo_family.py): every metric of every step equal, bit for bit; for rejection sampling (examples/programs/
rejection_sampling.py), each prompt's best response picked by hand from the step's scores and the supervised loss
of the kept tokens computed in float64 from the rollout's log-probs (the update's forward is at the sampling
weights); its learning (+0.2 reward within 100 steps) against the first steps' rewards; a program's ``run.state``
across a checkpoint and a resume against the count of steps run.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.dist]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "grpo_addition_tiny" / "config.yaml"
PROGRAMS = ROOT / "examples" / "programs"
NOT_COMPARED = ("timing/", "throughput/", "memory/", "reshard/")  # reshard: the slowest rank's, by time


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from megarl.testing.addition import make_task

    return make_task(tmp_path_factory.mktemp("task"), train_rows=64, val_rows=8)


def _run(task, out, program=None, config=EXAMPLE, callbacks=(), **extra):
    from megarl.program import load_config, train

    overrides = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
                 "trainer.output_dir": out, "trainer.tensorboard": "false", "trainer.total_steps": 3,
                 "trainer.save_every": 0, "trainer.val_every": 0, "cluster.launcher": "local",
                 "cluster.pools.main.devices_per_node": 1, "cluster.pools.main.tp": 1, "data.batch_size": 8,
                 "rollout.sampling.n": 8} | extra
    return train(load_config(config, [f"{k}={v}" for k, v in overrides.items()]), program, callbacks)


def _compared(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith(NOT_COMPARED) and k != "time"}


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_user_listings_reproduce_the_built_in_step(task, tmp_path, algorithm):
    extra = {} if algorithm == "grpo" else {"algorithm.advantage.estimator": "gae", "algorithm.kl_loss_coef": 0,
                                            "critic.optim.lr": "5e-3"}
    builtin = _run(task, tmp_path / "builtin", **extra)
    listing = _run(task, tmp_path / "listing", f"{PROGRAMS / 'ppo_family.py'}:{algorithm}", **extra)
    assert len(builtin) == len(listing) == 3
    assert ("critic/vf_loss" in builtin[0]) == (algorithm == "ppo") and ("actor/kl" in builtin[0]) == (
        algorithm == "grpo")
    for a, b in zip(builtin, listing, strict=True):
        assert _compared(a) == _compared(b)
    assert f"program: {PROGRAMS / 'ppo_family.py'}:{algorithm}" in (tmp_path / "listing" / "config.yaml").read_text()


class _Rows:
    """The rows of each step at ``stage`` (``step``: after the program's masking, as trained; ``reward``: as the reward
    stage scored them), the tensors ``keys`` cloned."""

    def __init__(self, stage: str, *keys: str) -> None:
        self.stage, self.keys = stage, keys
        self.rows: dict[int, dict[str, torch.Tensor]] = {}

    def on_stage_end(self, stage, step, batch):
        if stage == self.stage:
            self.rows[step] = {k: batch[k].clone() for k in self.keys}

    def on_step_end(self, step, metrics):
        pass


TRAINED = ("scores", "prompt_uid", "response_mask", "rollout_log_probs", "rollout_versions", "attention_mask")


def _check_kept(rows, metrics):
    """The rows the program kept (``response_mask`` left on) are each prompt's first best response, when right."""
    scores, uid, kept = rows["scores"].double(), rows["prompt_uid"], rows["response_mask"].sum(-1) > 0
    for g in uid.unique().tolist():
        members = (uid == g).nonzero().flatten()
        best = members[scores[members].argmax()]
        expected = members == best if scores[best] > 0.5 else torch.zeros(len(members), dtype=torch.bool)
        assert torch.equal(kept[members], expected)
    assert metrics["rft/kept_frac"] == pytest.approx(float(kept.sum()) / len(uid.unique()))
    return kept


def test_rejection_sampling_learns_with_a_supervised_loss(task, tmp_path):
    steps = _Rows("step", *TRAINED)
    history = _run(task, tmp_path / "rft", config=PROGRAMS / "rejection_sampling.yaml", callbacks=(steps,),
                   **{"trainer.program": f"{PROGRAMS / 'rejection_sampling.py'}:step",
                      "algorithm.policy_loss.loss": f"{PROGRAMS / 'rejection_sampling.py'}:supervised",
                      "trainer.total_steps": 100, "data.batch_size": 16, "rollout.sampling.n": 16})
    rewards = [m["reward/mean"] for m in history]
    start, end = statistics.mean(rewards[:10]), statistics.mean(rewards[-20:])
    print(f"rejection sampling reward: first 10 steps {start:.3f}, last 20 steps {end:.3f}")
    assert end > start + 0.2
    for step in (1, 2, 50, 100):
        rows, m = steps.rows[step], history[step - 1]
        kept = _check_kept(rows, m)
        if kept.any():  # the negative log-likelihood of the kept tokens, token-mean (one update at pi_old)
            mask = rows["response_mask"].double()
            nll = -(rows["rollout_log_probs"].double() * mask).sum() / mask.sum()
            assert m["actor/pg_loss"] == pytest.approx(nll.item(), abs=1e-4)


def test_rejection_sampling_runs_asynchronously_with_a_rollout_function(ray_cluster, task, tmp_path):
    """The rejection-sampling program unchanged on a rollout pool of its own, asynchronous (staleness bound 2), its
    responses from a rollout function (examples/plugins/rollout.py: a draft, a separator, an answer; two generation
    calls, between which a push may land): each step's rows within the schedule's version lag, each model token's
    version between its row's and the trained one and the answer's no older than the draft's, the kept rows by hand.
    (One step off: the Safe-RLHF run below.)"""
    steps = _Rows("step", *TRAINED)
    history = _run(task, tmp_path / "async", config=PROGRAMS / "rejection_sampling.yaml", callbacks=(steps,), **{
        "trainer.program": f"{PROGRAMS / 'rejection_sampling.py'}:step",
        "algorithm.policy_loss.loss": f"{PROGRAMS / 'rejection_sampling.py'}:supervised", "trainer.total_steps": 6,
        "rollout.function": f"{ROOT / 'examples' / 'plugins' / 'rollout.py'}:draft_then_answer",
        "cluster.launcher": "ray", "cluster.pools.gen.devices_per_node": 1, "cluster.placement.rollout": "gen",
        "rollout.schedule": "async", "rollout.asynchronous.max_staleness": 2})
    assert len(history) == 6
    for step, m in enumerate(history, start=1):
        assert 0 <= m["async/version_lag_min"] <= m["async/version_lag_max"] <= 2
        rows = steps.rows[step]
        kept = _check_kept(rows, m)
        for i in range(len(kept)):
            attention = rows["attention_mask"][i].bool()
            versions = rows["rollout_versions"][i][attention][-3:].tolist()  # draft, separator (0), answer
            assert step - 3 <= versions[0] <= versions[2] <= step - 1 and versions[1] == 0
            if kept[i]:
                assert rows["response_mask"][i][attention][-3:].tolist() == [1, 0, 1]
    assert max(m["async/version_lag_max"] for m in history) >= 1  # the rows were generated ahead


SAFE = ROOT / "examples" / "safe_rlhf_tiny"


@pytest.fixture(scope="module")
def safe_task(tmp_path_factory):
    import importlib.util

    spec = importlib.util.spec_from_file_location("safe_rlhf_task", SAFE / "task.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, module.make_task(tmp_path_factory.mktemp("safe_task"))


def _safe_run(safe_task, out, callbacks, **extra):
    _, task = safe_task
    overrides = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
                 "reward_model.model.path": task / "reward_model", "cost_model.model.path": task / "cost_model",
                 "trainer.output_dir": out, "trainer.tensorboard": "false", "trainer.save_every": 0,
                 "trainer.program": f"{SAFE / 'program.py'}:step"} | extra
    from megarl.program import load_config, train

    return train(load_config(SAFE / "config.yaml", [f"{k}={v}" for k, v in overrides.items()]), callbacks=callbacks)


def _check_classifier_scores(module, rows, tokenizer):
    """The reward and cost models' score of each row: the task's tables at the row's last token."""
    last = rows["input_ids"].gather(1, rows["attention_mask"].long().sum(-1, keepdim=True) - 1).flatten()
    tokens = tokenizer.convert_ids_to_tokens(last.tolist())
    want_reward = torch.tensor([module.reward_of(t) for t in tokens])
    want_cost = torch.tensor([module.cost_of(t) for t in tokens])
    assert torch.allclose(rows["model_scores"], want_reward, atol=1e-4)
    assert torch.allclose(rows["cost_scores"], want_cost, atol=1e-4)


def test_safe_rlhf_holds_the_cost_to_its_limit_while_the_reward_rises(safe_task, tmp_path):
    """Local launcher (policy, reward and cost models in one rank): 100 steps. The multiplier follows dual ascent
    recomputed from the logged costs; the classifiers' scores are the task's tables; the policy's training scores
    are the Lagrangian of them."""
    from megarl.data.tokenizer import load_tokenizer

    module, task = safe_task
    scores = _Rows("reward", "input_ids", "attention_mask", "model_scores", "cost_scores", "scores")
    history = _safe_run(safe_task, tmp_path / "safe", (scores,), **{
        "cluster.launcher": "local", "cluster.pools": "{main: {devices_per_node: 1, tp: 1}}",
        "cluster.placement": "{}"})
    assert len(history) == 100
    limit, lr, lam = 0.1, 0.5, 0.0
    tokenizer = load_tokenizer(str(task / "model"))
    for step, m in enumerate(history, start=1):
        assert m["safe/lambda"] == pytest.approx(lam, abs=1e-12)
        rows = scores.rows[step]
        assert m["safe/cost_mean"] == pytest.approx(rows["cost_scores"].mean().item(), abs=1e-6)
        if step in (1, 2, 10, 50, 100):
            _check_classifier_scores(module, rows, tokenizer)
        lam = max(0.0, lam + lr * (m["safe/cost_mean"] - limit))
    cost = [m["safe/cost_mean"] for m in history]
    reward = [m["safe/reward_mean"] for m in history]
    print("Safe-RLHF cost per 10 steps:", [round(statistics.mean(cost[i:i + 10]), 3) for i in range(0, 100, 10)])
    print("Safe-RLHF reward per 10 steps:", [round(statistics.mean(reward[i:i + 10]), 3) for i in range(0, 100, 10)])
    print("Safe-RLHF lambda per 10 steps:", [round(history[i]["safe/lambda"], 3) for i in range(0, 100, 10)])
    assert statistics.mean(cost[:10]) > 2 * limit  # the starting policy breaks the limit
    assert statistics.mean(cost[-20:]) <= limit + 0.02  # ... and ends within it
    assert statistics.mean(reward[-20:]) > statistics.mean(reward[:10]) + 0.2


def test_safe_rlhf_one_step_off_with_every_model_on_a_pool_of_its_own(ray_cluster, safe_task, tmp_path):
    """The example's placement on Ray (policy, reward model and cost model each on a pool of its own; the two
    classifiers called together), one step off with the rollout engines on a fourth pool: the rows one version
    behind from step 2 on, the classifiers' scores the task's tables, the multiplier's dual ascent by hand."""
    from megarl.data.tokenizer import load_tokenizer

    module, task = safe_task
    scores = _Rows("reward", "input_ids", "attention_mask", "model_scores", "cost_scores", "scores")
    history = _safe_run(safe_task, tmp_path / "safe_ray", (scores,), **{
        "trainer.total_steps": 3, "rollout.schedule": "one_step_off", "cluster.pools.gen.devices_per_node": 1,
        "cluster.placement.rollout": "gen"})
    tokenizer = load_tokenizer(str(task / "model"))
    lam = 0.0
    for step, m in enumerate(history, start=1):
        rows = scores.rows[step]
        _check_classifier_scores(module, rows, tokenizer)
        assert m["reward/cost_mean"] == pytest.approx(rows["cost_scores"].mean().item(), abs=1e-6)
        assert m["async/version_lag_max"] == (step > 1) and m["safe/lambda"] == pytest.approx(lam, abs=1e-12)
        lam = max(0.0, lam + 0.5 * (m["safe/cost_mean"] - 0.1))


COUNTER = '''
from megarl.program import Run


def step(run: Run) -> dict[str, float]:
    batch, metrics = run.rollout()
    run.state["steps"] = run.state.get("steps", 0) + 1
    run.state.setdefault("seen", []).append(run.step)
    return metrics | {"program/steps": float(run.state["steps"])}


def no_metrics(run):
    run.rollout()
'''


def test_program_state_is_checkpointed_and_a_wrong_return_is_named(task, tmp_path):
    from megarl.errors import MegarlError

    program = tmp_path / "counter.py"
    program.write_text(COUNTER)
    out = tmp_path / "counter"
    first = _run(task, out, f"{program}:step", **{"trainer.total_steps": 3, "trainer.save_every": 2})
    assert [m["program/steps"] for m in first] == [1.0, 2.0, 3.0]
    (out / "checkpoints" / "step_000003").rename(out / "step_000003.set_aside")  # resume from step 2's
    second = _run(task, out, f"{program}:step", **{"trainer.total_steps": 4, "trainer.save_every": 2})
    assert [m["program/steps"] for m in second] == [3.0, 4.0]  # step 2's state, then steps 3 and 4
    state = json.loads((out / "checkpoints" / "step_000004" / "trainer.json").read_text())
    assert state["program"] == {"steps": 4, "seen": [1, 2, 3, 4]}
    with pytest.raises(MegarlError, match=r"no_metrics' returned a NoneType in step 1; expected its metrics"):
        _run(task, tmp_path / "none", f"{program}:no_metrics")


def test_the_guides_step_program_runs(task, tmp_path):
    """docs/programming.md §3's listing as a program: its price follows the dual ascent it states, computed here
    from the costs it logged."""
    guide = (ROOT / "docs" / "programming.md").read_text()
    listing = next(code for code in re.findall(r"^```python\n(.*?)^```", guide, re.M | re.S) if "def step(run" in code)
    program = tmp_path / "my_algo.py"
    program.write_text(listing)
    history = _run(task, tmp_path / "guide", f"{program}:step", **{"trainer.total_steps": 4})
    price = 0.0
    for m in history:
        assert m["cost/price"] == pytest.approx(price, abs=1e-12)
        price = max(0.0, price + 0.05 * (m["cost/mean"] - 0.5))
    assert history[-1]["cost/price"] > 0
