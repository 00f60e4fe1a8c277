"""The hidden-digit environment of examples/multiturn_lookup_tiny: what a user writes for a multi-turn task.

After the model's first turn it reveals a digit drawn for this conversation alone; the model's second turn earns
1 if its first digit is that one. Nothing before the reveal depends on the digit, so the reward needs the
observation.
"""

from __future__ import annotations

import random

from megarl.multiturn import Step


class HiddenDigit:
    made = 0  # conversations so far in this process: each draws its own digit, reproducibly

    def __init__(self) -> None:
        HiddenDigit.made += 1  # megarl builds the environments one after another, in conversation order
        self.digit = str(random.Random(HiddenDigit.made).randrange(10))
        self.turns = 0

    def reset(self, row: dict) -> list[dict]:
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text: str) -> Step:
        self.turns += 1
        if self.turns == 1:
            return Step([{"role": "user", "content": self.digit}])
        first = next((c for c in text if c.isdigit()), None)
        return Step([], reward=float(first == self.digit), done=True)
