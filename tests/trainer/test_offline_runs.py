"""The offline programs through the trainer (issue #44, docs/offline.md) on the addition task's TRL-format data
(examples/offline_addition_tiny), one rank with the local launcher.

References: `transformers` for the first SFT step's loss (the first batch's rows tokenized by hand from the
character vocabulary, ``data.shuffle: false``) and for every score of the trained reward model (its checkpoint
exported to HF and run as ``Qwen2ForSequenceClassification``); ln 2 and zero implicit rewards for DPO's first step
(the policy equals its reference); held-out pairs for what the reward model and DPO learned; an RL run with that
checkpoint as its ``reward_model.model.path`` (no conversion; PPO with a critic), each row's reward equal to
transformers' score.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.dist]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "offline_addition_tiny"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from megarl.testing.addition import make_model, make_offline_datasets

    root = tmp_path_factory.mktemp("offline_task")
    make_model(root / "model")
    return make_offline_datasets(root)


def _run(task, out, config, data, steps, callbacks=(), **extra):
    from megarl.program import load_config, train

    overrides = {"model.path": task / "model", "data.train": task / data, "trainer.output_dir": out,
                 "trainer.tensorboard": "false", "trainer.total_steps": steps, "cluster.launcher": "local",
                 "cluster.pools.main.devices_per_node": 1, "cluster.pools.main.tp": 1} | extra
    return train(load_config(EXAMPLES / config, [f"{k}={v}" for k, v in overrides.items()]), None, callbacks)


def _ids(tokenizer, text):
    """A row tokenized by hand: one id per character, the end token after the completion."""
    return [tokenizer.convert_tokens_to_ids(c) for c in text]


def _rows(tokenizer, prompts, completions):
    eos = tokenizer.eos_token_id
    seqs = [(_ids(tokenizer, p), _ids(tokenizer, c) + [eos]) for p, c in zip(prompts, completions, strict=True)]
    width = max(len(p) + len(c) for p, c in seqs)
    ids, attn, resp = (torch.zeros(len(seqs), width, dtype=torch.long) for _ in range(3))
    for i, (p, c) in enumerate(seqs):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        attn[i, :len(p) + len(c)] = 1
        resp[i, len(p):len(p) + len(c)] = 1
    return ids, attn, resp


def _jsonl(path):
    import json

    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _sequence_logps(model, ids, attn, resp):
    with torch.no_grad():
        logits = model(ids, attention_mask=attn).logits.double()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (lp * resp[:, 1:]).sum(-1)


def _held_out_log_ratios(task, checkpoint, hf_dir):
    """The held-out pairs and, for their chosen and their rejected responses, the log-ratio of the trained policy
    (``checkpoint`` exported to ``hf_dir``) to the starting model, from transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.checkpoint.convert import convert_megatron_to_hf

    convert_megatron_to_hf(checkpoint, hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(task / "model")
    pairs = _jsonl(task / "pairs_val.jsonl")
    prompts = [p["prompt"] for p in pairs]
    chosen, rejected = (_rows(tokenizer, prompts, [p[k] for p in pairs]) for k in ("chosen", "rejected"))
    trained = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    start = AutoModelForCausalLM.from_pretrained(task / "model", dtype=torch.float32)
    return pairs, [_sequence_logps(trained, *rows) - _sequence_logps(start, *rows) for rows in (chosen, rejected)]


def test_sft_first_step_equals_transformers_and_the_loss_falls(task, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    history = _run(task, tmp_path / "sft", "sft.yaml", "sft.jsonl", 40, **{"data.shuffle": "false"})
    tokenizer = AutoTokenizer.from_pretrained(task / "model")
    rows = _jsonl(task / "sft.jsonl")[:16]
    ids, attn, resp = _rows(tokenizer, [r["prompt"] for r in rows], [r["completion"] for r in rows])
    model = AutoModelForCausalLM.from_pretrained(task / "model", dtype=torch.float32)
    expected = -_sequence_logps(model, ids, attn, resp).sum().item() / resp.sum().item()
    assert history[0]["loss"] == pytest.approx(expected, rel=1e-5)
    assert statistics.mean(m["loss"] for m in history[-10:]) < 0.6 * history[0]["loss"]


def test_dpo_starts_at_ln2_and_learns_the_held_out_preferences(task, tmp_path):
    history = _run(task, tmp_path / "dpo", "dpo.yaml", "pairs.jsonl", 40,
                   **{"data.val": task / "pairs_val.jsonl", "trainer.val_every": 40})
    first = history[0]
    assert first["loss"] == pytest.approx(math.log(2), rel=1e-6)  # the policy is its reference
    assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margins"] == 0.0
    late = history[-10:]
    assert statistics.mean(m["rewards/accuracies"] for m in late) > 0.8
    assert statistics.mean(m["rewards/margins"] for m in late) > 0.0
    # held out: the trained policy's log-ratio to the starting model ranks chosen over rejected
    pairs, ratio = _held_out_log_ratios(task, tmp_path / "dpo" / "checkpoints" / "step_000040" / "policy",
                                        tmp_path / "dpo_hf")
    accuracy = (ratio[0] > ratio[1]).double().mean().item()
    assert accuracy >= 0.7, accuracy  # chance: 0.5 (0.81 measured on this machine)
    # the run's own evaluation of data.val at step 40 (TRL's eval_*): the same pairs, the DPO loss of these ratios
    val = history[-1]
    assert val["val/rewards/accuracies"] == pytest.approx(accuracy, abs=1.5 / len(pairs))  # a near-tie may flip
    expected = torch.nn.functional.softplus(-0.1 * (ratio[0] - ratio[1])).mean().item()  # -log sigma(beta delta)
    assert val["val/loss"] == pytest.approx(expected, rel=1e-4)


def test_kto_starts_at_one_half_and_learns_the_held_out_preferences(task, tmp_path):
    """KTO on the pairs unpaired: at step 1 the policy is its reference, so the KL estimate is 0 and every row's
    term is 1 - sigma(0) = 1/2 (loss 0.5, implicit rewards 0); after 60 steps the policy's log-ratio to the start
    ranks held-out pairs."""
    history = _run(task, tmp_path / "kto", "kto.yaml", "pairs.jsonl", 60)
    first = history[0]
    assert first["loss"] == pytest.approx(0.5, rel=1e-6)
    assert first["kl"] == 0.0 and first["rewards/chosen"] == first["rewards/rejected"] == 0.0
    assert statistics.mean(m["rewards/margins"] for m in history[-10:]) > 0.0
    _, ratio = _held_out_log_ratios(task, tmp_path / "kto" / "checkpoints" / "step_000060" / "policy",
                                    tmp_path / "kto_hf")
    accuracy = (ratio[0] > ratio[1]).double().mean().item()
    assert accuracy >= 0.7, accuracy  # chance: 0.5


def test_an_offline_run_resumes_where_it_stopped(task, tmp_path):
    """DPO stopped after step 3 (its checkpoint: policy, optimizer, the data position) and started again to 6 gives
    the steps 4-6 of an uninterrupted run."""
    whole = _run(task, tmp_path / "whole", "dpo.yaml", "pairs.jsonl", 6)
    _run(task, tmp_path / "parts", "dpo.yaml", "pairs.jsonl", 3)
    resumed = _run(task, tmp_path / "parts", "dpo.yaml", "pairs.jsonl", 6)
    assert len(resumed) == 3  # steps 4, 5, 6
    for a, b in zip(whole[3:], resumed, strict=True):
        for key in ("loss", "rewards/margins", "grad_norm", "logps/chosen"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), key


def test_precomputed_reference_log_probs_give_the_on_the_fly_steps(task, tmp_path, caplog):
    """offline.precompute_ref_log_probs (TRL's option): the reference's log-probs of every example computed once
    up front give the steps that computing them each step gives (the same frozen model, other micro-batches)."""
    with caplog.at_level("INFO", logger="megarl.trainer.sources"):
        runs = [_run(task, tmp_path / f"kto{i}", "kto.yaml", "pairs.jsonl", 6,
                     **{"offline.precompute_ref_log_probs": flag}) for i, flag in enumerate(("false", "true"))]
    assert "reference log-probs of 512 training examples computed once" in caplog.text  # 256 pairs, unpaired
    for on_the_fly, precomputed in zip(*runs, strict=True):
        for key in ("loss", "kl", "rewards/chosen", "grad_norm"):
            assert precomputed[key] == pytest.approx(on_the_fly[key], rel=1e-5, abs=1e-7), key


class _Scores:
    def __init__(self) -> None:
        self.batches = []

    def on_stage_end(self, stage, step, batch) -> None:
        if stage == "reward":
            self.batches.append((batch["input_ids"].clone(), batch["attention_mask"].clone(), batch["scores"].clone()))

    def on_step_end(self, step, metrics) -> None:
        pass


def test_reward_model_trained_here_ranks_held_out_pairs_and_scores_an_rl_run(task, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from megarl.checkpoint.convert import convert_megatron_to_hf
    from megarl.testing.addition import make_dataset

    history = _run(task, tmp_path / "rm", "reward_model.yaml", "pairs.jsonl", 60,
                   **{"data.val": task / "pairs_val.jsonl", "trainer.val_every": 60})
    assert all(math.isfinite(m["loss"]) for m in history)
    ckpt = tmp_path / "rm" / "checkpoints" / "step_000060" / "critic"
    convert_megatron_to_hf(ckpt, tmp_path / "rm_hf")
    rm = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm_hf", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(task / "model")
    pairs = _jsonl(task / "pairs_val.jsonl")
    prompts = [p["prompt"] for p in pairs]
    with torch.no_grad():
        scores = [rm(*_rows(tokenizer, prompts, [p[k] for p in pairs])[:2]).logits.squeeze(-1)
                  for k in ("chosen", "rejected")]
    accuracy = (scores[0] > scores[1]).double().mean().item()
    assert accuracy >= 0.7, accuracy  # chance: 0.5 (0.83 measured on this machine)
    assert history[-1]["val/accuracy"] == pytest.approx(accuracy, abs=1.5 / len(pairs))  # the run's evaluation
    expected = torch.nn.functional.softplus(-(scores[0] - scores[1])).mean().item()
    assert history[-1]["val/loss"] == pytest.approx(expected, rel=1e-4)

    # the checkpoint as a PPO run's reward model, as it is: every row's reward is its score
    make_dataset(tmp_path / "prompts.jsonl", 32, seed=5)
    recorder = _Scores()
    from megarl.program import load_config, train

    overrides = {"model.path": task / "model", "data.train": tmp_path / "prompts.jsonl", "data.val": "null",
                 "trainer.output_dir": tmp_path / "grpo", "trainer.tensorboard": "false", "trainer.total_steps": 2,
                 "trainer.val_every": 0, "cluster.launcher": "local", "cluster.pools.main.devices_per_node": 1,
                 "cluster.pools.main.tp": 1, "data.batch_size": 4, "rollout.sampling.n": 4,
                 "reward.function": "null", "reward_model.model.path": ckpt, "reward_model.weight": 1.0,
                 "algorithm.advantage.estimator": "gae", "algorithm.kl_loss_coef": 0}  # PPO with a critic
    train(load_config(ROOT / "examples" / "grpo_addition_tiny" / "config.yaml",
                      [f"{k}={v}" for k, v in overrides.items()]), None, (recorder,))
    assert len(recorder.batches) == 2
    for ids, attn, got in recorder.batches:
        with torch.no_grad():  # the head at each row's last real token (a sampled pad id inside a response would
            # make transformers' own pick, the last token that is not the pad id, another one)
            hidden = rm.model(ids, attention_mask=attn.long()).last_hidden_state
            per_token = rm.score(hidden).squeeze(-1)
            expected = per_token.gather(1, (attn.sum(-1).long() - 1)[:, None]).squeeze(1)
        assert torch.allclose(got.float(), expected, rtol=1e-4, atol=1e-4), (got, expected)


def test_online_dpo_learns_the_task(tmp_path):
    """Online DPO (examples/online_dpo_addition_tiny): 4 samples per prompt, best against worst, groups whose rewards
    all tie dropped (dynamic sampling). Every kept pair is a right answer (reward 1) against a wrong one (0), so the
    score margin is exactly 1; the first step's DPO loss is ln 2 (the policy is its reference); the reward rises by
    more than 0.2 in 100 steps."""
    from megarl.program import load_config, train
    from megarl.testing.addition import make_task

    task = make_task(tmp_path / "task", train_rows=256, val_rows=8)
    overrides = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": "null",
                 "trainer.output_dir": tmp_path / "run", "trainer.tensorboard": "false", "trainer.val_every": 0,
                 "trainer.save_every": 0, "cluster.launcher": "local", "cluster.pools.main.devices_per_node": 1,
                 "cluster.pools.main.tp": 1}
    history = train(load_config(ROOT / "examples" / "online_dpo_addition_tiny" / "config.yaml",
                                [f"{k}={v}" for k, v in overrides.items()]))
    assert history[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert all(m["objective/scores_margin"] == 1.0 for m in history if m["batch/num_sequences"])
    first = statistics.mean(m["reward/mean"] for m in history[:10])
    last = statistics.mean(m["reward/mean"] for m in history[-10:])
    assert last - first > 0.2, (first, last)
