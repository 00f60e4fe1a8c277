"""Safe-RLHF (Dai et al. 2023, arXiv 2310.12773) as a step program: maximise the reward model's score subject to a
limit on the cost model's, by a Lagrange multiplier that the controller updates every step.

    megarl run examples/safe_rlhf_tiny/program.py examples/safe_rlhf_tiny/config.yaml

The reward and cost models score every response in the rollout's reward stage (called together: on pools of their
own they score at the same time): ``model_scores`` and ``cost_scores``. The policy is trained with GRPO on the
Lagrangian ``(reward - lambda * cost) / (1 + lambda)`` (Safe-RLHF's normalised form; its group-relative advantage
stands in for the paper's two critics), and ``lambda`` follows dual ascent on the constraint ``mean cost <=
COST_LIMIT``: ``lambda <- max(0, lambda + LAMBDA_LR * (mean cost - COST_LIMIT))``. ``lambda`` is the program's state
(``run.state``): checkpointed with the run, so a resumed run continues with it.
"""

from __future__ import annotations

from megarl.program import Run

COST_LIMIT = 0.1  # the mean cost per response the policy may incur (Safe-RLHF's threshold d)
LAMBDA_LR = 0.5  # the multiplier's step size


def step(run: Run) -> dict[str, float]:
    batch, metrics = run.rollout()
    lam = run.state.get("lambda", 0.0)  # this step's price of a unit of cost
    reward, cost = batch["model_scores"], batch["cost_scores"]
    batch.tensors["scores"] = (reward - lam * cost) / (1 + lam)
    mean_cost = cost.mean().item()
    run.state["lambda"] = max(0.0, lam + LAMBDA_LR * (mean_cost - COST_LIMIT))
    with run.stage("old_log_probs"):
        metrics |= run.old_log_probs(batch)
    if run.cfg.algorithm.needs_reference:
        with run.stage("reference"):
            metrics |= run.reference_log_probs(batch)
    with run.stage("advantages"):
        metrics |= run.advantages(batch)
    with run.stage("update_policy"):
        metrics |= run.update_policy(batch)
    return metrics | run.end(batch) | {"safe/lambda": lam, "safe/cost_mean": mean_cost,
                                       "safe/reward_mean": reward.mean().item()}
