"""ParallelLayout: rank coordinates against a hand-worked table, and actionable errors."""

import pytest

from megarl.errors import LayoutError
from megarl.parallel.layout import ParallelLayout


def test_coords_match_megatron_default_order_hand_worked():
    # world of 8 = TP2 x DP2 x PP2, megatron order tp-cp-ep-dp-pp (tp fastest, pp slowest)
    layout = ParallelLayout(tp=2, pp=2, dp=2)
    expected = {
        0: (0, 0, 0), 1: (1, 0, 0), 2: (0, 0, 1), 3: (1, 0, 1),
        4: (0, 1, 0), 5: (1, 1, 0), 6: (0, 1, 1), 7: (1, 1, 1),
    }  # rank: (tp, pp, dp)
    for rank, (tp, pp, dp) in expected.items():
        c = layout.coords(rank)
        assert (c.tp, c.pp, c.dp) == (tp, pp, dp)
        assert layout.rank_of(tp=tp, pp=pp, dp=dp) == rank


def test_layers_of_stage_with_and_without_vpp():
    # docs/resharding.md §2.3: L=80, P=4, v=2 -> stage 0 holds layers 0-9 and 40-49
    layout = ParallelLayout(tp=1, pp=4, dp=1, vpp=2)
    assert list(layout.layers_of_stage(80, 0, 0)) == list(range(0, 10))
    assert list(layout.layers_of_stage(80, 0, 1)) == list(range(40, 50))
    assert list(layout.layers_of_stage(80, 3, 1)) == list(range(70, 80))
    assert list(ParallelLayout(pp=2).layers_of_stage(4, 1)) == [2, 3]


def test_world_size_mismatch_names_the_fix():
    with pytest.raises(LayoutError, match=r"needs 4 processes, but the world has 6"):
        ParallelLayout(tp=2, pp=2).check_world_size(6)
    assert ParallelLayout.for_world(8, tp=2, pp=2).dp == 2
    with pytest.raises(LayoutError, match="not divisible by tp\\*pp"):
        ParallelLayout.for_world(6, tp=4)


@pytest.mark.parametrize(
    "layout, message",
    [
        (ParallelLayout(tp=5), r"attention heads \(12\); choose tp from \[1, 2, 3, 4, 6, 12\]"),
        (ParallelLayout(tp=4), r"key/value heads \(query groups, 2\); choose tp from \[1, 2\]"),
        (ParallelLayout(pp=3), r"number of layers \(8\)"),
        (ParallelLayout(pp=2, vpp=3), r"pp\*vpp = 2\*3 = 6 must divide"),
    ],
)
def test_model_that_does_not_divide(layout, message):
    with pytest.raises(LayoutError, match=message):
        layout.check_model(num_layers=8, num_attention_heads=12, num_query_groups=2)


def test_invalid_values():
    with pytest.raises(LayoutError, match="positive integer"):
        ParallelLayout(tp=0)
    with pytest.raises(LayoutError, match="needs pp > 1"):
        ParallelLayout(vpp=2)
    with pytest.raises(LayoutError, match=r"tp\*pp\*cp = 1\*1\*3 = 3"):
        ParallelLayout.for_world(4, cp=3)


def test_context_parallel_coords_match_megatron_rank_generator():
    """Each rank's tp / cp / dp / pp coordinates against megatron-core's own RankGenerator (order tp-cp-ep-dp-pp):
    ranks sharing a cp group differ only in cp, and so on for every dimension."""
    from megatron.core.parallel_state import RankGenerator

    layout = ParallelLayout(tp=2, cp=2, dp=2, pp=2)
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=2, order="tp-cp-ep-dp-pp")
    for dim in ("tp", "cp", "dp", "pp"):
        for group in gen.get_ranks(dim):
            coords = [layout.coords(r)._asdict() for r in group]
            assert [c[dim] for c in coords] == list(range(len(group))), (dim, group)
            others = [{k: v for k, v in c.items() if k != dim} for c in coords]
            assert all(o == others[0] for o in others), (dim, group)
    assert all(layout.rank_of(**layout.coords(r)._asdict()) == r for r in range(layout.world_size))
    assert str(layout) == "TP2xCP2xPP2xDP2"


def test_expert_coords_match_megatron_expert_order_hand_worked():
    # world of 8 = TP2 x DP2 x PP2 with EP2: within a stage (4 ranks) the expert order is ep innermost, then
    # expert-data-parallel (expert TP 1); pp outermost, as for the dense part
    layout = ParallelLayout(tp=2, pp=2, dp=2, ep=2)
    assert layout.expert_dp == 2 and layout.world_size == 8
    expected = {0: (0, 0), 1: (1, 0), 2: (0, 1), 3: (1, 1), 4: (0, 0), 5: (1, 0), 6: (0, 1), 7: (1, 1)}
    for rank, (ep, edp) in expected.items():
        assert tuple(layout.expert_coords(rank)) == (ep, edp)
    assert list(ParallelLayout(dp=4, ep=4).experts_of(8, 3)) == [6, 7]
    assert str(layout) == "TP2xPP2xDP2xEP2"


def test_expert_parallelism_must_divide_the_stage_and_the_experts():
    with pytest.raises(LayoutError, match=r"ep=4 must divide tp\*cp\*dp = 1\*1\*2 = 2"):
        ParallelLayout(dp=2, ep=4)
    with pytest.raises(LayoutError, match=r"ep=4 must divide the number of experts \(6\); choose ep from \[1, 2\]"):
        ParallelLayout(dp=4, ep=4).check_model(num_layers=2, num_attention_heads=4, num_query_groups=2, num_experts=6)
    # a dense model on an expert-parallel pool: ep does not concern it
    ParallelLayout(dp=2, ep=2).check_model(num_layers=2, num_attention_heads=4, num_query_groups=2)
    assert ParallelLayout.for_world(4, tp=2, ep=2).dp == 2
