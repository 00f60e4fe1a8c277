"""Dynamic micro-batching: the plan by token budget and its spreading over more micro-batches, by hand."""

from megarl.engine import micro_batches


def test_plan_groups_longest_first_within_the_budget():
    # lengths 12, 10, 11, 12, 10, 11; 40 tokens and 4 rows per micro-batch: {12, 12, 11} (36), then {11, 10, 10}
    assert micro_batches.plan([12, 10, 11, 12, 10, 11], 40, 4) == [[0, 3, 2], [5, 1, 4]]


def test_spread_halves_the_fullest_until_the_count():
    plan = [[0, 1, 2, 3], [4, 5]]
    assert micro_batches.spread(plan, 2) == plan
    assert micro_batches.spread(plan, 3) == [[0, 1], [2, 3], [4, 5]]
    assert micro_batches.spread(plan, 4) == [[0], [1], [2, 3], [4, 5]]
    assert micro_batches.spread(plan, 9) == [[0], [1], [2], [3], [4], [5]]  # one row each: as far as it goes
    assert plan == [[0, 1, 2, 3], [4, 5]]  # the input is left alone
