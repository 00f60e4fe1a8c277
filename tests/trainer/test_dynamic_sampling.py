"""DAPO's dynamic sampling and overlong filtering through the trainer (issue #22, item 2), CPU, local launcher.

References: the trained batch itself (every group's rewards must differ, read from the batch the
``advantages`` stage sees), the counts' own arithmetic (sampled = kept + dropped), and plain GRPO on the
same config without dynamic sampling: at an equal number of trained samples, the dynamic run's reward
must be at least as high. Overlong filtering: the rows cut at ``max_new_tokens`` (finish reason
``length``) leave the loss, and the policy loss equals a hand computation over the other rows.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.dist, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dapo_addition_tiny" / "config.yaml"
STEPS = 40


class Recorder:
    def __init__(self) -> None:
        self.trained: dict[int, dict[str, torch.Tensor]] = {}

    def on_stage_end(self, stage, step, batch):
        if stage == "advantages":
            self.trained[step] = {k: batch[k].clone() for k in ("scores", "prompt_uid")}

    def on_step_end(self, step, metrics):
        pass


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megarl.config.train import load_config
    from megarl.testing.addition import make_task
    from megarl.trainer.trainer import run as train

    root = tmp_path_factory.mktemp("dapo")
    task = make_task(root / "task")
    base = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
            "trainer.tensorboard": "false", "trainer.total_steps": STEPS, "trainer.save_every": 0,
            "trainer.val_every": 0, "cluster.launcher": "local", "cluster.pools.main.devices_per_node": 1,
            "cluster.pools.main.tp": 1}
    out = {}
    for name, extra in {"dynamic": {}, "grpo": {"algorithm.dynamic_sampling": "null"}}.items():
        overrides = base | extra | {"trainer.output_dir": root / name}
        cfg = load_config(EXAMPLE, [f"{k}={v}" for k, v in overrides.items()])
        recorder = Recorder()
        out[name] = (train(cfg, callbacks=(recorder,)), recorder, cfg)
    return out


def test_every_trained_group_has_differing_rewards_and_the_counts_add_up(runs):
    history, recorder, cfg = runs["dynamic"]
    n, want = cfg.rollout.sampling.n, cfg.data.batch_size
    assert cfg.algorithm.dynamic_sampling is not None
    for step, m in enumerate(history, start=1):
        trained = recorder.trained[step]
        groups = trained["prompt_uid"].unique()
        assert len(groups) == m["dynamic/groups_trained"] and len(trained["scores"]) == len(groups) * n
        for g in groups:
            scores = trained["scores"][trained["prompt_uid"] == g]
            assert len(scores) == n and scores.max() > scores.min(), (step, int(g))
        assert m["dynamic/groups_sampled"] == m["dynamic/groups_kept"] + m["dynamic/groups_dropped"]
        assert m["dynamic/groups_sampled"] == m["dynamic/rounds"] * want
        assert m["dynamic/groups_trained"] == min(want, m["dynamic/groups_kept"])
        assert m["dynamic/short"] == float(m["dynamic/groups_kept"] < want)
    assert sum(m["dynamic/groups_dropped"] for m in history) > 0  # the filter had something to do


def test_learns_at_least_as_fast_per_trained_sample_as_grpo(runs):
    n = runs["dynamic"][2].rollout.sampling.n
    curves = {}
    for name, (history, _, cfg) in runs.items():
        trained = [m.get("dynamic/groups_trained", cfg.data.batch_size) * n for m in history]
        cumulative = [sum(trained[: i + 1]) for i in range(len(trained))]
        curves[name] = (cumulative, [m["reward/mean"] for m in history])
    budget = curves["dynamic"][0][-1]  # what the dynamic run trained on in all
    window = {}
    for name, (cumulative, rewards) in curves.items():
        within = [r for c, r in zip(cumulative, rewards, strict=True) if c <= budget]
        window[name] = statistics.mean(within[-10:])
        print(f"{name}: {len(within)} steps within {budget} trained samples, reward of the last 10: "
              f"{window[name]:.3f}; first 10 steps {statistics.mean(rewards[:10]):.3f}")
    assert window["dynamic"] >= window["grpo"]
    assert window["dynamic"] > statistics.mean(curves["dynamic"][1][:10]) + 0.15


class StepRecorder:
    def __init__(self) -> None:
        self.batches: dict[int, dict] = {}

    def on_stage_end(self, stage, step, batch):
        if stage == "step":  # after the updates: the mask the policy loss saw
            self.batches[step] = {"response_mask": batch["response_mask"].clone(),
                                  "advantages": batch["advantages"].clone(),
                                  "finish_reasons": list(batch["finish_reasons"]),
                                  **{k: batch[k].clone() for k in ("overlong_scores", "scores", "function_scores",
                                                                   "response_lengths") if k in batch}}

    def on_step_end(self, step, metrics):
        pass


def test_truncated_responses_leave_the_policy_loss(tmp_path):
    """One mini-batch (the update's own forward is pi_old: ratio 1), so PPO-clip's token-mean loss is
    ``-sum(A) / N`` over the tokens left; the random model ends a few responses with EOS ("stop"). With DAPO's soft
    overlong penalty on as well (responses of up to 3 tokens, buffer 2, factor 0.5; the sync schedule's cell of
    #42's combinations): each row's penalty by hand, -0.5 x min(1, max(0, length - 1) / 2), added to its reward."""
    from megarl.config.train import load_config
    from megarl.testing.addition import make_task
    from megarl.trainer.trainer import run as train

    task = make_task(tmp_path / "task", train_rows=64, val_rows=8)
    overrides = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
                 "trainer.tensorboard": "false", "trainer.total_steps": 3, "trainer.save_every": 0,
                 "trainer.val_every": 0, "cluster.launcher": "local", "cluster.pools.main.devices_per_node": 1,
                 "cluster.pools.main.tp": 1, "trainer.output_dir": tmp_path / "out", "algorithm.mask_truncated": "true",
                 "algorithm.dynamic_sampling": "null", "algorithm.mini_batches": 1, "rollout.sampling.temperature": 3.0,
                 "rollout.max_new_tokens": 3, "reward.overlong_buffer": 2, "reward.overlong_penalty_factor": 0.5}
    cfg = load_config(EXAMPLE, [f"{k}={v}" for k, v in overrides.items()])
    recorder = StepRecorder()
    history = train(cfg, callbacks=(recorder,))
    stopped = 0
    for step, m in enumerate(history, start=1):
        b = recorder.batches[step]
        cut = torch.tensor([f == "length" for f in b["finish_reasons"]])
        assert (b["response_mask"][cut] == 0).all() and (b["response_mask"][~cut].sum(-1) > 0).all()
        assert m["response/truncated_masked_frac"] == pytest.approx(cut.float().mean().item())
        mask = b["response_mask"].double()
        expected = -(b["advantages"].double() * mask).sum().item() / mask.sum().item()
        assert m["actor/pg_loss"] == pytest.approx(expected, abs=1e-5)
        stopped += int((~cut).sum())
        lengths = b["response_lengths"].double()
        by_hand = -0.5 * torch.clamp((lengths - 1) / 2, 0, 1)
        assert torch.allclose(b["overlong_scores"].double(), by_hand)
        assert torch.allclose(b["scores"], b["function_scores"] + b["overlong_scores"])
        assert set(lengths.tolist()) > {3.0}  # penalised and unpenalised lengths both occur
    assert stopped > 0  # some responses ended with EOS, so the loss had tokens


CONSTANT_REWARD = '''
def score(prompt, response, row):
    return 0.5
'''


@pytest.mark.parametrize("on_short", ["train", "fail"])
def test_a_batch_without_informative_groups_skips_the_update_or_fails(tmp_path, on_short):
    """A reward that never differs: every group is dropped; after the extra rounds the step trains on nothing
    (no update, counted) or stops the run naming the counts, as ``on_short`` says."""
    from megarl.config.train import load_config
    from megarl.testing.addition import make_task
    from megarl.trainer.sources import ShortBatchError
    from megarl.trainer.trainer import run as train

    task = make_task(tmp_path / "task", train_rows=64, val_rows=8)
    (tmp_path / "constant.py").write_text(CONSTANT_REWARD)
    overrides = {"model.path": task / "model", "data.train": task / "train.jsonl", "data.val": task / "val.jsonl",
                 "trainer.tensorboard": "false", "trainer.total_steps": 2, "trainer.save_every": 0,
                 "trainer.val_every": 0, "cluster.launcher": "local", "cluster.pools.main.devices_per_node": 1,
                 "cluster.pools.main.tp": 1, "trainer.output_dir": tmp_path / "out", "data.batch_size": 4,
                 "reward.function": f"{tmp_path / 'constant.py'}:score",
                 "algorithm.dynamic_sampling.on_short": on_short, "algorithm.dynamic_sampling.max_extra_rounds": 2}
    cfg = load_config(EXAMPLE, [f"{k}={v}" for k, v in overrides.items()])
    if on_short == "fail":
        with pytest.raises(ShortBatchError, match=r"found 0 prompt groups with differing rewards in 3 rounds \(12 "):
            train(cfg)
        return
    history = train(cfg)
    assert len(history) == 2
    for m in history:
        assert m["dynamic/rounds"] == 3 and m["dynamic/groups_sampled"] == 12 and m["dynamic/groups_dropped"] == 12
        assert m["dynamic/groups_trained"] == 0 and m["dynamic/short"] == 1.0
        assert m["batch/num_sequences"] == 0 and "actor/pg_loss" not in m  # no update
