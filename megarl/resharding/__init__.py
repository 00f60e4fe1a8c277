"""Moving the policy's weights from Megatron's training layout into rollout engines.

``plan`` (pure: who sends which HF slab to whom), ``buckets`` (pure torch: local HF pieces,
size-capped buckets, assembly of rollout shards), ``transport`` (the collectives that execute a
plan over the workers' own process group).
"""
