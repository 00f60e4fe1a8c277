"""Error types a user can act on.

Every error raised for bad input says what was expected, what was found and what to change, in
one paragraph. Deep library tracebacks are wrapped into one of these at the boundary where the
user's input was read. Pure module: imports nothing heavy.
"""


class MegarlError(Exception):
    """Base class for errors caused by user input or environment, not by a bug in megarl."""


class ConfigError(MegarlError, ValueError):
    """A configuration value or model config that megarl cannot use."""


class LayoutError(ConfigError):
    """A parallel layout that does not fit the world size or does not divide the model."""


class UnsupportedModelError(ConfigError):
    """An architecture or model feature that megarl does not support."""


class CheckpointError(MegarlError):
    """A checkpoint directory that is missing, incomplete or corrupt."""


class MissingDependencyError(MegarlError, ImportError):
    """An optional dependency (vLLM, Transformer Engine, apex) that a requested feature needs."""
