"""Error types a user can act on, and the exit status of each.

Every error raised for bad input says what was expected, what was found and what to change, in
one paragraph. Deep library tracebacks are wrapped into one of these at the boundary where the
user's input was read. Pure module: imports nothing heavy.

Exit statuses of ``megarl train`` (:data:`EXIT_CODES`; the launch scripts act on them):

====  =====================================================================================
0     the run finished (or was already complete)
1     a bug in megarl or a library: a traceback
2     bad input or environment (:class:`MegarlError`): config, data, checkpoint, a locked output
      directory, a worker that raised; retrying the same command fails the same way
3     workers were lost (a process or node died, or hung) and the run could not restart them
      (:class:`WorkersLostError`): a new allocation may succeed; the run resumes from its newest
      intact checkpoint
75    stopped by SIGTERM/SIGINT (:class:`RunStopped`): a checkpoint of the last finished step was
      written (``trainer.save_on_signal``) or the previous one is the latest; the same command resumes
====  =====================================================================================
"""


class MegarlError(Exception):
    """Base class for errors caused by user input or environment, not by a bug in megarl."""

    exit_code = 2
    label = "error"


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


class ClusterError(MegarlError):
    """The Ray cluster could not be started or joined, or the run's output directory is held by another run."""


class WorkersLostError(MegarlError):
    """Workers died or hung and the run could not replace them (restarts exhausted, or no room for new ones)."""

    exit_code = 3


class RunStopped(MegarlError):
    """The run stopped on a signal, resumable from its newest checkpoint (not an error of the user's)."""

    exit_code = 75
    label = "stopped"


EXIT_CODES = {0: "finished", 1: "bug", MegarlError.exit_code: "bad input", WorkersLostError.exit_code: "workers lost",
              RunStopped.exit_code: "stopped by a signal, resumable"}
