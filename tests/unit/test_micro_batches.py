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


def test_plan_keeps_groups_together_and_in_order():
    # pairs (0,1) longest 12, (2,3) 11, (4,5) 10; 48 tokens, 4 rows: {(0,1), (2,3)} = 4 x 12, then {(4,5)}
    assert micro_batches.plan([12, 9, 11, 11, 10, 3], 48, 4, group=2) == [[0, 1, 2, 3], [4, 5]]
    # a budget below a pair's size still keeps the pair whole, alone
    assert micro_batches.plan([12, 9, 11, 11], 10, 1, group=2) == [[0, 1], [2, 3]]


def test_spread_splits_at_group_boundaries():
    plan = [[0, 1, 2, 3, 4, 5], [6, 7]]
    assert micro_batches.spread(plan, 3, group=2) == [[0, 1], [2, 3, 4, 5], [6, 7]]
    assert micro_batches.spread(plan, 9, group=2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
