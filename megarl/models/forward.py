"""Forward-only passes of a (possibly pipelined) megatron-core GPTModel through its schedules.

:func:`forward_logits` runs micro-batches through ``get_forward_backward_func`` (so PP, VPP and TP
all apply) and returns full-vocabulary logits gathered over tensor parallelism, on the ranks of
the last pipeline stage. It gathers the whole vocabulary, so it is meant for checks and small
batches; training-time log-probs use vocab-parallel reductions instead.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region


def forward_logits(
    chunks: list[torch.nn.Module], input_ids: torch.Tensor, vocab_size: int, micro_batch_size: int = 1
) -> torch.Tensor | None:
    """Logits [batch, seq, vocab_size] (padding columns dropped) on last-stage ranks, else None.

    Every rank of the model-parallel group must call it with the same ``input_ids``.
    """
    batch, seq = input_ids.shape
    if batch % micro_batch_size:
        raise ValueError(f"batch {batch} is not divisible by micro_batch_size {micro_batch_size}")
    device = next(chunks[0].parameters()).device
    micro_batches = input_ids.to(device).split(micro_batch_size)
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(micro_batch_size, seq)

    def loss_func(output: torch.Tensor, non_loss_data: bool = True) -> torch.Tensor:
        return gather_from_tensor_model_parallel_region(output)[..., :vocab_size]

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        return model(tokens, position_ids, attention_mask=None), loss_func

    training = [c.training for c in chunks]
    for c in chunks:  # eval mode: no dropout, no MoE training-only paths (aux losses, TP checks)
        c.eval()
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            # each virtual stage draws every micro-batch from its own iterator
            data_iterator=[iter(micro_batches) for _ in chunks] if len(chunks) > 1 else iter(micro_batches),
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=batch // micro_batch_size,
            seq_length=seq,
            micro_batch_size=micro_batch_size,
            forward_only=True,
            collect_non_loss_data=True,
        )
    for c, mode in zip(chunks, training, strict=True):
        c.train(mode)
    if not parallel_state.is_pipeline_last_stage():
        return None
    return torch.cat(outputs, dim=0)
