"""Per-token log-probs and entropy from vocabulary-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for its slice of the (padded) vocabulary. One fused autograd
function computes, per token, ``log p(target)`` and the entropy of the softmax with two all-reduces
over the TP group (max; then sum-exp, sum of p*logit and the target logit together), and
differentiates both exactly. Columns at or beyond the true vocabulary size (Megatron's padding) are
excluded, so results match a model with the unpadded vocabulary. Inputs are used in float32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, vocab_start: int, vocab_size: int, group):
        logits = logits.float()
        local_vocab = logits.shape[-1]
        valid = (torch.arange(local_vocab, device=logits.device) + vocab_start) < vocab_size
        masked = logits.masked_fill(~valid, float("-inf"))
        lmax = masked.max(dim=-1).values
        dist.all_reduce(lmax, op=dist.ReduceOp.MAX, group=group)
        shifted = masked - lmax.unsqueeze(-1)
        exp = shifted.exp()  # exactly 0 on padded columns
        local_t = target - vocab_start
        in_shard = (local_t >= 0) & (local_t < local_vocab)
        t_logit = shifted.gather(-1, local_t.clamp(0, local_vocab - 1).unsqueeze(-1)).squeeze(-1)
        stats = torch.stack(
            [exp.sum(-1), (exp * shifted.masked_fill(~valid, 0.0)).sum(-1), torch.where(in_shard, t_logit, 0.0)]
        )
        dist.all_reduce(stats, group=group)
        sum_exp, sum_exp_x, t_shifted = stats
        lse = sum_exp.log()  # of the shifted logits
        log_prob = t_shifted - lse
        entropy = lse - sum_exp_x / sum_exp
        ctx.save_for_backward(shifted, lse, entropy, local_t, in_shard)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob: torch.Tensor, grad_entropy: torch.Tensor):
        shifted, lse, entropy, local_t, in_shard = ctx.saved_tensors
        log_p = shifted - lse.unsqueeze(-1)
        p = log_p.exp()  # 0 on padded columns (shifted is -inf there)
        # d logp(t)/dl_j = 1[j=t] - p_j ;  dH/dl_j = -p_j (log p_j + H)
        grad = -p * (grad_log_prob.unsqueeze(-1) + grad_entropy.unsqueeze(-1) * (log_p.nan_to_num(neginf=0.0)
                                                                                 + entropy.unsqueeze(-1)))
        onehot = torch.zeros_like(grad).scatter_(-1, local_t.clamp(0, grad.shape[-1] - 1).unsqueeze(-1), 1.0)
        grad = grad + onehot * (grad_log_prob * in_shard).unsqueeze(-1)
        return grad, None, None, None, None


def vocab_parallel_log_prob_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) per position from this rank's vocabulary shard of the logits.

    ``logits``: [..., V_local] (rank r holds columns [r*V_local, (r+1)*V_local) of the padded vocab);
    ``target``: [...] global token ids; ``vocab_size``: the true vocabulary (padding excluded);
    ``group``: the tensor-parallel group (None: megatron-core's). Needs an initialised world.
    """
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
    rank = dist.get_rank(group)
    vocab_start = rank * logits.shape[-1]
    if temperature != 1.0:
        logits = logits / temperature
    return _VocabParallelLogProbEntropy.apply(logits, target, vocab_start, vocab_size, group)


def token_log_probs(
    logits: torch.Tensor, input_ids: torch.Tensor, *, vocab_size: int, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-aligned (log p(input_ids[:, i] | input_ids[:, :i]), entropy of that distribution).

    ``logits`` [b, s, V_local] from a causal LM (position i predicts token i+1). Position 0 has no
    prediction and gets 0 in both outputs.
    """
    lp, ent = vocab_parallel_log_prob_entropy(
        logits[:, :-1], input_ids[:, 1:], vocab_size=vocab_size, temperature=temperature
    )
    zero = lp.new_zeros(lp.shape[0], 1)
    return torch.cat([zero, lp], dim=1), torch.cat([zero, ent], dim=1)
