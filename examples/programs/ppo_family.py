"""PPO with a critic and GRPO as controller programs on megarl's public API (docs/programming.md §3): HybridFlow's
listing, one stage per line. Each is the step of one run; the run's loop (checkpoints, validation, signals,
restarts) is megarl's.

    megarl run examples/programs/ppo_family.py:grpo examples/grpo_addition_tiny/config.yaml
    megarl run examples/programs/ppo_family.py:ppo examples/grpo_addition_tiny/config.yaml \
        algorithm.advantage.estimator=gae algorithm.kl_loss_coef=0

``grpo`` assumes a reference for a KL loss term (``algorithm.kl_loss_coef > 0``) and no critic; ``ppo`` a critic
(``algorithm.advantage.estimator: gae``) and no reference. megarl's own step (megarl/recipes/rl.py) is the one
that reads every option; these two reproduce its metrics bit for bit on those configs
(tests/trainer/test_programs.py).
"""

from __future__ import annotations

from megarl.program import Run


def grpo(run: Run) -> dict[str, float]:
    batch, metrics = run.rollout()  # the schedule's rows, scored: n responses per prompt
    with run.stage("old_log_probs"):
        metrics |= run.old_log_probs(batch)
    with run.stage("reference"):
        metrics |= run.reference_log_probs(batch)
    with run.stage("advantages"):
        metrics |= run.advantages(batch)  # group-normalised scores
    with run.stage("update_policy"):
        metrics |= run.update_policy(batch)  # clipped surrogate + KL to the reference
    return metrics | run.end(batch)


def ppo(run: Run) -> dict[str, float]:
    batch, metrics = run.rollout()
    with run.stage("old_log_probs"):
        metrics |= run.old_log_probs(batch)
    with run.stage("values"):
        metrics |= run.values(batch)
    with run.stage("advantages"):
        metrics |= run.advantages(batch)  # GAE over the critic's values
    with run.stage("update_critic"):
        metrics |= run.update_critic(batch)
    with run.stage("update_policy"):
        metrics |= run.update_policy(batch)
    return metrics | run.end(batch)
