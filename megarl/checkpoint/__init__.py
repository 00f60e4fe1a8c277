"""Checkpoints: HF safetensors directories, megatron-core dist checkpoints, and conversion."""
