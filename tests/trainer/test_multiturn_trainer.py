"""The trainer with multi-turn rollouts (issue #25): examples/multiturn_lookup_tiny, where an environment reveals a
digit drawn for each conversation after the model's first turn and scores the second turn against it, on the
session's Ray cluster (policy TP2 with its embedded rollout engines, reference colocated; the GRPO run learns under
the fully asynchronous schedule, its rollout engine on a pool of its own).

References: the task itself -- the digit is independent of everything the model sees before the reveal, so a
policy that ignores the observation earns at most 1/10 in expectation; a rise of 0.2 needs the observation -- and
the training model's own log-probs of every sampled token of every model turn (``rollout/logprob_abs_diff``). The
token counts by hand: a model turn is one or two tokens (a digit and ``<|end|>``), the reveal three
(``<|user|>``, the digit, ``<|assistant|>``) plus the ``<|end|>`` the template closes a cut turn with.

The PPO run talks to an environment that fails one environment call in ten (``on_env_error: score``): every
failure's text lands in ``env_errors.jsonl`` of the run directory, and the first of each kind in the log.
"""

from __future__ import annotations

import json
import logging
import re
import statistics
import threading
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.dist, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "multiturn_lookup_tiny"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from megarl.testing.lookup import make_task

    return make_task(tmp_path_factory.mktemp("lookup"))


def _run(task, out, **extra):
    from megarl.config.train import load_config
    from megarl.trainer.trainer import run

    base = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
            "rollout.multi_turn.environment": f"{EXAMPLE / 'env.py'}:HiddenDigit", "trainer.output_dir": out,
            "trainer.tensorboard": "false", "trainer.save_every": 0, "trainer.val_every": 0}
    return run(load_config(EXAMPLE / "config.yaml", [f"{k}={v}" for k, v in (base | extra).items()]))


FLAKY_ENV = """
import random

from megarl.multiturn import Step


class FlakyDigit:  # examples/multiturn_lookup_tiny/env.py's HiddenDigit, failing one call in ten
    made = 0

    def __init__(self):
        FlakyDigit.made += 1
        self.k, self.turns = FlakyDigit.made, 0
        self.digit = str(random.Random(self.k).randrange(10))

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        self.turns += 1
        if self.turns == 1:
            if self.k % 10 == 3:
                raise KeyError(f"no digit for conversation {self.k}")
            return Step([{"role": "user", "content": self.digit}])
        first = next((c for c in text if c.isdigit()), None)
        return Step([], reward=float("nan") if self.k % 10 == 7 else float(first == self.digit), done=True)
"""


def test_ppo_with_a_critic_runs_and_resumes(ray_cluster, task, tmp_path, caplog):
    """GAE over the model tokens (observation tokens skipped), a critic trained on them; stopped after its step-4
    checkpoint and run again to step 6, it continues from there. Conversations 3, 13, 23, ... fail in their first
    environment step (KeyError) and 7, 17, ... in their second (a NaN reward): 2 of 19 calls."""
    from megarl.metrics.tracking import read_metrics

    env = tmp_path / "flaky_env.py"
    env.write_text(FLAKY_ENV)
    ppo = {"algorithm.advantage.estimator": "gae", "algorithm.kl_loss_coef": 0, "critic.optim.lr": "5e-3",
           "trainer.save_every": 2, "rollout.multi_turn.environment": f"{env}:FlakyDigit",
           "rollout.multi_turn.on_env_error": "score"}
    out = tmp_path / "ppo"
    with caplog.at_level(logging.WARNING, logger="megarl.multiturn.errors"):
        first = _run(task, out, **ppo, **{"trainer.total_steps": 4})
        second = _run(task, out, **ppo, **{"trainer.total_steps": 6})
    assert len(first) == 4 and len(second) == 2
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4, 5, 6]
    for m in first + second:
        assert "critic/vf_loss" in m and m["rollout/logprob_abs_diff"] < 1e-5

    kinds = {"KeyError in FlakyDigit.step": (1, r"FlakyDigit.step \(row \d+, turn 1\) raised KeyError: 'no digit "
                                                r"for conversation (\d+)'"),
             "invalid result from FlakyDigit.step": (2, r"FlakyDigit.step \(row \d+, turn 2\) returned the reward "
                                                       r"nan; expected a finite number")}
    lines = [json.loads(line) for line in (out / "env_errors.jsonl").read_text().splitlines()]
    counts = {}  # (step, kind) -> failures
    for r in lines:
        turn, message = kinds[r["kind"]]
        assert r["phase"] == "train" and r["turn"] == turn and r["ended"], r
        match = re.fullmatch(message, r["message"])
        assert match and (turn == 2 or int(match[1]) % 10 == 3), r
        assert ("KeyError: 'no digit" in r["traceback"]) == (turn == 1)
        counts[r["step"], r["kind"]] = r["kind_count"]
    assert sorted(counts) == [(step, kind) for step in range(1, 7) for kind in sorted(kinds)]
    for step, m in enumerate(first + second, start=1):  # every failure of the step, under its kind; ~1 call in 10
        failed = [counts[step, kind] for kind in kinds]
        assert sum(failed) == m["multiturn/env_errors"]
        assert 0.09 < sum(failed) / (256 + 256 - failed[0]) < 0.12  # 256 first calls, a second for those that passed
        # the model's tokens: one or two turns of one or two; the environment's: one reveal (3-4) unless the first
        # step failed
        assert 1.0 <= m["response/length_mean"] <= m["response/length_max"] <= 4.0
        assert 3.0 * (1 - failed[0] / 256) <= m["response/env_tokens_mean"] <= m["response/env_tokens_max"] <= 4.0
    # the first of each kind in the log, once per run (two runs), naming the file
    firsts = sorted(r.getMessage() for r in caplog.records if r.getMessage().startswith("multi-turn: first"))
    assert [w.split(" (")[0] for w in firsts] == sorted(2 * [f"multi-turn: first {kind}" for kind in kinds])
    assert all(f"every one's text goes to {out / 'env_errors.jsonl'}" in w for w in firsts)


class _Rows:
    """The rows of each step at the stages the checks need (cloned: later stages change them)."""

    def __init__(self) -> None:
        self.at: dict[tuple[str, int], tuple[dict, dict]] = {}

    def on_stage_end(self, stage, step, batch):
        if stage in ("baseline", "advantages", "step"):
            self.at[stage, step] = ({k: batch[k].clone() for k in batch.tensors.keys()},  # noqa: SIM118 (Batch)
                                    dict(batch.non_tensors))

    def on_step_end(self, step, metrics):
        pass


def _overlong_by_hand(rows: dict, budget: int, buffer: int, factor: float) -> list[float]:
    """DAPO's penalty of each row, its length counted from the row: its tokens from the model's first on."""
    out = []
    for attention, mask in zip(rows["attention_mask"].tolist(), rows["response_mask"].tolist(), strict=True):
        length = int(sum(attention)) - mask.index(1.0)
        out.append(-factor * min(1.0, max(0, length - (budget - buffer)) / buffer))
    return out


def test_algorithm_features_combine_with_conversations(ray_cluster, tmp_path):
    """Issue #42: DAPO's overlong penalty and filtering, ReMax's greedy conversation, router replay, a distillation
    teacher and a reward model, all on, with multi-turn rollouts under the one-step-off schedule (the conversations
    of step 2 talk with the rollout pool while step 1 trains): two steps of the hidden-digit task on a tiny MoE
    policy (4 experts, top 2; TP1 x DP2 x EP2, its rollout engine on a pool of its own) taught by a dense teacher and
    scored by a tiny random Qwen2 classifier. Every row is checked by hand or against transformers: the reward
    model's score against a transformers forward of the classifier over the whole conversation (its last token's),
    each row's reward against environment + weight x model + overlong, the overlong penalty against DAPO's formula
    over the row's tokens after the prompt (budget 8, buffer 4), the masked rows against their endings (a
    conversation here is cut only when its last turn ran out of tokens before <|end|>), the ReMax baseline against
    the greedy conversation's own reward (the reward model's score of it included), the teacher's log-probs against
    a transformers forward of the teacher over the whole conversation, the router replay against the rollout's
    log-probs (the replayed forward reproduces them) and the replay's own count of mismatches."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from megarl.config.train import load_config
    from megarl.testing.addition import make_reward_model
    from megarl.testing.lookup import make_task, make_tokenizer
    from megarl.trainer.trainer import run

    task = make_task(tmp_path / "moe", num_experts=4, top_k=2)
    teacher = make_task(tmp_path / "teacher", seed=1) / "model"
    rm_dir, mw = make_reward_model(tmp_path / "rm", tokenizer=make_tokenizer), 0.3
    budget, buffer, factor = 8, 4, 0.5
    rows = _Rows()

    overrides = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
                 "rollout.multi_turn.environment": f"{EXAMPLE / 'env.py'}:HiddenDigit",
                 "trainer.output_dir": tmp_path / "run", "trainer.tensorboard": "false", "trainer.save_every": 0,
                 "trainer.val_every": 0, "trainer.total_steps": 2, "data.batch_size": 4, "rollout.sampling.n": 4,
                 "cluster.pools.main.tp": 1, "cluster.pools.main.ep": 2, "policy.router_replay": "true",
                 "algorithm.advantage.estimator": "remax", "algorithm.mask_truncated": "true",
                 "algorithm.kl_loss_coef": 0, "reward.overlong_buffer": buffer,
                 "reward.overlong_penalty_factor": factor, "teacher.model.path": teacher, "teacher.kl_coef": 0.1,
                 "reward_model.model.path": rm_dir, "reward_model.weight": mw,
                 "cluster.pools.gen.devices_per_node": 1, "cluster.placement.rollout": "gen",
                 "rollout.schedule": "one_step_off"}
    history = run(load_config(EXAMPLE / "config.yaml", [f"{k}={v}" for k, v in overrides.items()]), callbacks=(rows,))
    assert len(history) == 2
    teacher_model = AutoModelForCausalLM.from_pretrained(teacher, dtype="float32").eval()
    rm = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype="float32").eval()

    def rm_scores(rows: dict) -> list[float]:  # the classifier over each whole conversation: its last token's score
        with torch.no_grad():  # (the head by hand: HF's would stop at a sampled pad id)
            return [rm.score(rm.model(ids[None, : int(n)]).last_hidden_state)[0, -1, 0].item()
                    for ids, n in zip(rows["input_ids"], rows["attention_mask"].sum(-1), strict=True)]

    cut_rows = kept_rows = 0
    for step, m in enumerate(history, start=1):
        b, non = rows.at["advantages", step]
        greedy, _ = rows.at["baseline", step]
        stepped, _ = rows.at["step", step]
        # the reward model reads the whole conversation (prompt, model turns, observations); overlong penalty by
        # hand; a row's reward is its environment's + weight x the model's + the penalty (reward.function: null)
        assert b["model_scores"].tolist() == pytest.approx(rm_scores(b), abs=1e-5)
        assert b["overlong_scores"].tolist() == pytest.approx(_overlong_by_hand(b, budget, buffer, factor), abs=1e-6)
        assert b["scores"].tolist() == pytest.approx((b["environment_scores"] + mw * b["model_scores"]
                                                      + b["overlong_scores"]).tolist(), abs=1e-6)
        # ReMax: one greedy conversation per prompt, scored the same way; its reward is each sampled row's baseline
        assert greedy["prompt_uid"].tolist() == [0, 1, 2, 3]
        greedy_reward = [e + mw * r + p for e, r, p in zip(greedy["environment_scores"].tolist(), rm_scores(greedy),
                                                           _overlong_by_hand(greedy, budget, buffer, factor),
                                                           strict=True)]
        assert b["baseline_scores"].tolist() == pytest.approx([greedy_reward[u] for u in b["prompt_uid"].tolist()],
                                                              abs=1e-5)
        # mask_truncated: cut rows (the last token is not <|end|>, id 1) train on nothing, the others on every model
        # token
        for i, (ids, attention) in enumerate(zip(b["input_ids"].tolist(), b["attention_mask"].tolist(), strict=True)):
            cut = ids[int(sum(attention)) - 1] != 1
            assert non["finish_reasons"][i] == ("length" if cut else "stop")
            expected = torch.zeros_like(b["response_mask"][i]) if cut else b["response_mask"][i]
            assert torch.equal(stepped["response_mask"][i], expected)
            cut_rows, kept_rows = cut_rows + cut, kept_rows + (not cut)
        assert m["response/truncated_masked_frac"] == pytest.approx(sum(f == "length" for f in non["finish_reasons"])
                                                                    / 16)
        # the teacher's log-prob of every model token given the whole conversation, as transformers computes it
        mask = b["response_mask"].bool()
        with torch.no_grad():
            logits = teacher_model(b["input_ids"], attention_mask=b["attention_mask"].long()).logits.double()
        expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, b["input_ids"][:, 1:, None])[..., 0]
        assert (b["teacher_log_probs"][:, 1:].double() - expected)[mask[:, 1:]].abs().max() < 1e-5
        # router replay: the rows carry the rollout's routing of every fed token; replayed, the training forward
        # reproduces every model token's rollout log-prob, and no token left the rollout's experts
        assert b["routed_experts"].shape[:2] == b["input_ids"].shape and b["routed_experts"].shape[2:] == (2, 2)
        assert m["actor/moe_replay_mismatch"] == 0
        assert step > 1 or m["rollout/logprob_abs_diff"] < 1e-5  # step 2 trains on rows of version 0 (one step off)
        assert m["rollout/push_logprob_abs_diff"] < 1e-5  # every version's push probed on the rollout replica
        version = max(step - 2, 0)
        assert (b["rollout_versions"][mask] == version).all() and (b["rollout_versions"][~mask] == 0).all()
        assert m["async/version_lag_max"] == step - 1 - version
        assert m["multiturn/turns_mean"] == 2.0 and "distill/reverse_kl" in m
        assert m["reward/model_mean"] == pytest.approx(b["model_scores"].mean().item(), abs=1e-6)
    assert cut_rows and kept_rows  # both kinds of endings were checked


class _Versions:
    """Saves a checkpoint after each of the first ``steps`` steps (the weights of versions 1..steps) and keeps the
    rows those steps trained on (their versions are 0..steps)."""

    def __init__(self, steps: int) -> None:
        self.steps, self.trainer, self.rows, self.done = steps, None, [], 0

    def on_stage_end(self, stage, step, batch):
        if stage == "rollout" and step <= self.steps + 1:
            for i in range(len(batch)):
                n = int(batch["attention_mask"][i].sum())
                self.rows.append((batch["input_ids"][i, :n].clone(), batch["response_mask"][i, :n].bool(),
                                  batch["rollout_log_probs"][i, :n].clone(), batch["rollout_versions"][i, :n].clone()))

    def on_step_end(self, step, metrics):
        self.done = step
        if step <= self.steps:
            self.trainer.save()

    def hold_inside_turns(self, times: int, monkeypatch, end_id: int = 1) -> None:
        """Make a weight push land inside a model turn ``times`` times in rows the checked steps train on: after a
        producer's generation call that leaves a turn unfinished (a row's token is not ``<|end|>``; with one token
        per call the next call continues the turn), the producer waits for the trainer's next push. The timing alone
        seldom gives it here: a wave of this tiny model outpaces a training step.

        A hold is made only where the held rows reach a checked step within the staleness bound: the wave in flight
        started at the version the trainer is training from, so one push lands inside it, and the trainer will
        train it two steps later at most (a wave starts when the buffer holds at most one batch), at lag 2 at most:
        ``max_staleness: 2``. With staleness 1 the full suite's run found no split turn: the next step took an
        older wave first and the held one was dropped as stale. A hold ends when the trainer waits for groups
        instead of pushing (the producer is often the slower side here, and a dynamic-sampling round takes more),
        so the two never wait for each other."""
        from megarl.trainer.asynchronous import RolloutProducer

        generate, take = self.trainer.cluster.generate, RolloutProducer.take
        self.held, self.wave_versions, self.taking = 0, {}, False

        def taking(producer, *args, **kwargs):
            self.taking = True
            try:
                return take(producer, *args, **kwargs)
            finally:
                self.taking = False

        def held(*args, **kwargs):
            rows = generate(*args, **kwargs)
            if threading.current_thread().name != "megarl-rollout-producer":
                return rows
            producer = self.trainer.source.producer
            wave = producer.waves[-1].number  # the wave in flight is the newest drawn
            started = self.wave_versions.setdefault(wave, int(rows["policy_version"].min()))
            if (self.held < times and self.done <= self.steps - 2 and not self.taking
                    and started == producer.engine_version == self.done
                    and bool((rows["input_ids"][rows["response_mask"].bool()] != end_id).any())):
                version, deadline = producer.engine_version, time.monotonic() + 600
                while producer.engine_version == version and not self.taking and time.monotonic() < deadline:
                    time.sleep(0.01)
                self.held += producer.engine_version != version
            return rows

        monkeypatch.setattr(RolloutProducer, "take", taking)
        self.trainer.cluster.generate = held


def _convert_all(pairs):
    from megarl.checkpoint.convert import convert_megatron_to_hf

    for src, dst in pairs:
        convert_megatron_to_hf(src, dst)


def test_async_grpo_learns_to_use_the_observation(ray_cluster, task, tmp_path, monkeypatch):
    """Issue #42, recipe (b): the hidden-digit task under the fully asynchronous schedule (the rollout engine on a
    pool of its own, staleness 2, drop mode: the producer never waits for a push, so pushes land inside its waves)
    with partial rollouts (one token per call: a weight push lands inside
    a model turn as well as between turns; the next call continues it under the new weights) and dynamic sampling
    (groups whose conversations all score alike are dropped): conversations run turn by turn in the producer, each
    model token keeps its version; the policy learns to use the observation (the rise of 0.2 needs it, module
    docstring). Every model token's rollout log-prob of the first steps equals a transformers forward of the whole
    conversation under the weights of its own version (the policy's checkpoint of that version, converted to HF);
    every push's probe within 1e-5; the token counts by hand."""
    import concurrent.futures
    import multiprocessing

    from transformers import AutoModelForCausalLM

    from megarl.config.train import load_config
    from megarl.trainer.trainer import Trainer

    out, steps, checked_steps = tmp_path / "grpo", 40, 8
    overrides = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
                 "rollout.multi_turn.environment": f"{EXAMPLE / 'env.py'}:HiddenDigit", "trainer.output_dir": out,
                 "trainer.tensorboard": "false", "trainer.save_every": 0, "trainer.val_every": 0,
                 "trainer.keep_checkpoints": checked_steps + 1, "trainer.total_steps": steps,
                 "cluster.pools.main.devices_per_node": 1, "cluster.pools.main.tp": 1,
                 "cluster.pools.gen.devices_per_node": 1, "cluster.placement.rollout": "gen",
                 "rollout.schedule": "async", "rollout.asynchronous.max_staleness": 2,
                 "rollout.asynchronous.on_stale": "drop",
                 "rollout.asynchronous.partial_chunk_tokens": 1, "algorithm.kl_loss_coef": 0,
                 "algorithm.dynamic_sampling.max_extra_rounds": 1}
    recorder = _Versions(checked_steps)
    trainer = Trainer(load_config(EXAMPLE / "config.yaml", [f"{k}={v}" for k, v in overrides.items()]), (recorder,))
    recorder.trainer = trainer
    recorder.hold_inside_turns(3, monkeypatch)
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    rewards = [m["reward/mean"] for m in history]
    start, end = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
    print(f"async multi-turn GRPO reward: first 10 steps {start:.3f}, last 10 {end:.3f}; interrupted rows per step",
          [int(m["async/interrupted_responses"]) for m in history])
    assert len(history) == steps and end > start + 0.2 and end > 0.3
    for m in history:
        assert m["async/version_lag_max"] <= 2 and m["rollout/push_logprob_abs_diff"] < 1e-5
        assert m["multiturn/turns_mean"] == 2.0 and m["multiturn/env_errors"] == 0.0
        # the model's tokens: two turns of one or two; the environment's: the reveal, 3 tokens (4 after a cut turn)
        assert 2.0 <= m["response/length_mean"] <= m["response/length_max"] <= 4.0
        assert 3.0 <= m["response/env_tokens_mean"] <= m["response/env_tokens_max"] <= 4.0
    assert sum(m["async/interrupted_responses"] for m in history) > 0  # conversations spanned a push
    assert sum(m["dynamic/groups_dropped"] for m in history) > 0  # groups whose conversations all scored alike

    # every model token's rollout log-prob against transformers under the weights of its version
    versions = sorted({int(v) for _, mask, _, vs in recorder.rows for v in vs[mask]})
    # steps 1..9 train on rows of versions 0 up to 8 (the newest at least 8 minus the staleness bound, 2)
    assert versions[0] == 0 and checked_steps - 2 <= versions[-1] <= checked_steps and len(versions) >= 6, versions
    pairs = [(str(out / "checkpoints" / f"step_{v:06d}" / "policy"), str(tmp_path / f"hf_v{v}")) for v in versions[1:]]
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver")) as pool:
        pool.submit(_convert_all, pairs).result()
    models = {v: AutoModelForCausalLM.from_pretrained(task / "model" if v == 0 else tmp_path / f"hf_v{v}",
                                                      dtype="float32").eval() for v in versions}
    rows = recorder.rows
    width = max(len(ids) for ids, _, _, _ in rows)

    def padded(k, value):
        return torch.stack([torch.nn.functional.pad(r[k], (0, width - len(r[k])), value=value) for r in rows])

    ids, mask, rollout_lp, token_versions = padded(0, 0), padded(1, False), padded(2, 0.0), padded(3, -1)
    attention = torch.stack([torch.arange(width) < len(r[0]) for r in rows]).long()
    checked = 0
    with torch.no_grad():
        for v, model in models.items():
            logits = model(ids, attention_mask=attention).logits[:, :-1].double()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
            sel = mask[:, 1:] & (token_versions[:, 1:] == v)
            assert (lp[sel] - rollout_lp[:, 1:][sel]).abs().max() < 1e-5, v
            checked += int(sel.sum())
    mid_turn = 0
    for m, vs in zip(mask, token_versions, strict=True):  # a model turn starts where the mask rises
        turns = torch.cumsum((m[1:] & ~m[:-1]).long(), 0)[m[1:]]
        model_versions = vs[1:][m[1:]]
        mid_turn += any(len(set(model_versions[turns == t].tolist())) > 1 for t in turns.unique())
    print(f"{checked} model tokens recomputed; {recorder.held} pushes held inside turns; {mid_turn} conversations "
          "with a turn split by a push")
    assert checked == int(mask[:, 1:].sum()) and mid_turn > 0, (checked, mid_turn)
