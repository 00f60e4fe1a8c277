"""The driver's RL loop: :mod:`~megarl.trainer.trainer` (the step as a recipe of timed stages),
:mod:`~megarl.trainer.cluster` (the run's roles on their pools, behind typed calls) and
:mod:`~megarl.trainer.callbacks` (user code at stage boundaries)."""
