"""Rejection-sampling fine-tuning (best-of-n; RAFT, Dong et al. 2023; the expert-iteration step of many RL
pipelines) as a controller program: a different dataflow on the same roles (docs/programming.md §3).

Each step samples ``rollout.sampling.n`` responses per prompt (the schedule's rollout: sync, one step off or async
alike), keeps each prompt's best response when its reward clears ``THRESHOLD``, and takes a supervised step on the
kept ones: the policy loss is ``supervised`` below (the negative log-likelihood of the kept tokens), a plug-in by
path, so the update runs through the policy's own optimizer, parallelism and checkpoints.

    megarl run examples/programs/rejection_sampling.py examples/programs/rejection_sampling.yaml

``rft/kept_frac`` is the fraction of prompts with a kept response; ``reward/mean`` is over all samples.
"""

from __future__ import annotations

import torch

from megarl.program import Run, algos

THRESHOLD = 0.5  # a response is kept when its reward is above this (the addition task: 1 right, 0 wrong)


def step(run: Run) -> dict[str, float]:
    batch, metrics = run.rollout()
    scores, groups = batch["scores"], batch["prompt_uid"]
    best = torch.full((int(groups.max()) + 1,), -1, dtype=torch.long)  # per prompt, its best row (first of ties)
    for row in range(len(batch) - 1, -1, -1):
        g = int(groups[row])
        if best[g] < 0 or scores[row] >= scores[best[g]]:
            best[g] = row
    kept = torch.zeros(len(batch), dtype=torch.bool)
    winners = best[scores[best] > THRESHOLD]
    kept[winners] = True
    metrics["rft/kept_frac"] = len(winners) / len(best)
    # the others stay in the batch (its size divides into the data-parallel ranks) but count for nothing
    batch.tensors["response_mask"] = batch["response_mask"] * kept[:, None].to(batch["response_mask"].dtype)
    batch.tensors["advantages"] = batch["response_mask"].float()  # the loss's per-token weight: 1 on kept tokens
    if kept.any():
        if run.cfg.algorithm.recompute_old_log_probs:
            with run.stage("old_log_probs"):
                metrics |= run.old_log_probs(batch)
        with run.stage("update_policy"):
            metrics |= run.update_policy(batch)
    return metrics | run.end(batch)


@algos.policy_loss()
def supervised(log_prob, old_log_prob, advantages, mask, config, normalizer) -> algos.PolicyLossOutput:
    """The negative log-likelihood of the counted tokens, weighted by ``advantages`` (1 on kept responses' tokens),
    aggregated as ``algorithm.policy_loss.aggregation`` says (token-mean by default)."""
    loss = algos.aggregate_loss(-advantages * log_prob, mask, config.aggregation, normalizer, config.norm_constant)
    log_ratio = (log_prob - old_log_prob).detach()
    zero = torch.zeros((), dtype=log_prob.dtype)
    return algos.PolicyLossOutput(loss, clip_frac=zero, dual_clip_frac=zero,
                                  approx_kl_k1=algos.masked_mean(-log_ratio, mask),
                                  approx_kl_k3=algos.masked_mean(log_ratio.exp() - 1 - log_ratio, mask))
