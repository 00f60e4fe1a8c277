"""Reward functions: the scorer contract, rule-based scorers, user functions by path, error policy.

Inside megarl a reward function is any callable ``(prompt: str, response: str, row: Mapping[str, Any]) -> float``
where ``row`` holds the dataset row's other columns (ground truth and the like). A user's function may also
take the columns as keyword arguments or be TRL's batch style; its adapter presents it in this form. Pure
package: no Ray, no vLLM, no torch.distributed; reward *models* (networks) live with the workers, not here.

- :mod:`megarl.rewards.base`  :class:`RewardFunction`, :class:`BatchRewardFunction`, :class:`WeightedReward`,
  :func:`score_samples` with :class:`OnError`, :class:`RewardError`
- :mod:`megarl.rewards.conventions`  :class:`UserReward`: a user function and its calling convention
  (row, keyword columns, TRL batch), detected from its signature by :func:`adapt`
- :mod:`megarl.rewards.monitor`  :class:`RewardMonitor`: required columns checked, constant scores warned about
- :mod:`megarl.rewards.rules` ``BUILTIN_REWARDS``: ``gsm8k``, ``math_boxed``, ``integer_answer``
  (its option ``match``: first | start | last)
- :mod:`megarl.rewards.user`  :func:`load_reward_function` (``"file.py:function"``),
  :func:`resolve_reward_function` (a built-in key or a file spec)
"""

from megarl.rewards.base import (
    BatchRewardFunction,
    OnError,
    RewardError,
    RewardFunction,
    ScoreInfo,
    WeightedReward,
    as_score,
    score_samples,
)
from megarl.rewards.conventions import BatchUserReward, Convention, UserReward, adapt
from megarl.rewards.monitor import RewardMonitor
from megarl.rewards.rules import (
    BUILTIN_REWARDS,
    GSM8KReward,
    IntegerAnswerReward,
    IntegerMatch,
    MathBoxedReward,
    builtin_reward,
    extract_boxed,
    extract_gsm8k_answer,
    normalize_math,
    parse_number,
)
from megarl.rewards.user import load_reward_function, resolve_reward_function

__all__ = [
    "BUILTIN_REWARDS",
    "BatchRewardFunction",
    "BatchUserReward",
    "Convention",
    "GSM8KReward",
    "IntegerAnswerReward",
    "IntegerMatch",
    "MathBoxedReward",
    "OnError",
    "RewardError",
    "RewardFunction",
    "RewardMonitor",
    "ScoreInfo",
    "UserReward",
    "WeightedReward",
    "adapt",
    "as_score",
    "builtin_reward",
    "extract_boxed",
    "extract_gsm8k_answer",
    "load_reward_function",
    "normalize_math",
    "parse_number",
    "resolve_reward_function",
    "score_samples",
]
