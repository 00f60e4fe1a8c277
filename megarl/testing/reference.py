"""Independent references for the distributed tests: the transformers side of a PPO update, in plain torch."""

from __future__ import annotations

import torch


def hf_ppo_backward(model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, resp: torch.Tensor,
                    adv: torch.Tensor, noise: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One clipped-PPO loss of a transformers causal LM, backpropagated into its parameters' ``.grad``.

    Log-probs are token-aligned (entry i: log p(token i | tokens < i); 0 at position 0 and outside ``attn``); the
    old log-probs are these plus ``noise`` on the response tokens; the loss is the token mean over ``resp`` of
    ``max(-A r, -A clip(r, 1 - clip, 1 + clip))``. Returns (log-probs, old log-probs, loss)."""
    logits = model(ids, attention_mask=attn.long()).logits
    lp = torch.zeros_like(attn)
    lp[:, 1:] = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    lp = lp * attn
    old = (lp.detach() + noise) * resp
    ratio = torch.exp(lp - old)
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip))
    loss = (per_token * resp).sum() / resp.sum()
    loss.backward()
    return lp.detach(), old, loss.item()
