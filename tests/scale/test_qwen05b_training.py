"""Issue #47 item 2: the whole Qwen2.5-0.5B (24 layers, vocabulary 151,936 tied to the embedding, 14/2 heads of 64)
trained end to end on CPU at TP2: GRPO with the embedded engine and with vLLM, PPO with a critic, a checkpoint, a
resume, an HF export.

Opt-in (``MEGARL_SCALE_TEST=1`` or ``make test-scale``; ~5 min and 18.9 GB of the machine at the peak, so not
in ``make test``; its forward and resharding are in CI: tests/bench/test_rehearsal.py). The model is random (the
published config, logits of standard deviation ~4); the tokenizer is the addition task's characters plus one added
token ``<tN>`` per other id, so every sampled id decodes; the reward is the share of odd ids in the response (it
varies, so every step has advantages). SGD without a reference: Adam's moments and a reference beside the float32
rollout replica went past 10 GB per rank (docs/rehearsal.md §5).

References: the training model's own log-probs of every sampled token (``rollout/logprob_abs_diff``, the mean gap:
< 1e-5 with the embedded engine; < 4e-5 with vLLM, whose CPU build is itself 1.3e-5 from a float64 forward of this
model), the run's uninterrupted twin (resume: every metric of step 3 equal), and transformers (the step-2 checkpoint
exported to HF and loaded by ``AutoModelForCausalLM``: its log-probs of the rows step 3 sampled with those weights
within 1e-4 of the rollout's).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.dist, pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("MEGARL_SCALE_TEST") != "1",
                       reason="opt-in: set MEGARL_SCALE_TEST=1 (the whole Qwen2.5-0.5B trained on CPU: ~5 min)"),
]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# the parity of the sampled ids (the tokenizer's added tokens <tN> decode every id of the vocabulary): it varies
REWARD = ("import re\n\ndef score(prompt, response, row):\n"
          "    ids = [int(i) for i in re.findall(r'<t(\\d+)>', response)]\n"
          "    return sum(i % 2 for i in ids) / max(len(ids), 1)\n")
VLLM_BOUND = 4e-5  # 3x vLLM's own mean error on this model in float32 (test_grpo_vllm)
TIMING = ("timing/", "throughput/", "memory/", "time")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from transformers import AutoConfig

    from megarl.bench.rehearse import LOGIT_STD
    from megarl.planner.presets import PRESETS
    from megarl.testing.addition import make_dataset, make_tokenizer
    from megarl.testing.tiny import write_random_hf

    root = tmp_path_factory.mktemp("qwen05b")
    config = AutoConfig.for_model(**PRESETS["qwen2.5-0.5b"])
    std = LOGIT_STD / config.hidden_size ** 0.5
    params, _ = write_random_hf(root / "model", config, tokenizer=False, vocab_std=std)
    assert params == 494_032_768  # Qwen2.5-0.5B's published count
    tokenizer = make_tokenizer()  # the addition task's characters, then one added token per other id
    tokenizer.add_tokens([f"<t{i}>" for i in range(len(tokenizer), config.vocab_size)])
    tokenizer.save_pretrained(str(root / "model"))
    make_dataset(root / "train.jsonl", 64, 0)
    make_dataset(root / "val.jsonl", 8, 1)
    (root / "reward.py").write_text(REWARD)
    return root


def _config(task, out, example="grpo_addition_tiny", **extra):
    from megarl.config.train import load_config

    base = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
            "data.batch_size": 2, "rollout.sampling.n": 4, "rollout.max_new_tokens": 4,
            "reward.function": f"{task / 'reward.py'}:score", "trainer.output_dir": out, "trainer.tensorboard": "false",
            "trainer.val_every": 0, "trainer.save_every": 1, "trainer.total_steps": 3, "algorithm.mini_batches": 1,
            # per rank: the policy's weights and gradient buffer, a whole float32 rollout replica (2 GB): Adam's
            # moments and a reference beside them went past 10 GB per rank (Ray's memory monitor stopped the run)
            "policy.optim.optimizer": "sgd", "policy.optim.use_distributed_optimizer": "false",
            "policy.optim.lr": "1e-3", "algorithm.kl_loss_coef": 0}
    return load_config(EXAMPLES / example / "config.yaml", [f"{k}={v}" for k, v in (base | extra).items()])


class _Rows:
    """Keeps the rollout rows of one step (their tokens, mask and rollout log-probs)."""

    def __init__(self, step: int) -> None:
        self.step, self.rows = step, None

    def on_stage_end(self, stage, step, batch):
        if stage == "rollout" and step == self.step:
            self.rows = batch.select("input_ids", "attention_mask", "response_mask", "rollout_log_probs")

    def on_step_end(self, step, metrics):
        pass


def _fit(cfg, *callbacks):
    from megarl.trainer.trainer import Trainer

    trainer = Trainer(cfg, callbacks)
    try:
        return trainer.fit()
    finally:
        trainer.close()


def _parity(history, bound=1e-5):
    for step, m in enumerate(history, 1):
        print(f"step {step}: rollout/logprob_abs_diff {m['rollout/logprob_abs_diff']:.3g}")
        assert m["rollout/logprob_abs_diff"] < bound, (step, m["rollout/logprob_abs_diff"])


def test_grpo_embedded_resume_and_hf_export(ray_cluster, task, tmp_path):
    from transformers import AutoModelForCausalLM

    from megarl.checkpoint.convert import convert_megatron_to_hf

    rows = _Rows(3)
    full = _fit(_config(task, tmp_path / "full"), rows)
    assert len(full) == 3
    _parity(full)
    assert any(m["reward/std"] > 0 for m in full)  # the advantages were not all zero

    # resume: two steps, then the same run again to three; step 3 equals the uninterrupted run's
    _fit(_config(task, tmp_path / "resumed", **{"trainer.total_steps": 2}))
    resumed = _fit(_config(task, tmp_path / "resumed"))
    assert len(resumed) == 1  # step 3 only
    a, b = full[2], resumed[0]
    keys = [k for k in a if not k.startswith(TIMING)]
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}

    # the step-2 checkpoint exported to HF: transformers' log-probs of the rows step 3 sampled with those weights
    hf = tmp_path / "hf_step2"
    convert_megatron_to_hf(tmp_path / "full" / "checkpoints" / "step_000002" / "policy", hf)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    r = rows.rows
    with torch.no_grad():
        logits = model(r["input_ids"], attention_mask=r["attention_mask"].long()).logits[:, :-1].double()
    lp = torch.log_softmax(logits, -1).gather(-1, r["input_ids"][:, 1:, None])[..., 0]
    mask = r["response_mask"][:, 1:].bool()
    # transformers against Megatron's kernels over 24 float32 layers: the 1e-4 (measured 1.0e-5, as the
    # rehearsal's 2.1e-5 for the same model: benchmarks/results/rehearsal-2026-12-05.md)
    assert mask.any() and (lp - r["rollout_log_probs"][:, 1:].double())[mask].abs().max() < 1e-4


def test_ppo_with_a_critic(ray_cluster, task, tmp_path):
    history = _fit(_config(task, tmp_path / "ppo", **{
        "trainer.total_steps": 2, "trainer.save_every": 0, "algorithm.advantage.estimator": "gae",
        "critic.optim.optimizer": "sgd", "critic.optim.use_distributed_optimizer": "false",
        "critic.optim.lr": "1e-3"}))
    _parity(history)
    assert all(torch.isfinite(torch.tensor(m["critic/vf_loss"])) for m in history)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_grpo_vllm(ray_cluster, task, tmp_path):
    history = _fit(_config(task, tmp_path / "vllm", example="grpo_addition_tiny_vllm", **{
        "trainer.total_steps": 2, "trainer.save_every": 0, "rollout.engine.max_model_len": 16}))
    # vLLM's CPU build in float32 is 1.32e-5 (mean) from a float64 forward of this model, transformers' float32
    # 3.9e-6, and vLLM 1.4e-5 from transformers, without megarl in the loop
    # (benchmarks/results/vllm_logprob_gap-2026-12-05.md): a mean gap of 1e-5 is below vLLM's own rounding here.
    # A wrong sync shows as > 1e-2.
    _parity(history, VLLM_BOUND)
