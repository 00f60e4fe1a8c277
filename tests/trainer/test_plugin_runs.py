"""Plug-ins by path through the trainer (issue #43): the GRPO demo (policy + reference on one rank: the local
launcher, or a Ray worker process) with examples/plugins/algorithms.py's estimator and policy loss in place of the
built-ins.

References: the built-in run itself, where the plug-ins compute the same math (GRPO through the public ``grpo``,
PPO's clipped surrogate written from its definition): every metric of every step equal, bit for bit; and for Dr.
GRPO with its constant-normalised loss, a float64 hand computation from the scores of the step's rows (advantages:
score minus the group's mean; the loss at ratio 1: the sum of -A over the counted tokens / (sequences x C)).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.dist]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "grpo_addition_tiny" / "config.yaml"
PLUGINS = ROOT / "examples" / "plugins" / "algorithms.py"
NOT_COMPARED = ("timing/", "throughput/", "memory/")


class _Advantages:
    def __init__(self) -> None:
        self.at: dict[int, dict[str, torch.Tensor]] = {}

    def on_stage_end(self, stage, step, batch):
        if stage == "advantages":
            self.at[step] = {k: batch[k].clone() for k in ("scores", "prompt_uid", "response_mask", "advantages")}

    def on_step_end(self, step, metrics):
        pass


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from megarl.testing.addition import make_task

    return make_task(tmp_path_factory.mktemp("task"), train_rows=64, val_rows=8)


def _run(task, out, callbacks=(), **extra):
    from megarl.config.train import load_config
    from megarl.trainer.trainer import run

    overrides = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
                 "trainer.output_dir": out, "trainer.tensorboard": "false", "trainer.total_steps": 3,
                 "trainer.save_every": 0, "trainer.val_every": 0, "cluster.launcher": "local",
                 "cluster.pools.main.devices_per_node": 1, "cluster.pools.main.tp": 1, "data.batch_size": 8,
                 "rollout.sampling.n": 8} | extra
    return run(load_config(EXAMPLE, [f"{k}={v}" for k, v in overrides.items()]), callbacks=callbacks)


def test_plugins_that_compute_the_built_in_math_reproduce_the_built_in_run(task, tmp_path):
    builtin = _run(task, tmp_path / "builtin")
    plugged = _run(task, tmp_path / "plugged", **{"algorithm.advantage.estimator": f"{PLUGINS}:group_normalised",
                                                  "algorithm.policy_loss.loss": f"{PLUGINS}:clipped_surrogate"})
    assert len(builtin) == len(plugged) == 3
    for a, b in zip(builtin, plugged, strict=True):
        a, b = ({k: v for k, v in m.items() if not k.startswith(NOT_COMPARED) and k != "time"} for m in (a, b))
        assert a == b


def test_dr_grpo_by_hand(ray_cluster, task, tmp_path):
    """On Ray: the policy's worker process imports the loss from its path itself (the config carries the spec)."""
    c = 4.0  # the loss's constant normaliser (Dr. GRPO: the maximum response length; any constant here)
    rows = _Advantages()
    history = _run(task, tmp_path / "dr_grpo", callbacks=(rows,), **{
        "algorithm.advantage.estimator": f"{PLUGINS}:dr_grpo",
        "algorithm.policy_loss.loss": f"{PLUGINS}:constant_normalised_surrogate",
        "algorithm.policy_loss.norm_constant": c, "algorithm.mini_batches": 1, "algorithm.kl_loss_coef": 0,
        "algorithm.entropy_coef": 0, "cluster.launcher": "ray"})
    for step, m in enumerate(history, start=1):
        b = rows.at[step]
        scores, uid, mask = b["scores"].double(), b["prompt_uid"], b["response_mask"].double()
        means = {g: scores[uid == g].mean().item() for g in uid.unique().tolist()}
        expected = torch.stack([(scores[i] - means[int(uid[i])]) * mask[i] for i in range(len(scores))])
        assert torch.allclose(b["advantages"].double(), expected, atol=1e-6)
        # one optimizer step per batch: the update's forward is pi_old (ratio 1, up to the rollout correction's
        # weights, 1 within 1e-5 on this CPU), so the surrogate is -A per token, summed per sequence
        by_hand = -(expected * mask).sum().item() / (len(scores) * c)
        assert m["actor/pg_loss"] == pytest.approx(by_hand, abs=1e-5)


class _Scored:
    def __init__(self) -> None:
        self.at: dict[int, dict] = {}

    def on_stage_end(self, stage, step, batch):
        if stage == "reward":
            self.at[step] = {k: batch[k].clone() for k in ("input_ids", "response_mask", "prompt_uid", "scores",
                                                           "function_scores", "safety_scores", "best_scores")}

    def on_step_end(self, step, metrics):
        pass


def test_reward_stages_in_order_by_hand(task, tmp_path):
    """examples/plugins/rewards.py's two stages after the rule function: the filter cancels the reward of every
    response with a 7, then the bonus goes to each differing group's best (as filtered); each row's terms and the
    logged means by hand from the decoded responses."""
    from megarl.data.tokenizer import load_tokenizer

    rewards = ROOT / "examples" / "plugins" / "rewards.py"
    scored = _Scored()
    history = _run(task, tmp_path / "stages", callbacks=(scored,), **{
        "reward.stages.safety": f"{rewards}:safety_filter", "reward.stages.best": f"{rewards}:group_best_bonus"})
    tokenizer = load_tokenizer(str(task / "model"))
    flagged_rows = 0
    for step, m in enumerate(history, start=1):
        b = scored.at[step]
        responses = tokenizer.batch_decode([ids[mask.bool()].tolist() for ids, mask in
                                            zip(b["input_ids"], b["response_mask"], strict=True)],
                                           skip_special_tokens=True)
        function = b["function_scores"].double()
        flagged = torch.tensor(["7" in r for r in responses])
        flagged_rows += int(flagged.sum())
        after_filter = torch.where(flagged, torch.zeros_like(function), function)
        bonus = torch.zeros_like(function)
        for g in b["prompt_uid"].unique():
            members = b["prompt_uid"] == g
            if after_filter[members].max() > after_filter[members].min():
                bonus[members] = 0.1 * (after_filter[members] == after_filter[members].max()).double()
        assert torch.allclose(b["safety_scores"].double(), after_filter - function, atol=1e-7)
        assert torch.allclose(b["best_scores"].double(), bonus, atol=1e-7)
        assert torch.allclose(b["scores"].double(), after_filter + bonus, atol=1e-6)
        assert m["reward/safety_mean"] == pytest.approx(b["safety_scores"].mean().item(), abs=1e-7)
        assert m["reward/best_mean"] == pytest.approx(b["best_scores"].mean().item(), abs=1e-7)
    assert flagged_rows > 0


class _Rows:
    def __init__(self) -> None:
        self.at: dict[int, dict] = {}

    def on_stage_end(self, stage, step, batch):
        if stage == "reward":
            self.at[step] = {"tensors": {k: batch[k].clone() for k in (
                "input_ids", "attention_mask", "response_mask", "rollout_log_probs", "function_scores", "prompt_uid")},
                "final_texts": list(batch.non_tensors["final_texts"])}

    def on_step_end(self, step, metrics):
        pass


def test_a_rollout_function_by_hand_and_against_transformers(task, tmp_path):
    """examples/plugins/rollout.py's draft_then_answer (two generation calls per response, a separator between):
    each row is prompt | draft | space | answer with only the model's two tokens trained, the answer is what the
    reward function scored, and every model token's rollout log-prob at step 1 (the initial weights) equals
    transformers' over the whole row (1e-5)."""
    from transformers import AutoModelForCausalLM

    from megarl.data.tokenizer import load_tokenizer

    rows = _Rows()
    history = _run(task, tmp_path / "rollout_fn", callbacks=(rows,), **{
        "rollout.function": f"{ROOT / 'examples' / 'plugins' / 'rollout.py'}:draft_then_answer",
        "trainer.total_steps": 2})
    assert len(history) == 2 and history[0]["rollout_function/calls"] == 2.0
    tokenizer = load_tokenizer(str(task / "model"))
    space = tokenizer.convert_tokens_to_ids(" ")
    b, texts = rows.at[1]["tensors"], rows.at[1]["final_texts"]
    for i in range(len(b["input_ids"])):
        ids, attention = b["input_ids"][i], b["attention_mask"][i].bool()
        row = ids[attention].tolist()
        mask = b["response_mask"][i][attention].tolist()
        assert mask[-3:] == [1, 0, 1] and not any(mask[:-3]) and row[-2] == space
        answer = tokenizer.decode([row[-1]], skip_special_tokens=True) if row[-1] != tokenizer.eos_token_id else ""
        assert texts[i] == answer
        want = float(answer.strip() == _answer_of(tokenizer, row[:-3]))  # integer_answer on the final answer
        assert b["function_scores"][i].item() == pytest.approx(want), i
    model = AutoModelForCausalLM.from_pretrained(str(task / "model"), dtype=torch.float32)
    with torch.no_grad():
        logits = model(b["input_ids"], attention_mask=b["attention_mask"].long()).logits.double()
    expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, b["input_ids"][:, 1:, None])[..., 0]
    trained = b["response_mask"][:, 1:].bool()
    assert (b["rollout_log_probs"][:, 1:].double() - expected)[trained].abs().max() < 1e-5


def _answer_of(tokenizer, prompt_ids):
    """The addition prompt's answer: "a+b=" -> str(a + b)."""
    text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    a, b = text.rstrip("=").split("+")
    return str(int(a) + int(b))
