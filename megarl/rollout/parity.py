"""Log-prob parity at every weight push: a fixed probe each rollout replica generates right after it received a
version of the weights, scored by the training model holding that same version.

The step's own rows check the engines only where they were sampled at the trained version (``Run.old_log_probs``);
under one_step_off and async the rows are older, so a push that silently failed would pass as staleness. The probe
closes that gap on a rollout pool of its own: one short prompt of fixed token ids per replica (each replica gets one
row through the usual data-parallel dispatch and tags it with its replica number), a few tokens sampled with a fixed
seed at the training temperature with every truncation off, so that the engine's log-probs are of the training
model's distribution (:mod:`megarl.rollout.base`: ``softmax(logits / T)``, the policy's ``compute_log_probs``).

Owns the probe (:func:`make_probe`), the per-replica comparison (:func:`compare`) and its error. Pure: torch,
:mod:`megarl.data.batch`, the rollout contract; no Ray, no process group (the driver imports it).
"""

from __future__ import annotations

import dataclasses

import torch

from megarl.data.batch import Batch
from megarl.errors import ConfigError
from megarl.rollout.base import SamplingParams
from megarl.rollout.config import LoRASync
from megarl.rollout.mismatch import RolloutMismatchError, logprob_abs_diff, sync_suspect

PROBE_TOKENS = 8  # prompt + sampled tokens of the probe, at most (fewer where the engine's model length is shorter)
PROBE_NEW_TOKENS = 4  # sampled tokens, at most half the probe
PROBE_SEED = 4242  # the same on every replica and at every push: the probe is fixed


class PushMismatchError(RolloutMismatchError):
    """A rollout replica's log-probs of the probe differ from the training model's right after a push."""


@dataclasses.dataclass(frozen=True)
class Probe:
    """What the driver sends: ``prompt_ids`` [R, P] (one identical row per replica), ``prompt_lengths`` [R]."""

    prompts: Batch
    params: SamplingParams


def make_probe(replicas: int, vocab_size: int, temperature: float, max_model_len: int | None) -> Probe:
    """The probe of a rollout pool of ``replicas`` replicas: prompt token ids spread over ``[1, vocab_size)``
    (id 0, often padding, left out), sampled at ``temperature`` (the training one; > 0) within ``max_model_len``
    tokens (None: no limit)."""
    if replicas < 1 or vocab_size < 2:
        raise ValueError(f"a probe needs replicas >= 1 and vocab_size >= 2, found {replicas}, {vocab_size}")
    if not temperature > 0:
        raise ConfigError(f"the weight-push probe samples at the training temperature, which must be > 0; found "
                          f"{temperature}")
    total = PROBE_TOKENS if max_model_len is None else min(PROBE_TOKENS, max_model_len)
    if total < 2:
        raise ConfigError(f"the weight-push probe needs a model length of at least 2 tokens (rollout.engine."
                          f"max_model_len), found {max_model_len}")
    new = min(PROBE_NEW_TOKENS, total // 2)
    ids = torch.tensor([1 + (5 + 7 * i) % (vocab_size - 1) for i in range(total - new)])
    prompts = Batch.from_dict({"prompt_ids": ids.expand(replicas, -1).clone(),
                               "prompt_lengths": torch.full((replicas,), len(ids))})
    return Probe(prompts, SamplingParams(n=1, temperature=temperature, max_new_tokens=new, seed=PROBE_SEED))


@dataclasses.dataclass(frozen=True)
class PushParity:
    """One push's probe: each replica's mean |training - rollout| log-prob over its probe tokens (replica order)."""

    version: int
    per_replica: tuple[float, ...]
    seconds: float = 0.0  # the probe's generation and scoring, after the transfer

    @property
    def worst(self) -> tuple[int, float]:
        """The replica furthest from the training model and its gap."""
        replica = max(range(len(self.per_replica)), key=lambda r: self.per_replica[r])
        return replica, self.per_replica[replica]

    def metrics(self) -> dict[str, float]:
        return {"rollout/push_logprob_abs_diff": self.worst[1], "rollout/push_version": float(self.version),
                "timing/push_probe_s": self.seconds}

    def check(self, limit: float | None, lora_sync: LoRASync = LoRASync.MERGED) -> None:
        """Raise :class:`PushMismatchError` naming the replica and version when a gap is above ``limit``."""
        replica, diff = self.worst
        if limit is not None and diff > limit:
            others = ", ".join(f"replica {r}: {d:.3g}" for r, d in enumerate(self.per_replica) if r != replica)
            raise PushMismatchError(
                f"rollout replica {replica} generates with other weights than the policy's version {self.version} "
                f"it was just pushed: its log-probs of the weight-push probe differ from the training model's by "
                f"{diff:.3g} on average (rollout.engine.max_logprob_abs_diff={limit}"
                + (f"; {others}" if others else "") + "). The push did not reach its engine (a failed load, a "
                "broken name mapping), or the rollout dtype is too coarse for this limit; the run stops here."
                + sync_suspect(lora_sync))


def compare(rows: Batch, training_log_probs: torch.Tensor, version: int, replicas: int) -> PushParity:
    """Each replica's gap on the probe ``rows`` (``rollout_replica``, ``policy_version``, ``response_mask``,
    ``rollout_log_probs``), against the training model's ``training_log_probs`` of the same rows (token-aligned).
    Raises when a replica's row is missing or doubled, or a row reports another version than ``version``."""
    tags = rows["rollout_replica"].tolist()
    if sorted(tags) != list(range(replicas)):
        raise RolloutMismatchError(f"the weight-push probe of version {version} expected one row from each of the "
                                   f"{replicas} rollout replicas, found rows from replicas {tags}")
    held = rows["policy_version"].tolist()
    if any(v != version for v in held):
        raise RolloutMismatchError(f"rollout replicas {tags} report versions {held} right after the push of version "
                                   f"{version}: a replica did not record the push")
    gaps = {r: logprob_abs_diff(training_log_probs[i], rows["rollout_log_probs"][i], rows["response_mask"][i])
            for i, r in enumerate(tags)}
    return PushParity(version, tuple(gaps[r] for r in range(replicas)))
