"""The weight-push parity probe (megarl/rollout/parity.py) and the push deadline (megarl/controller/handles.py).

* the probe's shape rules and each replica's gap, against hand-worked cases;
* the probe's log-prob convention, end to end on a real engine: an EmbeddedEngine loaded with a tiny random Qwen2
  generates the probe of two replicas; HF transformers' teacher-forced ``log_softmax(logits / T)`` of the same tokens
  (float64, T the training temperature) matches every replica (< 1e-5). Negative controls: the same probe sampled
  greedily (T = 1 log-probs, as engines report greedy ones) is off by far more, and an engine holding the weights of
  one version before (a perturbed copy) is caught, naming its replica and the version;
* ``wait_all`` with a deadline of its own: calls still running at it fail at once as lost workers, their groups torn
  down, instead of waiting for the groups' call limit.

CPU only, no processes, ~2 s.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from megarl.controller.handles import PendingCall, WorkerError, wait_all
from megarl.controller.spec import GroupOptions, Timeouts
from megarl.data.batch import Batch
from megarl.errors import ConfigError
from megarl.parallel.layout import ParallelLayout
from megarl.rollout.mismatch import RolloutMismatchError
from megarl.rollout.parity import PushMismatchError, compare, make_probe

# ------------------------------------------------------------------------------------------- the probe


def test_probe_has_one_identical_row_per_replica_within_the_model_length():
    probe = make_probe(3, vocab_size=20, temperature=0.7, max_model_len=9)  # the demo's length: 8 + 1
    assert probe.prompts["prompt_ids"].tolist() == [[6, 13, 1, 8]] * 3  # 1 + (5 + 7i) mod 19, i = 0..3
    assert probe.prompts["prompt_lengths"].tolist() == [4, 4, 4]
    p = probe.params
    assert (p.n, p.temperature, p.max_new_tokens, p.seed is not None) == (1, 0.7, 4, True)
    # every truncation off: the engines' log-probs are then of softmax(logits / T), the training model's
    assert (p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.stop_token_ids) == (1.0, 0, 0.0, 1.0, ())
    # shorter engines: prompt + new tokens fit, at least one of each
    for length, (prompt, new) in {5: (3, 2), 3: (2, 1), 2: (1, 1), None: (4, 4)}.items():
        q = make_probe(1, vocab_size=20, temperature=1.0, max_model_len=length)
        assert (int(q.prompts["prompt_lengths"][0]), q.params.max_new_tokens) == (prompt, new), length
    ids = make_probe(1, vocab_size=3, temperature=1.0, max_model_len=None).prompts["prompt_ids"]
    assert set(ids.flatten().tolist()) <= {1, 2}  # within the vocabulary, padding id 0 left out
    with pytest.raises(ConfigError, match="max_model_len"):
        make_probe(1, vocab_size=20, temperature=1.0, max_model_len=1)
    with pytest.raises(ConfigError, match="temperature"):
        make_probe(1, vocab_size=20, temperature=0.0, max_model_len=None)


def _rows(rollout_lp, replicas, versions, response_mask):
    return Batch.from_dict({"rollout_log_probs": torch.tensor(rollout_lp, dtype=torch.float64),
                            "rollout_replica": torch.tensor(replicas), "policy_version": torch.tensor(versions),
                            "response_mask": torch.tensor(response_mask)})


def test_each_replica_gap_and_the_error_naming_replica_and_version():
    # two replicas (rows in the order the dispatch returned them: replica 1 first), 2 prompt + 3 response tokens
    mask = [[0.0, 0.0, 1.0, 1.0, 1.0]] * 2
    rows = _rows([[0.0, 0.0, -1.0, -2.0, -0.5], [0.0, 0.0, -1.0, -2.0, -0.5]], [1, 0], [7, 7], mask)
    training = torch.tensor([[-9.0, -9.0, -1.3, -2.0, -0.2],  # replica 1: |0.3| + 0 + |0.3| over 3 tokens = 0.2
                             [5.0, 5.0, -1.0, -2.0, -0.5]],  # replica 0: equal on the response (prompt not counted)
                            dtype=torch.float64)
    parity = compare(rows, training, version=7, replicas=2)
    assert parity.per_replica == pytest.approx((0.0, 0.2), abs=1e-12)
    assert parity.worst == (1, pytest.approx(0.2))
    assert parity.metrics()["rollout/push_logprob_abs_diff"] == pytest.approx(0.2)
    assert parity.metrics()["rollout/push_version"] == 7.0
    parity.check(None)  # no limit: reported only
    parity.check(0.25)
    with pytest.raises(PushMismatchError, match=r"rollout replica 1 .* version 7 .* 0\.2 .* replica 0: 0\b"):
        parity.check(0.1)
    assert issubclass(PushMismatchError, RolloutMismatchError)
    with pytest.raises(RolloutMismatchError, match="one row from each of the 2 rollout replicas, found .* \\[1, 1\\]"):
        compare(_rows([[0.0] * 5] * 2, [1, 1], [7, 7], mask), training, version=7, replicas=2)
    with pytest.raises(RolloutMismatchError, match="report versions \\[7, 6\\] right after the push of version 7"):
        compare(_rows([[0.0] * 5] * 2, [1, 0], [7, 6], mask), training, version=7, replicas=2)


def test_probe_log_probs_equal_transformers_at_the_training_temperature_on_every_replica():
    from transformers import AutoModelForCausalLM

    from megarl.rollout import EmbeddedEngine
    from megarl.rollout.rows import generation_rows
    from megarl.testing.tiny import randomize_, tiny_config

    config = tiny_config("qwen2", num_layers=2, vocab_size=300, hidden_size=32, intermediate_size=64, num_heads=4,
                         num_kv_heads=2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, 0)
    model.eval()
    stale = {k: v + 0.02 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) if v.is_floating_point()
             else v for k, v in model.state_dict().items()}  # the weights of "one update before"

    def engine(weights):
        e = EmbeddedEngine(config, pad_token_id=0)
        e.update_weights((k, v.clone()) for k, v in weights.items())
        e.finish_weight_update()
        return e

    def probe_rows(engines, params, probe):
        """What each replica's RolloutRole.probe returns, concatenated in replica order."""
        parts = []
        for r, e in enumerate(engines):
            prompts = probe.prompts.slice(r, r + 1)
            ids = [prompts["prompt_ids"][0, : int(prompts["prompt_lengths"][0])].tolist()]
            b = generation_rows(prompts, ids, [e.generate(ids, params)], 0, {}, 3)
            b.tensors["rollout_replica"] = torch.tensor([r])
            parts.append(b)
        return Batch.concat(parts)

    def transformers_log_probs(rows, temperature):
        with torch.no_grad():
            logits = model(rows["input_ids"], attention_mask=rows["attention_mask"].long()).logits.double()
        lp = torch.log_softmax(logits / temperature, -1)[:, :-1].gather(-1, rows["input_ids"][:, 1:, None])[..., 0]
        return torch.nn.functional.pad(lp, (1, 0))  # token-aligned: entry i is token i's log-prob

    temperature = 0.6
    probe = make_probe(2, vocab_size=300, temperature=temperature, max_model_len=None)
    fresh = [engine(model.state_dict()), engine(model.state_dict())]
    rows = probe_rows(fresh, probe.params, probe)
    assert rows["response_mask"].sum() == 2 * probe.params.max_new_tokens
    parity = compare(rows, transformers_log_probs(rows, temperature), version=3, replicas=2)
    assert max(parity.per_replica) < 1e-5, parity
    parity.check(1e-5)

    # negative control 1: the probe sampled greedily reports T = 1 log-probs, off the training temperature's
    import dataclasses

    greedy = probe_rows(fresh, dataclasses.replace(probe.params, temperature=0.0, seed=None), probe)
    assert min(compare(greedy, transformers_log_probs(greedy, temperature), 3, 2).per_replica) > 1e-2
    # negative control 2: replica 1 holds the previous weights
    rows = probe_rows([fresh[0], engine(stale)], probe.params, probe)
    parity = compare(rows, transformers_log_probs(rows, temperature), version=3, replicas=2)
    assert parity.per_replica[0] < 1e-5 and parity.per_replica[1] > 1e-3, parity
    with pytest.raises(PushMismatchError, match="rollout replica 1 .* version 3"):
        parity.check(1e-4)


# ------------------------------------------------------------------------------------------- the deadline


class _Stuck:
    """GroupLike whose rank ``stuck`` never finishes; gather past a timeout tears the group down as WorkerGroup
    does (lost worker)."""

    def __init__(self, stuck: int, world: int = 2) -> None:
        self.layout = ParallelLayout(dp=world)
        self.options = GroupOptions(timeouts=Timeouts(call_s=3600.0))
        self.stuck, self.alive = stuck, True

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def put(self, obj: Any) -> Any:
        return obj

    def submit(self, role: str, rank: int, method, *args: Any, **kwargs: Any) -> Any:
        return rank

    def gather(self, role: str, futures: dict[int, Any], timeout_s: float | None) -> dict[int, Any]:
        if self.stuck in futures:
            assert timeout_s == 0, "the deadline's teardown waits no longer"
            self.alive = False
            raise WorkerError(f"{role} call did not finish within {timeout_s} s", role=role, rank=None, lost=True,
                              roles=("rollout",))
        return {r: f"done {r}" for r in futures}

    def finished(self, futures: dict[int, Any]) -> list[int]:
        return [r for r in futures if r != self.stuck]


def _ranks(results: dict[int, Any]) -> list[Any]:
    return [results[r] for r in sorted(results)]


def test_wait_all_with_a_deadline_fails_a_stalled_call_as_a_lost_worker():
    senders, receivers = _Stuck(stuck=-1), _Stuck(stuck=1)
    calls = [PendingCall(senders, "policy", {0: 0, 1: 1}, _ranks),
             PendingCall(receivers, "rollout", {0: 0, 1: 1}, _ranks)]
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"the push of version 2 did not finish within 0\.3 s \(still running: "
                                          r"rollout ranks \[1\]\)") as info:
        wait_all(calls, deadline_s=0.3, what="the push of version 2")
    assert 0.3 <= time.monotonic() - start < 5  # not the groups' call_s (3600 s)
    e = info.value
    assert (e.lost, e.role, e.rank, e.roles) == (True, "rollout", 1, ("rollout",))
    assert isinstance(e.__cause__, WorkerError) and not receivers.alive and senders.alive
    # calls that finish in time: their results, as without a deadline
    ok = [PendingCall(_Stuck(stuck=-1), "policy", {0: 0}, _ranks)]
    assert wait_all(ok, deadline_s=0.3) == [["done 0"]]
