"""Rollout engines: generate responses (token ids + per-token log-probs) from prompts with the current policy.

- :mod:`megarl.rollout.base`     the contract: :class:`SamplingParams`, :class:`RolloutOutput`, the
  :class:`RolloutEngine` protocol, the sampler and the log-prob definition (pure torch)
- :mod:`megarl.rollout.embedded` :class:`EmbeddedEngine`, a decode loop over a transformers model in-process
- :mod:`megarl.rollout.rows`     training rows [prompt | response | pad] from rollout outputs

Weights reach an engine only through ``update_weights`` (full HF-named tensors, streamed in buckets).
This package imports neither Ray nor vLLM; transformers is imported when an engine is built.
"""

from megarl.rollout.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    RolloutEngine,
    RolloutOutput,
    SamplingParams,
    WeightUpdateError,
    sample_next,
    token_log_probs,
)
from megarl.rollout.embedded import EmbeddedEngine

__all__ = [
    "FINISH_LENGTH",
    "FINISH_STOP",
    "EmbeddedEngine",
    "RolloutEngine",
    "RolloutOutput",
    "SamplingParams",
    "WeightUpdateError",
    "sample_next",
    "token_log_probs",
]
