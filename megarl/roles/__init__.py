"""Roles hosted in worker processes: policy, critic, reference, reward model (megatron-core models)."""
