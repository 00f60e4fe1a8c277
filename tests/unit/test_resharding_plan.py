"""Resharding plan without any process group: byte counts against docs/resharding.md's formulas, and
every rank's rollout shard against vLLM's layout sliced by hand from the HF tensors."""

import math

import pytest
import torch

from megarl.errors import LayoutError
from megarl.models import mapping
from megarl.models.spec import spec_from_hf_config
from megarl.parallel.layout import ParallelLayout
from megarl.resharding.buckets import LocalPieces, dest_view, empty_dest, make_buckets
from megarl.resharding.plan import Grouping, Slab, check_vllm_groups, make_plan
from megarl.testing.tiny import tiny_config

F32 = 4


def _spec(family="llama", **kw):
    return spec_from_hf_config(tiny_config(family, **kw).to_dict())


def _hf_state(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=g)
        for m in mapping.tensor_maps(spec)
        for name, shape in zip(m.hf, mapping.hf_shapes(m, spec), strict=True)
    }


# ------------------------------------------------------------------------------------------ bytes


def _stage_bytes(spec, layout):
    """(partitioned bytes per stage, replicated bytes per stage), computed from HF shapes and the layout."""
    part, rep = [0] * layout.pp, [0] * layout.pp
    per_stage = spec.num_layers // layout.pp
    for m in mapping.tensor_maps(spec):
        stage = m.layer // per_stage if m.layer is not None else (0 if "embedding" in m.mcore else layout.pp - 1)
        nbytes = sum(math.prod(s) for s in mapping.hf_shapes(m, spec)) * F32
        (rep if m.tp_dim is None else part)[stage] += nbytes
    return part, rep


@pytest.mark.parametrize("tp, pp, dp, g", [(2, 2, 1, 1), (4, 1, 1, 2), (2, 2, 1, 2), (2, 2, 2, 2), (4, 1, 1, 1),
                                           (1, 4, 1, 2)])
def test_hybrid_bytes_match_formula(tp, pp, dp, g):
    # V=512: no vocabulary padding on either side, so docs/resharding.md §3.2 holds exactly
    spec = _spec(vocab_size=512, num_heads=4, num_kv_heads=4)
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp)
    plan = make_plan(spec, layout, g)
    assert plan.grouping is Grouping.HYBRID
    assert plan.num_replicas == layout.world_size // g
    part, rep = _stage_bytes(spec, layout)
    m_part = sum(part)
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        own = part[c.pp] // tp
        # tp % g == 0: the training shard lies inside the rollout shard (M/TP_g - own shard);
        # otherwise (consecutive grouping) only the rollout slice of its own stage is local
        expected = m_part // g - (own if tp % g == 0 else part[c.pp] // g)
        expected += sum(rep) - rep[c.pp]  # norms of other stages, whole
        assert plan.received_bytes(rank, F32) == expected, rank
    if tp % g == 0:  # the paper's per-GPU average: M/(TP_g PP_g) - M/(T P)
        group = [layout.rank_of(t, p, 0) for p in range(pp) for t in range(tp)]
        avg_part = sum(plan.received_bytes(r, F32) - (sum(rep) - rep[layout.coords(r).pp]) for r in group) / (tp * pp)
        assert avg_part == pytest.approx(m_part / g - m_part / (tp * pp))


def test_consecutive_bytes_match_hand_count():
    spec = _spec(vocab_size=512, num_heads=4, num_kv_heads=4)
    layout = ParallelLayout(tp=2, pp=1, dp=2)
    plan = make_plan(spec, layout, 4)  # 4 does not divide tp*pp = 2: consecutive groups [0, 1, 2, 3]
    assert plan.grouping is Grouping.CONSECUTIVE
    assert [p.tp_rank for p in plan.places] == [0, 1, 2, 3]
    part, rep = _stage_bytes(spec, layout)
    quarter = sum(part) // 4
    # rollout quarter r of every split tensor: ranks 0 (training half 0 of DP 0) and 3 (half 1 of DP 1) hold
    # theirs; ranks 1 and 2 receive theirs from the holder in their own DP replica
    assert [plan.received_bytes(r, F32) for r in range(4)] == [0, quarter, quarter, 0]
    assert all(plan.dest_bytes(r, F32) == quarter + sum(rep) for r in range(4))
    for s in plan.slabs:
        assert layout.coords(s.src).dp == layout.coords(s.dst).dp


def test_traffic_stays_inside_model_parallel_group():
    spec = _spec()
    layout = ParallelLayout(tp=2, pp=2, dp=2)
    plan = make_plan(spec, layout, 1)
    for s in plan.slabs:
        assert layout.coords(s.src).dp == layout.coords(s.dst).dp


def test_hybridflow_groups_are_strided():
    spec = _spec(num_heads=8, num_kv_heads=4, hidden_size=64)
    layout = ParallelLayout(tp=4, pp=1, dp=1)
    plan = make_plan(spec, layout, 2)
    # docs/resharding.md §3.2: k = 2; rank t plays rollout rank t // 2 in micro-DP replica t % 2
    assert [(p.replica, p.tp_rank) for p in plan.places] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_bad_rollout_tp():
    spec = _spec(num_heads=4, num_kv_heads=2)
    with pytest.raises(LayoutError, match="attention heads"):
        make_plan(spec, ParallelLayout(tp=1, pp=1, dp=3), 3)
    with pytest.raises(LayoutError, match="divide the training world"):
        make_plan(spec, ParallelLayout(tp=2, pp=1, dp=1), 4)


# ------------------------------------------------------------------------------------ context parallelism


@pytest.mark.parametrize("tp_g", [1, 2])
def test_context_parallel_copies_each_feed_their_own_rollout_ranks(tp_g):
    """TP2 x CP2 (world 4: ranks (tp, cp) = (0,0) (1,0) (0,1) (1,1)), each CP index a whole copy of the model.
    Worked by hand: V=300 is padded to 512 by Megatron at TP2 (rows [0, 256) on TP rank 0, [256, 300) on 1) and to
    320 by vLLM (160 rows per rank at rollout tp 2, all 300 at tp 1); every other split tensor is halved alike on
    both sides. Each receiver takes what it lacks from its TP peer in its own CP copy, never across copies."""
    spec = _spec("llama", vocab_size=300, num_heads=4, num_kv_heads=2, hidden_size=64)  # untied: 2 vocab tensors
    layout = ParallelLayout(tp=2, cp=2)
    plan = make_plan(spec, layout, tp_g)
    h, v, d, i, n_layers = 64, 300, 16, 96, 4
    row = h * F32  # one vocabulary row
    if tp_g == 2:  # replicas = the copies, rollout TP rank = training TP rank; only the vocab tails move
        assert [(p.replica, p.tp_rank) for p in plan.places] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        moved = {(s.tensor, s.start, s.stop, s.src, s.dst) for s in plan.slabs if s.src != s.dst}
        assert moved == {(name, 160, 256, src, src + 1) for name in ("model.embed_tokens.weight", "lm_head.weight")
                         for src in (0, 2)}
        expected = [0, 2 * 96 * row, 0, 2 * 96 * row]
    else:  # every rank its own replica, receiving the half it lacks of every split tensor
        assert [(p.replica, p.tp_rank) for p in plan.places] == [(0, 0), (1, 0), (2, 0), (3, 0)]
        half = n_layers * (2 * h * h + 2 * 2 * d * h + 3 * i * h) * F32 // 2  # q, o; k, v (2 KV heads); gate, up, down
        assert all(s.src == s.dst or s.src == s.dst ^ 1 for s in plan.slabs)  # its TP peer at its own CP index
        expected = [half + 2 * (v - 256) * row, half + 2 * 256 * row] * 2
    assert [plan.received_bytes(r, F32) for r in range(4)] == expected
    for s in plan.slabs:
        assert layout.coords(s.src).cp == layout.coords(s.dst).cp, s
    # each copy is read once: what a copy's ranks send is what the same copy's ranks receive
    sent = [sum(plan.slab_bytes(s, F32) for s in plan.slabs if s.src == r != s.dst) for r in range(4)]
    assert sent[0] + sent[1] == expected[0] + expected[1] and sent[2] + sent[3] == expected[2] + expected[3]
    # the copies are placed and sourced as data-parallel replicas are (same rank numbers at TP2 x DP2)
    as_dp = make_plan(spec, ParallelLayout(tp=2, dp=2), tp_g)
    assert (plan.places, plan.slabs) == (as_dp.places, as_dp.slabs)
    shards = _execute_in_memory(plan, spec, _hf_state(spec))
    hf = _hf_state(spec)
    for rank in range(4):
        want = _vllm_by_hand(spec, hf, plan.places[rank].tp_rank, tp_g)
        assert all(torch.equal(shards[rank][name], want[name]) for name in want), rank


def test_context_parallel_vllm_groups_may_span_cp_ranks_of_one_replica():
    """vLLM's consecutive TP groups: at TP1 x CP2 x DP2 a group of 2 is the two CP ranks of one data-parallel
    replica (same prompts); a group of 4 would span both replicas."""
    layout = ParallelLayout(tp=1, cp=2, dp=2)
    check_vllm_groups(layout, 2)
    with pytest.raises(LayoutError, match=r"Rollout tp values that fit: \[1, 2\]"):
        check_vllm_groups(layout, 4)


# ----------------------------------------------------------------------------- vLLM shards, by hand


def _execute_in_memory(plan, spec, hf, dtype=torch.float32):
    """Run the plan with in-process copies instead of a transport: rank -> {HF name: rollout shard}."""
    layout, vp = plan.train, plan.padded_vocab
    pieces = {}
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        params = {}
        for m in mapping.tensor_maps(spec):
            full = mapping.to_mcore(m, spec, [hf[n] for n in m.hf], vp)
            params[m.mcore] = mapping.tp_shard(m, full, layout.tp, c.tp)
        pieces[rank] = LocalPieces(plan, spec, c.tp, params, dtype)
    out = {r: {} for r in plan.receivers}
    for bucket in make_buckets(plan, cap_bytes=4096, itemsize=4):  # small: the vocab tensors travel in parts
        for t in bucket.tensors:
            for r in out:
                if t.name not in out[r]:
                    out[r][t.name] = empty_dest(t, plan.dest[(t.name, r)], dtype)
        for s in bucket.slabs:
            t = plan.tensor(s.tensor)
            if layout.coords(s.src).pp != t.stage:
                raise AssertionError(f"{s} comes from a stage that does not hold {t.name}")
            dest_view(out[s.dst][t.name], t, plan.dest[(t.name, s.dst)][0], s).copy_(pieces[s.src].slab(s))
    return out


def _vllm_by_hand(spec, hf, g, tp_g):
    """The slice of every HF tensor that vLLM's QKVParallelLinear / MergedColumnParallelLinear /
    RowParallelLinear / VocabParallelEmbedding weight loaders narrow a checkpoint tensor to on rank g
    (vllm/model_executor/layers/linear.py, vocab_parallel_embedding.py): the part of the full-shape
    tensor a sync must fill."""
    d, n_g = spec.head_dim, spec.num_query_groups
    out = {}
    for name, t in hf.items():
        if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")) and tp_g > n_g:
            head = g // (tp_g // n_g)  # vLLM replicates KV heads past the KV groups
            out[name] = t[head * d:(head + 1) * d]
        elif name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "v_proj.weight", "k_proj.bias",
                            "v_proj.bias", "gate_proj.weight", "up_proj.weight")):
            out[name] = t.chunk(tp_g)[g]
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = t.chunk(tp_g, dim=1)[g]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            per = math.ceil(spec.vocab_size / 64) * 64 // tp_g  # org_vocab_start/end_index: 64-padded shards
            out[name] = t[g * per:(g + 1) * per]
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("family, tied, heads, kv, tp, pp, tp_g", [
    ("llama", False, 8, 4, 4, 1, 2),   # acceptance: TP_t=4 PP_t=1 -> TP_g=2
    ("llama", False, 4, 2, 2, 2, 2),   # acceptance: TP_t=2 PP_t=2 -> TP_g=2
    ("qwen2", True, 4, 2, 2, 2, 4),    # TP_g > KV heads: vLLM replicates KV heads; tied embedding sent once
    ("qwen2", False, 4, 2, 2, 2, 1),   # embedded engines: full tensors everywhere
])
@pytest.mark.parametrize("grouping", [Grouping.HYBRID, Grouping.CONSECUTIVE])  # embedded engines, vLLM
def test_rollout_shards_equal_vllm_layout(family, tied, heads, kv, tp, pp, tp_g, grouping):
    # V=300: Megatron pads to 512 (128 rows per TP4 rank, rank 3 empty), vLLM to 320 (160 per TP2 rank)
    spec = _spec(family, vocab_size=300, num_heads=heads, num_kv_heads=kv, hidden_size=64, tied=tied)
    hf = _hf_state(spec)
    layout = ParallelLayout(tp=tp, pp=pp, dp=1)
    plan = make_plan(spec, layout, tp_g, grouping=grouping)
    shards = _execute_in_memory(plan, spec, hf)
    for rank in range(layout.world_size):
        place = plan.places[rank]
        got = shards[rank]
        want = _vllm_by_hand(spec, hf, place.tp_rank, tp_g)
        assert set(got) == set(want)
        for name in want:
            assert torch.equal(got[name], want[name]), (rank, name)
    if tied:
        assert "lm_head.weight" not in shards[0]


@pytest.mark.parametrize("tp, pp, dp, cp, tp_g, rollout_ranks", [
    (2, 1, 1, 1, 1, 2), (2, 2, 1, 1, 2, 4), (1, 2, 2, 1, 1, 3), (2, 1, 2, 1, 2, 2),
    (1, 1, 1, 2, 1, 2), (2, 1, 2, 2, 2, 6),  # context parallelism: CP copies send like DP replicas
])
def test_split_placement_shards_equal_vllm_layout(tp, pp, dp, cp, tp_g, rollout_ranks):
    # rollout engines on a pool of their own: training ranks only send, rollout ranks (after them) only receive,
    # and each replica's shards equal vLLM's slices; the sending spreads over the training copies (DP x CP)
    spec = _spec("qwen2", vocab_size=300, num_heads=4, num_kv_heads=2, hidden_size=64)
    hf = _hf_state(spec)
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp, cp=cp)
    plan = make_plan(spec, layout, tp_g, rollout_ranks=rollout_ranks)
    assert plan.split and plan.grouping is Grouping.CONSECUTIVE
    assert plan.receivers == list(range(layout.world_size, layout.world_size + rollout_ranks))
    assert plan.num_replicas == rollout_ranks // tp_g
    assert all(s.src < layout.world_size <= s.dst for s in plan.slabs)  # no rank both sends and receives
    shards = _execute_in_memory(plan, spec, hf)
    for i, rank in enumerate(plan.receivers):
        want = _vllm_by_hand(spec, hf, i % tp_g, tp_g)
        assert set(shards[rank]) == set(want)
        for name in want:
            assert torch.equal(shards[rank][name], want[name]), (rank, name)
    # replica g reads copy g mod (DP*CP), copy k being data-parallel replica k div CP at CP index k mod CP
    senders = {(layout.coords(s.src).dp, layout.coords(s.src).cp) for s in plan.slabs}
    assert senders == {divmod(k, cp) for k in range(min(dp * cp, plan.num_replicas))}
    with pytest.raises(LayoutError, match="rollout pool"):
        make_plan(spec, layout, 2, rollout_ranks=3)


def test_full_tensor_buckets_count_whole_tensors():
    # vLLM's receivers hold full-shape tensors even at rollout tp 2: a bucket's cap counts them whole. TP2 ->
    # rollout tp 2: every rank keeps its own shard and nothing travels, so shard accounting counts half
    spec = _spec(vocab_size=512)
    plan = make_plan(spec, ParallelLayout(tp=2, pp=1), 2, grouping=Grouping.CONSECUTIVE)
    cap = 100_000

    def whole_bytes(buckets):
        return [sum(math.prod(t.shape) * F32 for t in b.tensors) for b in buckets if b.final and len(b.tensors) > 1]

    assert max(whole_bytes(make_buckets(plan, cap, F32))) > cap  # shard-sized accounting would overshoot
    assert max(whole_bytes(make_buckets(plan, cap, F32, full_tensors=True))) <= cap
    nan = empty_dest(plan.tensor("model.layers.0.mlp.up_proj.weight"), (0, 48), torch.float32, full=True)
    assert nan.shape == plan.tensor("model.layers.0.mlp.up_proj.weight").shape and bool(nan.isnan().all())


def test_buckets_respect_cap_and_order():
    spec = _spec(vocab_size=512)
    plan = make_plan(spec, ParallelLayout(tp=2, pp=2), 1)
    cap = 40_000
    buckets = make_buckets(plan, cap, F32)
    assert [t.name for b in buckets if b.final for t in b.tensors] == [t.name for t in plan.tensors]
    rows: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for b in buckets:
        if b.final and len(b.tensors) > 1:  # whole tensors, TP_g=1: every rank holds them in full
            assert sum(math.prod(t.shape) * F32 for t in b.tensors) <= cap
        for s in b.slabs:
            rows.setdefault((s.tensor, s.dst), []).append((s.start, s.stop))
        for src in range(4):  # one outgoing copy per distinct slab, however many peers receive it
            sent = {(s.tensor, s.start, s.stop) for s in b.slabs if s.src == src and s.dst != src}
            assert sum(plan.slab_bytes(Slab(n, a, z, src, -1), F32) for n, a, z in sent) <= cap
    # every rank's rollout shard is covered exactly once, in order
    for (name, dst), ranges in rows.items():
        assert ranges[0][0] == plan.dest[(name, dst)][0] and ranges[-1][1] == plan.dest[(name, dst)][1]
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    # the embedding (512 x 64 fp32 = 131 kB) is over the cap: several parts, only the last one final
    parts = [b for b in buckets if b.tensors[0].name == "model.embed_tokens.weight"]
    assert len(parts) > 1 and [b.final for b in parts] == [False] * (len(parts) - 1) + [True]
