"""Rollout engines on a pool of their own (issue #23: split placement, weight sync across pools, one-step-off).

The demo's GRPO on the addition task, on the test session's Ray cluster:

* synchronous, policy TP2 on two processes and two embedded rollout engines on two other processes, against
  the same run colocated (the engines inside the policy's processes): every metric but timings, memory and
  the resharding traffic equal step for step (1e-5 relative); after each weight sync every rollout replica's
  weights equal the HF conversion of the policy's checkpoint of that version (bit-exact: the offline
  converter, run in a child process forked from the session's fork server, see megarl/testing/dist.py); the
  training model's log-probs of the sampled tokens equal the engines' (``rollout/logprob_abs_diff`` < 1e-5);
* one-step-off: every trained sample is at most one version old (0 on the first step and the first after a
  resume), the next step's generation overlaps this step's update in the workers' trace spans, a run
  stopped by a failure after its checkpoint resumes with the prompts of the step it lost and learns
  (reward up 0.2 within 150 steps, against the run's own first steps);
* fully asynchronous, drop mode, eta = 2, partial rollouts (2 tokens per call, responses of 6), a trainer
  slowed down by a callback: no sample trains more than 2 versions behind, stale groups are dropped and
  counted, responses are continued across weight pushes, and every token's rollout log-prob equals HF
  transformers' log-prob of it under the weights of the version it was recorded with (the policy's
  checkpoints converted offline, fp32, 1e-5): the behaviour log-probs the loss corrects with are exact;
* fully asynchronous, wait mode, eta = 1: a run that fails after its checkpoint resumes with consistent
  version accounting (lag 0 on the first step of each run, never above 1) and the prompts the lost steps drew.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import multiprocessing
import threading
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.dist, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_addition_tiny" / "config.yaml"
NOT_COMPARED = ("timing/", "throughput/", "memory/", "reshard/", "rollout/sleep_frees_memory")
ROLLOUT_POOL = {"cluster.pools.gen.devices_per_node": 2, "cluster.placement.rollout": "gen"}


def _config(task, out, extra):
    from megarl.config.train import load_config

    overrides = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
                 "trainer.output_dir": out, "trainer.tensorboard": "false", "trainer.val_every": 0} | extra
    return load_config(EXAMPLE, [f"{k}={v}" for k, v in overrides.items()])


class _Recorder:
    """Per step: the version and prompts of the rows trained on, and (split runs) each rollout replica's
    weights right after the step's weight sync."""

    def __init__(self, engine_weights: bool = False) -> None:
        self.trainer = None
        self.engine_weights = engine_weights
        self.weights: dict[int, list[dict[str, torch.Tensor]]] = {}
        self.versions: dict[int, torch.Tensor] = {}
        self.prompts: dict[int, list[tuple[int, ...]]] = {}

    def on_stage_end(self, stage, step, batch):
        if stage != "rollout":
            return
        from megarl.roles.split import RolloutRole  # noqa: F401 - the role the helper runs on
        from megarl.testing.roles import rollout_engine_state

        if self.engine_weights:
            self.weights[step] = self.trainer.cluster.rollout.all(rollout_engine_state)
        self.versions[step] = batch["policy_version"].clone()
        first = batch["response_mask"].argmax(-1)  # prompt tokens: the columns before the response
        self.prompts[step] = sorted({tuple(row[:n].tolist()) for row, n in zip(batch["input_ids"], first,
                                                                                strict=True)})

    def on_step_end(self, step, metrics):
        pass


def _fit(cfg, recorder=None):
    from megarl.trainer.trainer import Trainer

    trainer = Trainer(cfg, (recorder,) if recorder else ())
    if recorder is not None:
        recorder.trainer = trainer
    try:
        return trainer.fit(), {n: [c.pid for c in g.contexts] for n, g in trainer.cluster.placement.groups.items()}
    finally:
        trainer.close()


def _hf_weights(model_dirs: list[Path]) -> list[dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return [{k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()} for d in model_dirs]


def _convert_all(pairs: list[tuple[str, str]]) -> None:
    from megarl.checkpoint.convert import convert_megatron_to_hf

    for src, dst in pairs:
        convert_megatron_to_hf(src, dst)


def test_rollout_pool_matches_the_colocated_run(ray_cluster, tmp_path):
    from megarl.testing.addition import make_task

    task = make_task(tmp_path / "task", train_rows=64, val_rows=8)
    small = {"trainer.total_steps": 3, "data.batch_size": 4, "rollout.sampling.n": 4, "trainer.save_every": 1,
             "trainer.keep_checkpoints": 5}
    colocated, colocated_pids = _fit(_config(task, tmp_path / "colocated", small))
    recorder = _Recorder(engine_weights=True)
    split, pids = _fit(_config(task, tmp_path / "split", small | ROLLOUT_POOL), recorder)
    assert len(colocated_pids) == 1 and set(pids) == {"main", "gen"}
    assert len(pids["main"]) == len(pids["gen"]) == 2 and not set(pids["main"]) & set(pids["gen"])

    for step, (ours, ref) in enumerate(zip(split, colocated, strict=True), start=1):
        keys = [k for k in ref if not k.startswith(NOT_COMPARED)]
        assert set(keys) <= set(ours)
        for k in keys:
            assert math.isclose(ours[k], ref[k], rel_tol=1e-5, abs_tol=1e-7), (step, k, ours[k], ref[k])
        assert ours["rollout/logprob_abs_diff"] < 1e-5
        assert ours["reshard/bytes_received"] > 0 and ours["async/version_lag_max"] == 0
        assert torch.equal(recorder.versions[step], torch.full_like(recorder.versions[step], step - 1))

    # each version's weights, independently: the HF model (version 0), then the offline converter on the
    # policy's checkpoint of steps 1 and 2 (versions 1, 2: synced at the start of steps 2, 3)
    ckpts = tmp_path / "split" / "checkpoints"
    pairs = [(str(ckpts / f"step_{v:06d}" / "policy"), str(tmp_path / f"hf_v{v}")) for v in (1, 2)]
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver")) as pool:
        pool.submit(_convert_all, pairs).result()
    references = _hf_weights([task / "model"] + [Path(dst) for _, dst in pairs])
    for step, replicas in recorder.weights.items():
        want = references[step - 1]
        assert len(replicas) == 2
        for replica in replicas:
            names = set(replica) - {"lm_head.weight"} if "lm_head.weight" not in want else set(replica)
            assert names == set(want), (step, sorted(set(replica) ^ set(want)))
            for name in want:
                assert torch.equal(replica[name], want[name].float()), (step, name)
    assert not torch.equal(references[0]["model.embed_tokens.weight"], references[2]["model.embed_tokens.weight"])


class _StopAt:
    def __init__(self, step):
        self.step = step

    def on_stage_end(self, stage, step, batch):
        pass

    def on_step_end(self, step, metrics):
        if step == self.step:
            raise RuntimeError(f"injected failure after step {step}")


class _Tracing:
    """Records every worker's spans during steps ``first..last``."""

    def __init__(self, first, last):
        self.first, self.last, self.trainer, self.spans = first, last, None, []

    def on_stage_end(self, stage, step, batch):
        pass

    def on_step_end(self, step, metrics):
        groups = self.trainer.cluster.placement.groups.values()
        if step == self.first - 1:
            for g in groups:
                g.set_tracing(True)
        elif step == self.last:
            self.spans = [(g.name, e) for g in groups for events in g.drain_trace() for e in events]
            for g in groups:
                g.set_tracing(False)


def test_one_step_off_overlaps_generation_with_training_resumes_and_learns(ray_cluster, tmp_path):
    from megarl.data.prompts import PromptSampler
    from megarl.testing.addition import make_task
    from megarl.trainer.trainer import Trainer

    task = make_task(tmp_path / "task", train_rows=256, val_rows=8)
    one_pool_each = {"cluster.pools.main.devices_per_node": 1, "cluster.pools.main.tp": 1,
                     "cluster.pools.gen.devices_per_node": 1, "cluster.placement.rollout": "gen",
                     "rollout.schedule": "one_step_off", "trainer.total_steps": 60, "trainer.save_every": 20,
                     # decoding 4 rows at a time makes a generation (~150 ms) outlast the trainer's stages before
                     # the update (~60 ms), so that the overlap is visible with one-token responses
                     "rollout.engine.max_batch_size": 4}
    cfg = _config(task, tmp_path / "run", one_pool_each)

    # first run: fails after step 25 (checkpoint of step 20 written); its steps are traced around step 10
    first = _Recorder()
    tracing = _Tracing(9, 11)
    trainer = Trainer(cfg, (first, tracing, _StopAt(25)))
    first.trainer = tracing.trainer = trainer
    try:
        with pytest.raises(RuntimeError, match="injected failure after step 25"):
            trainer.fit()
    finally:
        trainer.close()
    assert [int(m["step"]) for m in _metrics(tmp_path / "run")] == list(range(1, 26))

    # second run: resumes from step 20 and finishes
    second = _Recorder()
    resumed, _ = _fit(cfg, second)
    assert len(resumed) == 40

    # version accounting: lag 0 on the first step of each run, 1 on every other
    for rec, start in ((first, 1), (second, 21)):
        for step, versions in rec.versions.items():
            assert torch.equal(versions, torch.full_like(versions, step - 1 - (step != start))), step
    # the resumed run regenerates the prompts drawn ahead for step 21 by the failed run: the sampler's 21st draw
    sampler = PromptSampler(256, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
    draws = [sampler.next_batch(cfg.data.batch_size) for _ in range(22)]
    from megarl.data.prompts import load_prompts
    from megarl.trainer.trainer import _load_tokenizer

    data = load_prompts(cfg.data.train, cfg.data, _load_tokenizer(cfg.model.tokenizer or str(task / "model")))
    for step in (21, 22):
        want = sorted({tuple(r.input_ids) for r in data.select(draws[step - 1])})
        assert second.prompts[step] == want, step

    # overlap: a generation of the rollout pool runs while an update of the policy's pool runs
    def windows(group, name):
        return [(e["ts"], e["ts"] + e["dur"]) for g, e in tracing.spans if g == group and e["name"] == name]

    generate, update = windows("gen", "rollout.generate"), windows("main", "policy.update")
    assert generate and update
    assert any(g0 < u1 and u0 < g1 for g0, g1 in generate for u0, u1 in update)

    # learning, over the whole run (the resumed run's metrics continue the first one's)
    rewards = [m["reward/mean"] for m in _metrics(tmp_path / "run")]
    assert len(rewards) == 60
    assert sum(rewards[-10:]) / 10 - sum(rewards[:10]) / 10 >= 0.2, rewards
    lag = [m["async/version_lag_max"] for m in _metrics(tmp_path / "run")]
    assert lag[0] == 0 and lag[20] == 0 and set(lag[1:20] + lag[21:]) == {1.0}



# ------------------------------------------------------------------------------- fully asynchronous

ASYNC = {"cluster.pools.main.devices_per_node": 1, "cluster.pools.main.tp": 1,
         "cluster.pools.gen.devices_per_node": 1, "cluster.placement.rollout": "gen", "rollout.schedule": "async"}


class _Rows(_Recorder):
    """Also keeps every trained row's tokens, per-token rollout log-probs and versions; in each of the first
    ``slow_steps`` steps it holds the trainer until the producer has filled its buffer (a slow trainer)."""

    def __init__(self, slow_steps=0):
        super().__init__()
        self.slow_steps, self.rows = slow_steps, []

    def on_stage_end(self, stage, step, batch):
        super().on_stage_end(stage, step, batch)
        if stage == "rollout":
            for i in range(len(batch)):
                n = int(batch["attention_mask"][i].sum())
                self.rows.append((batch["input_ids"][i, :n].clone(), batch["response_mask"][i, :n].bool(),
                                  batch["rollout_log_probs"][i, :n].clone(), batch["rollout_versions"][i, :n].clone()))
            producer = self.trainer.source.producer
            capacity = producer.config.buffer_batches * producer.batch_size
            deadline = time.monotonic() + 120
            while step <= self.slow_steps and len(producer.buffer) < capacity and time.monotonic() < deadline:
                time.sleep(0.05)


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_async_drop_mode_with_partial_rollouts_bounds_staleness_and_keeps_exact_log_probs(ray_cluster, tmp_path):
    from transformers import AutoModelForCausalLM

    from megarl.testing.addition import make_task

    task = make_task(tmp_path / "task", train_rows=128, val_rows=8)
    steps = 12
    cfg = _config(task, tmp_path / "run", ASYNC | {
        "rollout.asynchronous.max_staleness": 2, "rollout.asynchronous.on_stale": "drop",
        "rollout.asynchronous.buffer_batches": 4, "rollout.asynchronous.partial_chunk_tokens": 2,
        "rollout.max_new_tokens": 24, "rollout.stop_at_eos": "false", "data.batch_size": 4, "rollout.sampling.n": 4,
        # slow generation (one row at a time, 12 calls per response): once the trainer runs free, a wave of
        # responses outlasts a step several times, so that each weight push interrupts the wave in flight
        "rollout.engine.max_batch_size": 1,
        "trainer.total_steps": steps, "trainer.save_every": 1, "trainer.keep_checkpoints": steps + 1})
    # steps 1-3 wait for a full buffer (4 waves): step 4, at version 3, meets two waves of version 0 (dropped)
    recorder = _Rows(slow_steps=3)
    history, _ = _fit(cfg, recorder)
    assert len(history) == steps

    lag_max = [m["async/version_lag_max"] for m in history]
    assert lag_max[:4] == [0, 1, 2, 2] and max(lag_max) <= 2
    assert [m["async/dropped_groups"] for m in history[:4]] == [0, 0, 0, 8]  # staler than 2: dropped, counted
    assert sum(m["async/interrupted_responses"] for m in history) > 0
    for step, versions in recorder.versions.items():
        assert int((step - 1 - versions).max()) <= 2, step

    # every token's rollout log-prob against HF transformers at the weights of its version
    versions = sorted({int(v) for _, mask, _, vs in recorder.rows for v in vs[mask]})
    assert len(versions) > 3
    ckpts = tmp_path / "run" / "checkpoints"
    pairs = [(str(ckpts / f"step_{v:06d}" / "policy"), str(tmp_path / f"hf_v{v}")) for v in versions if v > 0]
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver")) as pool:
        pool.submit(_convert_all, pairs).result()
    models = {v: AutoModelForCausalLM.from_pretrained(task / "model" if v == 0 else tmp_path / f"hf_v{v}",
                                                      torch_dtype=torch.float32).eval() for v in versions}
    mixed = checked = 0
    with torch.no_grad():
        for ids, mask, rollout_lp, token_versions in recorder.rows:
            mixed += len(set(token_versions[mask].tolist())) > 1
            for v in set(token_versions[mask].tolist()):
                logits = models[v](ids[None]).logits[0].float()  # temperature 1
                lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None]).squeeze(-1)  # token i from i-1
                sel = mask[1:] & (token_versions[1:] == v)
                gap = (lp[sel] - rollout_lp[1:][sel]).abs()
                assert gap.max() < 1e-5, (v, gap.max())
                checked += int(sel.sum())
    assert mixed > 0 and checked == sum(int(m.sum()) for _, m, _, _ in recorder.rows)


def test_async_wait_mode_resumes_with_consistent_versions(ray_cluster, tmp_path):
    from megarl.data.prompts import PromptSampler, load_prompts
    from megarl.testing.addition import make_task
    from megarl.trainer.trainer import Trainer, _load_tokenizer

    task = make_task(tmp_path / "task", train_rows=256, val_rows=8)
    cfg = _config(task, tmp_path / "run", ASYNC | {
        "rollout.asynchronous.max_staleness": 1, "trainer.total_steps": 12, "trainer.save_every": 8})

    first = _Recorder()
    trainer = Trainer(cfg, (first, _StopAt(10)))
    first.trainer = trainer
    try:
        with pytest.raises(RuntimeError, match="injected failure after step 10"):
            trainer.fit()
    finally:
        trainer.close()
    second = _Recorder()
    resumed, _ = _fit(cfg, second)
    assert len(resumed) == 4

    # version accounting: lag 0 on the first step of each run, never above max_staleness = 1
    for rec, start in ((first, 1), (second, 9)):
        lags = {step: (step - 1 - v) for step, v in rec.versions.items()}
        assert int(lags[start].max()) == 0
        assert all(int(lag.min()) >= 0 and int(lag.max()) <= 1 for lag in lags.values())
        assert any(int(lag.max()) == 1 for lag in lags.values())  # it did run ahead
    # the resumed run redraws the wave of step 9 (drawn, not trained, by the failed run): the sampler's 9th draw
    sampler = PromptSampler(256, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
    draws = [sampler.next_batch(cfg.data.batch_size) for _ in range(9)]
    data = load_prompts(cfg.data.train, cfg.data, _load_tokenizer(str(task / "model")))
    assert second.prompts[9] == sorted({tuple(r.input_ids) for r in data.select(draws[8])})
    assert [int(m["step"]) for m in _metrics(tmp_path / "run")] == list(range(1, 13))



class _Stages:
    """The rows of each step at the stages the checks need (cloned: later stages change them)."""

    def __init__(self) -> None:
        self.at: dict[tuple[str, int], list[tuple[dict, dict]]] = {}

    def on_stage_end(self, stage, step, batch):
        if stage in ("baseline", "advantages", "step"):
            self.at.setdefault((stage, step), []).append(
                ({k: batch[k].clone() for k in batch.tensors.keys()}, dict(batch.non_tensors)))  # noqa: SIM118

    def on_step_end(self, step, metrics):
        pass


class _HeldStages(_Stages):
    """:class:`_Stages` that also makes a weight push land inside responses in flight, ``times`` times in the first
    ``steps`` steps: after a producer's generation call returns (its responses unfinished: one token per call of
    12), while the trainer holds all of its step's groups (it trains, then pushes at the start of the next step
    without waiting for the producer), the producer waits for that push. Timing alone does not guarantee it: a
    wave may finish before the next push under a different load."""

    def __init__(self, times: int, steps: int) -> None:
        super().__init__()
        self.times, self.steps, self.held, self.ready, self.done = times, steps, 0, 0, 0

    def on_stage_end(self, stage, step, batch):
        super().on_stage_end(stage, step, batch)
        if stage == "advantages":
            self.ready = step

    def on_step_end(self, step, metrics):
        self.done = step

    @property
    def trainer(self):
        return self._trainer

    @trainer.setter
    def trainer(self, trainer) -> None:  # set by _fit before the run starts
        self._trainer, extend = trainer, trainer.cluster.extend_async
        recorder = self

        class Held:
            def __init__(self, call) -> None:
                self.call = call

            def result(self):
                out = self.call.result()
                producer = trainer.source.producer
                if (threading.current_thread().name == "megarl-rollout-producer" and recorder.held < recorder.times
                        and recorder.ready == recorder.done + 1 <= recorder.steps):
                    version, deadline = producer.engine_version, time.monotonic() + 60
                    while producer.engine_version == version and time.monotonic() < deadline:
                        time.sleep(0.01)
                    recorder.held += 1
                return out

        trainer.cluster.extend_async = lambda *args, **kwargs: Held(extend(*args, **kwargs))


def _greedy_baselines_check(stages: _Stages, step: int, b: dict, task: Path, reward=lambda rule, seq: rule) -> None:
    """ReMax: each row's baseline is the reward of its prompt's greedy response (one per group of each take,
    generated beside it): ``reward`` of the task's integer_answer rule applied here and the response's row."""
    from megarl.data.tokenizer import load_tokenizer
    from megarl.rewards.rules import IntegerAnswerReward

    tokenizer, rule = load_tokenizer(str(task / "model")), IntegerAnswerReward()
    truth = {r["prompt"]: r for r in map(json.loads, (task / "train.jsonl").read_text().splitlines())}

    def prompt_of(ids, resp_mask):
        return tokenizer.decode(ids[: int(resp_mask.float().argmax())].tolist(), skip_special_tokens=True)

    greedy: dict[str, set[float]] = {}  # a prompt drawn twice in a step may have two greedy responses
    for g, _ in stages.at["baseline", step]:
        for ids, resp_mask in zip(g["input_ids"], g["response_mask"].bool(), strict=True):
            prompt = prompt_of(ids, resp_mask)
            text = tokenizer.decode(ids[resp_mask].tolist(), skip_special_tokens=True)
            score = reward(rule(prompt, text, truth[prompt]), ids[: int(resp_mask.nonzero().max()) + 1])
            greedy.setdefault(prompt, set()).add(round(score, 6))
    mask = b["response_mask"].bool()
    for i in range(len(b["baseline_scores"])):
        assert round(b["baseline_scores"][i].item(), 6) in greedy[prompt_of(b["input_ids"][i], mask[i])], (step, i)


@pytest.mark.parametrize("schedule", ["one_step_off", "async"])
def test_overlapped_dapo(ray_cluster, tmp_path, schedule):
    """Issue #42: DAPO one step off and fully asynchronous (wait mode, staleness bound 2, partial rollouts of one token
    per call): dynamic sampling, the overlong penalty and overlong filtering. At every step: no row is older than
    the schedule allows (1, 2) and every token's version lies between its row's and the trained one; each trained
    group's rewards differ and the counts add up (sampled = kept + dropped over the buffer takes); the overlong
    penalty of each row is DAPO's formula by hand; the rows cut at max_new_tokens leave the loss. (Its learning:
    examples/dapo_addition_tiny_async.)"""
    from megarl.data.tokenizer import load_tokenizer
    from megarl.testing.addition import make_task

    task = make_task(tmp_path / "task", train_rows=256, val_rows=8)
    steps, max_new, buffer, factor = 5, 3, 2, 0.5
    cfg = _config(task, tmp_path / "run", ASYNC | {
        "rollout.schedule": schedule, "rollout.asynchronous.max_staleness": 2,
        "rollout.asynchronous.partial_chunk_tokens": 1,
        "rollout.max_new_tokens": max_new, "data.batch_size": 4, "rollout.sampling.n": 4,
        "algorithm.dynamic_sampling.max_extra_rounds": 3, "algorithm.dynamic_sampling.on_short": "train",
        "algorithm.mask_truncated": "true", "reward.overlong_buffer": buffer,
        "reward.overlong_penalty_factor": factor, "trainer.total_steps": steps, "trainer.save_every": 0})
    stages = _Stages()
    history, _ = _fit(cfg, stages)
    assert len(history) == steps
    eos = load_tokenizer(str(task / "model")).eos_token_id
    cut = kept = 0
    for step, m in enumerate(history, start=1):
        assert m["dynamic/groups_sampled"] == m["dynamic/groups_kept"] + m["dynamic/groups_dropped"]
        assert m["rollout/push_logprob_abs_diff"] < 1e-5  # parity at every version: each push probed on arrival
        if not m["dynamic/groups_trained"]:  # no group with differing rewards in any take: the update is skipped
            continue
        [(b, non)] = stages.at["advantages", step]
        [(stepped, _)] = stages.at["step", step]
        assert m["async/version_lag_max"] <= cfg.rollout.max_version_lag
        assert m["dynamic/groups_trained"] == min(cfg.data.batch_size, m["dynamic/groups_kept"])
        assert m["dynamic/groups_sampled"] == m["dynamic/groups_kept"] + m["dynamic/groups_dropped"]
        for g in b["prompt_uid"].unique():
            assert b["scores"][b["prompt_uid"] == g].unique().numel() > 1, (step, int(g))
        lengths = b["response_lengths"].float()
        by_hand = -factor * ((lengths - (max_new - buffer)).clamp(min=0) / buffer).clamp(max=1)
        assert torch.allclose(b["overlong_scores"], by_hand)
        mask = b["response_mask"].bool()
        for i, reason in enumerate(non["finish_reasons"]):
            assert reason == "stop" or int(lengths[i]) == max_new  # cut at max_new_tokens (an eos there: stopped)
            assert reason == "length" or int(b["input_ids"][i][mask[i]][-1]) == eos
            assert torch.equal(stepped["response_mask"][i].bool(), mask[i] & (reason != "length"))
            cut, kept = cut + (reason == "length"), kept + (reason != "length")
        versions = b["rollout_versions"][mask]
        row_versions = b["policy_version"][:, None].expand_as(mask)[mask]
        assert (versions >= row_versions).all() and (versions <= step - 1).all()
    assert cut and kept
    assert sum(m["dynamic/groups_dropped"] for m in history) > 0
    assert max(m.get("async/version_lag_max", 0) for m in history) == cfg.rollout.max_version_lag  # ran ahead


def test_async_moe_router_replay_and_remax_with_partial_rollouts(ray_cluster, tmp_path):
    """Issue #42: router replay and ReMax under the fully asynchronous schedule (tiny Qwen3-MoE, 4 experts top 2,
    policy at EP2, its rollout engine on a pool of its own; wait mode, eta = 1, partial rollouts of one token per
    call over responses of 12, generated one row at a time; the pushes of versions 1 and 2 are made to land in the
    middle of the responses in flight: :class:`_HeldStages`). Each row's reward-model score equals
    transformers' (a tiny random Qwen2 classifier, its last token); each row's ReMax baseline is the reward (rule
    and reward model) of its prompt's greedy response, generated (and continued) beside its group. Every row of
    every step carries, at every position the engine fed, the top-2 experts transformers' router picks over the row
    under the weights of the version that first fed that position (the initial model or the policy's checkpoint of
    that version, converted; the last position: experts 0..k-1, never fed); the replay routes every token
    of every step to the rollout's experts (``actor/moe_replay_mismatch`` 0); at step 1 (every row fresh) the
    replayed training forward reproduces the rollout's log-probs (< 1e-5), and every push's probe on the rollout
    replica is within 1e-5. A dense distillation teacher scores every row: its log-prob of every response token
    equals a transformers forward of the teacher over the row (1e-5), on rows whose tokens span several versions
    too."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from megarl.config.train import load_config
    from megarl.testing.addition import make_reward_model, make_task

    task = make_task(tmp_path / "task", train_rows=64, val_rows=8, num_experts=4, top_k=2)
    teacher = make_task(tmp_path / "teacher", train_rows=1, val_rows=1, seed=1) / "model"
    rm_dir, fw, mw = make_reward_model(tmp_path / "rm"), 0.5, 0.3
    overrides = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
                 "trainer.output_dir": tmp_path / "run", "trainer.tensorboard": "false", "trainer.val_every": 0,
                 "trainer.save_every": 1, "trainer.keep_checkpoints": 3, "trainer.total_steps": 3,
                 "cluster.pools.gen.devices_per_node": 1,
                 "cluster.placement.rollout": "gen", "rollout.schedule": "async",
                 "rollout.asynchronous.max_staleness": 1, "rollout.asynchronous.partial_chunk_tokens": 1,
                 "rollout.max_new_tokens": 12, "rollout.stop_at_eos": "false", "data.batch_size": 4,
                 "rollout.sampling.n": 4, "algorithm.kl_loss_coef": 0, "algorithm.advantage.estimator": "remax",
                 "reward.function_weight": fw, "reward_model.model.path": rm_dir, "reward_model.weight": mw,
                 "teacher.model.path": teacher, "teacher.kl_coef": 0.1,
                 "rollout.engine.max_batch_size": 1}  # slow generation: each push interrupts the wave in flight
    example = EXAMPLE.parents[1] / "grpo_addition_moe" / "config.yaml"
    cfg = load_config(example, [f"{k}={v}" for k, v in overrides.items()])
    stages = _HeldStages(times=2, steps=2)  # pushes of versions 1 and 2 inside responses in flight
    history, _ = _fit(cfg, stages)
    assert len(history) == 3 and stages.held == 2
    rm = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    teacher_model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()

    def rm_score(seq):  # the reward model's score of a sequence: its last token's
        with torch.no_grad():
            return rm.score(rm.model(seq[None]).last_hidden_state)[0, -1, 0].item()

    # the policy's weights of each version: the initial model, then its checkpoints of steps 1 and 2, converted
    ckpts = tmp_path / "run" / "checkpoints"
    pairs = [(str(ckpts / f"step_{v:06d}" / "policy"), str(tmp_path / f"hf_v{v}")) for v in (1, 2)]
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver")) as pool:
        pool.submit(_convert_all, pairs).result()
    models = {v: AutoModelForCausalLM.from_pretrained(task / "model" if v == 0 else tmp_path / f"hf_v{v}",
                                                      dtype=torch.float32).eval() for v in (0, 1, 2)}
    checked = spanning = mixed = 0
    for step, m in enumerate(history, start=1):
        assert m["actor/moe_replay_mismatch"] == 0 and m["rollout/push_logprob_abs_diff"] < 1e-5
        assert step > 1 or m["rollout/logprob_abs_diff"] < 1e-5
        [(b, _)] = stages.at["advantages", step]
        routed, mask = b["routed_experts"], b["response_mask"].bool()
        assert routed.shape[:2] == b["input_ids"].shape and routed.shape[2:] == (2, 2)
        _greedy_baselines_check(stages, step, b, task, reward=lambda rule, seq: fw * rule + mw * rm_score(seq))
        lengths = b["attention_mask"].sum(-1).long().tolist()
        model_scores = [rm_score(b["input_ids"][i, :n]) for i, n in enumerate(lengths)]
        assert b["model_scores"].tolist() == pytest.approx(model_scores, abs=1e-5)
        # the teacher's log-prob of every response token given the row before it, as transformers computes it
        with torch.no_grad():
            logits = teacher_model(b["input_ids"], attention_mask=b["attention_mask"].long()).logits.double()
        expected = torch.log_softmax(logits[:, :-1], -1).gather(-1, b["input_ids"][:, 1:, None])[..., 0]
        assert (b["teacher_log_probs"][:, 1:].double() - expected)[mask[:, 1:]].abs().max() < 1e-5
        assert "distill/reverse_kl" in m
        spanning += sum(len(set(v[r].tolist())) > 1 for v, r in zip(b["rollout_versions"], mask, strict=True))
        # every fed position's experts: transformers' router under the weights of the call that first fed it (the
        # prompt's: the call that sampled the first token; response token j's: the one that sampled token j + 1)
        for i in range(len(routed)):
            fed, start = int(b["attention_mask"][i].sum()) - 1, int(mask[i].nonzero()[0])
            first_fed = b["rollout_versions"][i, torch.clamp(torch.arange(fed) + 1, min=start)]
            for v in first_fed.unique().tolist():
                with torch.no_grad():
                    logits = models[v](b["input_ids"][i:i + 1, : fed + 1], output_router_logits=True).router_logits
                for layer in range(2):
                    expected = logits[layer].topk(2, dim=-1).indices.sort(-1).values[:fed][first_fed == v]
                    got = routed[i, :fed, layer].long().sort(-1).values[first_fed == v]
                    assert torch.equal(got, expected), (step, i, layer, v)
            assert (routed[i, fed] == torch.arange(2, dtype=routed.dtype)).all()
            checked += 1
            mixed += first_fed.unique().numel() > 1
    assert checked == 3 * 16 and mixed  # every row; some routed by two versions
    assert spanning  # rows continued across a push were among those the teacher's log-probs were checked on
