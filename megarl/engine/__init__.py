"""The Megatron training engine: vocab-parallel log-probs, micro-batching, optimizer/scheduler,
forward(-backward) passes through megatron-core's schedules, offload and checkpoints."""
