"""megarl: Megatron-core-backed, Ray-coordinated RL post-training for large language models.

Importing ``megarl`` is cheap: it imports neither torch.distributed process groups, megatron-core,
Ray nor any GPU-only library. Sub-packages are imported explicitly by the code that needs them.
"""

__version__ = "0.1.0"
