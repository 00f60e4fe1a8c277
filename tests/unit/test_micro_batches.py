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


def test_packed_plan_counts_real_tokens_first_fit():
    # lengths 30, 5, 20, 12, 8; 40 tokens, 3 rows: 30 -> A; 20 -> B; 12 -> B (32); 8 -> A (38); 5 -> B (37)
    assert micro_batches.plan([30, 5, 20, 12, 8], 40, 3, packed=True) == [[0, 4], [2, 3, 1]]
    # the row cap binds before the budget: 5 rows of 2 tokens, 3 a micro-batch
    assert micro_batches.plan([2] * 5, 100, 3, packed=True) == [[0, 1, 2], [3, 4]]
    # a pair is one unit of its summed lengths, ordered by its longest row: (4, 5) 15 tokens -> A; (0, 1) 20:
    # A would hold 35 > 30 -> B; (2, 3) 16: A 31, B 36 -> C
    assert micro_batches.plan([11, 9, 8, 8, 12, 3], 30, 4, group=2, packed=True) == [[4, 5], [0, 1], [2, 3]]
