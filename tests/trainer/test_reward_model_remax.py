"""The trainer with a reward-model worker and ReMax's greedy baseline, in one short run (CPU, local launcher).

Two steps of the tiny addition task with ``algorithm.advantage.estimator=remax`` and the reward
``FUNCTION_WEIGHT * integer_answer + MODEL_WEIGHT * reward model``, the reward model a tiny random
``Qwen2ForSequenceClassification`` over the task's tokenizer. References: `transformers` (the reward
model's forward on the captured sequences; greedy generation with the step-1 weights, which are the HF
model's), the task itself (the function's score read from the prompt's digits), and float64 ReMax
advantages computed here from those scores.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.dist, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_addition_tiny" / "config.yaml"
FUNCTION_WEIGHT, MODEL_WEIGHT = 0.5, 0.3
MAX_NEW = 4
STEPS = 2


class Recorder:
    """Copies of the step's batch after each stage (later stages add fields to the same batch)."""

    def __init__(self) -> None:
        self.batches: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        self.metrics: dict[int, dict[str, float]] = {}

    def on_stage_end(self, stage, step, batch):
        self.batches[stage, step] = {k: v.clone() for k, v in batch.tensors.items()}

    def on_step_end(self, step, metrics):
        self.metrics[step] = dict(metrics)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megarl.config.train import load_config
    from megarl.testing.addition import make_reward_model, make_task
    from megarl.trainer.trainer import run as train

    root = tmp_path_factory.mktemp("rm_remax")
    task = make_task(root / "task", train_rows=64, val_rows=8)
    rm = make_reward_model(root / "rm")
    extra = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
             "trainer.output_dir": root / "out", "trainer.tensorboard": "false", "trainer.total_steps": STEPS,
             "trainer.save_every": 0, "trainer.val_every": 0, "data.batch_size": 8, "rollout.sampling.n": 4,
             "rollout.max_new_tokens": MAX_NEW, "algorithm.advantage.estimator": "remax",
             "algorithm.kl_loss_coef": 0, "algorithm.mini_batches": 1,
             "reward.function_weight": FUNCTION_WEIGHT, "reward_model.model.path": rm,
             "reward_model.weight": MODEL_WEIGHT,
             # policy and reward model in this process (no Ray workers to start): the scores do not depend on
             # how the roles are hosted (tests/distributed/test_scalar_heads.py scores at TP2 x PP2)
             "cluster.launcher": "local", "cluster.pools.main.devices_per_node": 1, "cluster.pools.main.tp": 1}
    cfg = load_config(EXAMPLE, [f"{k}={v}" for k, v in extra.items()])
    recorder = Recorder()
    history = train(cfg, callbacks=(recorder,))
    return {"task": task, "rm": rm, "recorder": recorder, "history": history}


def _sequences(ids, attention_mask, response_mask):
    """(full sequence, prompt tokens, response tokens) per row, without padding."""
    out = []
    for row, attn, resp in zip(ids, attention_mask, response_mask, strict=True):
        seq = row[: int(attn.sum())]
        out.append((seq, row[(attn.bool() & ~resp.bool())].tolist(), row[resp.bool()].tolist()))
    return out


def _function_score(tokenizer, prompt, response):
    """integer_answer from the task itself: the response's first integer equals a + b of "a+b="."""
    a, b = map(int, tokenizer.decode(prompt).rstrip("=").split("+"))
    match = re.search(r"-?\d+", tokenizer.decode(response, skip_special_tokens=True))
    return float(match is not None and int(match.group()) == a + b)


def _reference_rewards(run, ids, attention_mask, response_mask):
    """float64 rewards per row: the function's score and the HF reward model's (last token), weighted."""
    from transformers import AutoModelForSequenceClassification

    from megarl.testing.addition import make_tokenizer

    tokenizer = make_tokenizer()
    rm = AutoModelForSequenceClassification.from_pretrained(str(run["rm"]), dtype=torch.float32).eval()
    function, model = [], []
    with torch.no_grad():
        for seq, prompt, response in _sequences(ids, attention_mask, response_mask):
            model.append(rm.score(rm.model(seq[None]).last_hidden_state)[0, -1, 0].item())
            function.append(_function_score(tokenizer, prompt, response))
    function, model = torch.tensor(function, dtype=torch.float64), torch.tensor(model, dtype=torch.float64)
    return FUNCTION_WEIGHT * function + MODEL_WEIGHT * model, function, model


@pytest.mark.parametrize("step", range(1, STEPS + 1))
def test_combined_scores_match_transformers_reward_model(run, step):
    b = run["recorder"].batches["reward", step]
    expected, function, model = _reference_rewards(run, b["input_ids"], b["attention_mask"], b["response_mask"])
    assert (b["scores"].double() - expected).abs().max().item() < 1e-5
    assert (b["model_scores"].double() - model).abs().max().item() < 1e-5 and model.std() > 0.05
    assert torch.equal(b["function_scores"].double(), function)
    m = run["recorder"].metrics[step]
    assert math.isclose(m["reward/mean"], expected.mean().item(), abs_tol=1e-5)
    assert math.isclose(m["reward/model_mean"], model.mean().item(), abs_tol=1e-5)
    assert math.isclose(m["reward/function_mean"], function.mean().item(), abs_tol=1e-6)


@pytest.mark.parametrize("step", range(1, STEPS + 1))
def test_baseline_scores_are_the_greedy_responses_rewards(run, step):
    b, g = run["recorder"].batches["reward", step], run["recorder"].batches["baseline", step]
    # one greedy response per prompt, prompt-indexed: row i is prompt i's
    assert torch.equal(g["prompt_uid"], torch.arange(8))
    per_prompt, _, _ = _reference_rewards(run, g["input_ids"], g["attention_mask"], g["response_mask"])
    assert (b["baseline_scores"].double() - per_prompt[b["prompt_uid"]]).abs().max().item() < 1e-5
    m = run["recorder"].metrics[step]
    assert math.isclose(m["reward/baseline_mean"], per_prompt.mean().item(), abs_tol=1e-5)


def test_greedy_baseline_equals_transformers_greedy_generation(run):
    from transformers import AutoModelForCausalLM

    b, g = run["recorder"].batches["rollout", 1], run["recorder"].batches["baseline", 1]  # step 1: the HF weights
    model = AutoModelForCausalLM.from_pretrained(str(run["task"] / "model"), dtype=torch.float32).eval()
    seqs = _sequences(g["input_ids"], g["attention_mask"], g["response_mask"])
    for _, prompt, response in seqs:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=1,
                                 pad_token_id=0)
        assert out[0, len(prompt):].tolist() == response
    # the sampled responses are not all greedy ones (they are samples at temperature 1)
    sampled = _sequences(b["input_ids"], b["attention_mask"], b["response_mask"])
    greedy = [seqs[uid] for uid in b["prompt_uid"].tolist()]
    assert all(s[1] == gr[1] for s, gr in zip(sampled, greedy, strict=True))  # the same prompts
    assert any(s[2] != gr[2] for s, gr in zip(sampled, greedy, strict=True))


@pytest.mark.parametrize("step", range(1, STEPS + 1))
def test_remax_advantages_are_reward_minus_greedy_reward(run, step):
    b, g = run["recorder"].batches["advantages", step], run["recorder"].batches["baseline", step]
    scores, _, _ = _reference_rewards(run, b["input_ids"], b["attention_mask"], b["response_mask"])
    per_prompt, _, _ = _reference_rewards(run, g["input_ids"], g["attention_mask"], g["response_mask"])
    baseline = per_prompt[b["prompt_uid"]]
    mask = b["response_mask"].double()
    # outcome reward on the last response token, gamma 1: every response token's return is the score
    expected = (scores - baseline)[:, None] * mask
    assert (b["advantages"].double() - expected).abs().max().item() < 1e-5
    assert (b["returns"].double() - scores[:, None] * mask).abs().max().item() < 1e-5
    assert (scores - baseline).abs().max() > 0.01  # the baseline does not cancel every reward
