"""The successor task as a conversation (docs/tasks.md §2): the row's question opens it, and every answer is scored
and followed by a new question about a digit drawn for this conversation, which the model must read to answer.

    user: after 3 comes    assistant: 4    user: after 7 comes    assistant: 8

Each of the TURNS answers earns 1 / TURNS when it starts with the right digit, so a conversation scores 0 to 1.
"""

from __future__ import annotations

import random

from megarl.multiturn import Step

TURNS = 2
_draws = random.Random(0)  # megarl builds a run's environments one after another: a reproducible sequence


class Successor:
    def __init__(self) -> None:  # one instance per conversation, built with no arguments
        self.digits = [_draws.randrange(10) for _ in range(TURNS - 1)]  # the follow-up questions

    def reset(self, row: dict) -> list[dict]:
        """The opening messages, from the dataset row (the same jsonl rows as the single-turn task)."""
        self.asked = int(row["prompt"].split()[1])  # "after 3 comes" -> 3
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text: str) -> Step:
        """The model's answer (decoded, <|end|> excluded) -> this turn's reward and the reply, or the end."""
        reward = float(text.strip()[:1] == str((self.asked + 1) % 10)) / TURNS
        if not self.digits:
            return Step([], reward=reward, done=True)
        self.asked = self.digits.pop(0)
        return Step([{"role": "user", "content": f"after {self.asked} comes"}], reward=reward)
