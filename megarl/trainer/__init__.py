"""The driver's RL loop: :mod:`~megarl.trainer.trainer` (the loop around a step program: checkpoints, validation,
signals, restarts), :mod:`~megarl.trainer.run` (``Run``: the roles and stages a step program calls),
:mod:`~megarl.trainer.cluster` (the run's roles on their pools, behind typed calls) and
:mod:`~megarl.trainer.callbacks` (user code at stage boundaries)."""
