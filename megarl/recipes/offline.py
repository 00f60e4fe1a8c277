"""The offline programs (``trainer.program``: ``sft``, ``dpo``, ``kto``, ``reward_model``; docs/offline.md), on the
public API only: each step draws ``data.batch_size`` examples and takes one optimizer step on the objective of
``offline.<program>`` (:mod:`megarl.algos.offline`), as TRL's ``SFTTrainer``, ``DPOTrainer``, ``KTOTrainer`` and
``RewardTrainer`` do with one process and no gradient accumulation. Checkpoints, resume, signals and restarts are
the loop's, as in RL.
"""

from __future__ import annotations

from megarl.program import Run


def sft(run: Run) -> dict[str, float]:
    batch, metrics = run.examples()
    with run.stage("update_policy"):
        metrics |= run.train_policy(batch, run.cfg.offline.sft)
    return metrics | run.end(batch)


def dpo(run: Run) -> dict[str, float]:
    batch, metrics = run.examples()
    with run.stage("reference"):  # the frozen starting policy's log-prob of each response, on the fly
        metrics |= run.reference_sequence_log_probs(batch)
    with run.stage("update_policy"):
        metrics |= run.train_policy(batch, run.cfg.offline.dpo)
    return metrics | run.end(batch)


def kto(run: Run) -> dict[str, float]:
    batch, metrics = run.examples()
    with run.stage("reference"):  # the reference's log-prob of each completion; the batch's KL estimate
        metrics |= run.reference_sequence_log_probs(batch) | run.kto_kl(batch)
    with run.stage("update_policy"):
        metrics |= run.train_policy(batch, run.cfg.offline.kto)
    return metrics | run.end(batch)


def reward_model(run: Run) -> dict[str, float]:
    batch, metrics = run.examples()
    with run.stage("update_critic"):  # the scalar-head model: its checkpoints are reward models
        metrics |= run.train_critic(batch, run.cfg.offline.reward_model)
    return metrics | run.end(batch)
