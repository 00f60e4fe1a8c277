"""The successor task's reward (docs/tasks.md): 1 when the response starts with the digit that follows the prompt's,
else 0. ``target`` is the dataset's column of that name, passed as a keyword argument."""


def reward(prompt, response, target=None, **_):
    return float(response.strip()[:1] == target)


def reward_row(prompt, response, row):
    """The same score in the row convention: every column but the prompt in one mapping."""
    return float(response.strip()[:1] == row["target"])
