"""Online DPO (Guo et al. 2024; TRL's ``OnlineDPOTrainer``): ``trainer.program: online_dpo``, on the public API only.

Each step samples ``rollout.sampling.n`` responses per prompt from the current policy (the schedule's rollout: sync,
one step off or async, with every reward source: rule functions, a reward model), pairs each prompt's best-scored
response with its worst, and takes one DPO step (``offline.dpo``) against the frozen starting policy. TRL samples two
responses per prompt (``n: 2``); its IPO is not length-normalised, this one is (as TRL's offline ``DPOTrainer``).
"""

from __future__ import annotations

import logging

from megarl.program import Run

logger = logging.getLogger(__name__)


def step(run: Run) -> dict[str, float]:
    batch, metrics = run.rollout()  # scored, grouped by prompt
    if not len(batch):
        logger.warning("step %d: no rows to pair (dynamic sampling kept no group); the update is skipped", run.step)
        return metrics | {"batch/tokens": 0.0, "batch/num_sequences": 0.0}
    pairs, paired = run.preference_pairs(batch)
    with run.stage("reference"):
        metrics |= run.reference_sequence_log_probs(pairs)
    with run.stage("update_policy"):
        metrics |= run.train_policy(pairs, run.cfg.offline.dpo)
    return metrics | paired | run.end(pairs)
