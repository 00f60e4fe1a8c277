"""The built-in step programs, written on the public API (:mod:`megarl.program`) as a user's would be:
:mod:`~megarl.recipes.rl` is the PPO-family step that ``megarl train`` runs (``trainer.program: rl``)."""
