"""megarl's public API for controller programs (docs/programming.md §3): import from here, not from the modules
behind it, which may move.

A program is one function, ``step(run: Run) -> dict[str, float]``: one training step's dataflow over the run's
roles, returning the step's metrics. Run it with ``megarl run my_algo.py CONFIG [key=value ...]`` (the function
``step`` of the file, or ``my_algo.py:other``), or from Python with :func:`train`; ``megarl train`` runs the built-in
one (:mod:`megarl.recipes.rl`) the same way. Everything around the step is the run's: the config checks and
resolution, the output directory and its lock, validation, checkpoints (with :attr:`Run.state`), stop signals,
restarts after a lost worker, metrics files.

- :class:`Run`: the step's view of the run: ``run.rollout()``, ``run.draw()``, ``run.generate()``, ``run.score()``,
  the stages (``old_log_probs``, ``reference_log_probs``, ``teacher_log_probs``, ``values``, ``advantages``,
  ``update_critic``, ``update_policy``, ``end``), ``run.stage(name)`` to time a block, ``run.state`` (checkpointed),
  ``run.cluster`` (one typed method per role call: ``generate``, ``reward_scores``, ``sync_weights``, ...);
- :class:`Batch`: the rows (tensors ``[rows, ...]``, per-row lists, ``meta``): ``select``, ``index``, ``chunk``,
  ``concat``, ``update``;
- :mod:`megarl.algos`: the math (advantage estimators, losses, KL, masked reductions) and the plug-in decorators;
- :class:`RolloutRequest`, :class:`RolloutContext`, :class:`RolloutSample`: what a rollout function
  (``rollout.function``) is given and returns.
"""

from __future__ import annotations

from typing import Any

from megarl import algos
from megarl.config.train import TrainConfig, load_config
from megarl.data.batch import Batch
from megarl.data.prompts import PromptRecord
from megarl.multiturn.custom import RolloutContext, RolloutRequest, RolloutSample
from megarl.rollout.base import SamplingConfig
from megarl.trainer.callbacks import Callback
from megarl.trainer.run import Run, StageTimer

__all__ = ["Batch", "Callback", "PromptRecord", "RolloutContext", "RolloutRequest", "RolloutSample", "Run",
           "SamplingConfig", "StageTimer", "TrainConfig", "algos", "load_config", "train"]


def train(cfg: TrainConfig, program: str | None = None, callbacks: tuple[Callback, ...] = ()) -> list[dict[str, Any]]:
    """Run (or resume) ``cfg``'s run with ``program`` (``path/to/file.py:function``; default
    ``cfg.trainer.program``); the metrics of the steps run. As ``megarl run`` / ``megarl train``."""
    import dataclasses

    from megarl.trainer.trainer import run

    if program is not None:
        cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, program=program))
    return run(cfg, callbacks)
