"""Validation is sampling only: its own temperature and n, through the trainer (CPU, local launcher).

The training samples at temperature 1.0 with recomputed old log-probs (the example's two mini-batches);
validation samples at 0.6 with three responses per prompt, which no training check may refuse.
References: `transformers` (the log-probs of the sampled tokens at temperature 0.6 under the HF model,
whose weights an SGD step of lr 1e-30 leaves bit-identical) and the task itself (each response's score,
read from the prompt's digits).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.dist, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_addition_tiny" / "config.yaml"
VAL_T, VAL_N, VAL_ROWS = 0.6, 3, 8


class Recorder:
    def __init__(self) -> None:
        self.batches: dict[tuple[str, int], dict] = {}
        self.metrics: dict[int, dict[str, float]] = {}

    def on_stage_end(self, stage, step, batch):
        self.batches[stage, step] = {k: v.clone() for k, v in batch.tensors.items()}

    def on_step_end(self, step, metrics):
        self.metrics[step] = dict(metrics)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megarl.config.train import load_config
    from megarl.testing.addition import make_task
    from megarl.trainer.trainer import run as train

    root = tmp_path_factory.mktemp("validation")
    task = make_task(root / "task", train_rows=64, val_rows=VAL_ROWS)
    extra = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
             "trainer.output_dir": root / "out", "trainer.tensorboard": "false", "trainer.total_steps": 1,
             "trainer.save_every": 0, "trainer.val_every": 1, "algorithm.kl_loss_coef": 0,
             "rollout.validation.temperature": VAL_T, "rollout.validation.n": VAL_N,
             "policy.optim.optimizer": "sgd", "policy.optim.use_distributed_optimizer": "false",
             "policy.optim.lr": "1e-30",  # an update that leaves every fp32 weight as it is
             "cluster.launcher": "local", "cluster.pools.main.devices_per_node": 1, "cluster.pools.main.tp": 1}
    cfg = load_config(EXAMPLE, [f"{k}={v}" for k, v in extra.items()])
    assert cfg.rollout.sampling.temperature == 1.0 and cfg.algorithm.mini_batches == 2  # old log-probs recomputed
    recorder = Recorder()
    history = train(cfg, callbacks=(recorder,))
    return {"task": task, "recorder": recorder, "history": history}


def test_validation_samples_n_per_prompt_at_its_own_temperature(run):
    from transformers import AutoModelForCausalLM

    v = run["recorder"].batches["validation", 1]
    assert sorted(v["prompt_uid"].tolist()) == [i for i in range(VAL_ROWS) for _ in range(VAL_N)]
    model = AutoModelForCausalLM.from_pretrained(str(run["task"] / "model"), dtype=torch.float64).eval()
    ids, mask = v["input_ids"], v["response_mask"].bool()
    with torch.no_grad():
        logits = model(ids).logits[:, :-1]
    tokens = ids[:, 1:].unsqueeze(-1)
    at = {t: torch.log_softmax(logits / t, -1).gather(-1, tokens).squeeze(-1)[mask[:, 1:]] for t in (VAL_T, 1.0)}
    got = v["rollout_log_probs"][:, 1:][mask[:, 1:]].double()
    assert (got - at[VAL_T]).abs().max().item() < 1e-5
    assert (got - at[1.0]).abs().mean().item() > 0.05  # the check tells the two temperatures apart


def test_validation_reward_is_the_samples_score(run):
    from megarl.testing.addition import make_tokenizer

    tokenizer = make_tokenizer()
    v = run["recorder"].batches["validation", 1]
    scores = []
    for ids, attn, resp in zip(v["input_ids"], v["attention_mask"], v["response_mask"], strict=True):
        prompt, response = ids[attn.bool() & ~resp.bool()].tolist(), ids[resp.bool()].tolist()
        a, b = map(int, tokenizer.decode(prompt).rstrip("=").split("+"))
        match = re.search(r"-?\d+", tokenizer.decode(response, skip_special_tokens=True))
        scores.append(float(match is not None and int(match.group()) == a + b))
    m = run["history"][0]
    assert math.isclose(m["val/reward/mean"], sum(scores) / len(scores), abs_tol=1e-6)
    assert torch.equal(v["scores"].double(), torch.tensor(scores, dtype=torch.float64))
    assert "rollout/logprob_abs_diff" in m and m["rollout/logprob_abs_diff"] < 1e-5  # training's check still ran
