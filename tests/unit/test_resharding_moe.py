"""Resharding plan for a Mixture-of-Experts model (issue #24, docs/resharding.md §3.8), without a process group:
bytes received and sent per rank against the formulas worked out by hand from the dimensions, every expert slab's
source against the expert-parallel placement written out by hand, every rollout rank's coverage, an in-memory
execution from ranks that hold only their own experts into the embedded engine, and dense plans unchanged.

The model: Qwen3-MoE, 2 layers, hidden 64, 4 heads of 16 with 2 KV groups (q/k norms of 16), 4 experts of width 32
with top-2 routing, vocabulary 256 (a multiple of 128 * TP: nobody pads it), untied.
"""

from __future__ import annotations

import hashlib
import re

import pytest
import torch

from megarl.errors import LayoutError
from megarl.models import mapping
from megarl.models.spec import spec_from_hf_config
from megarl.parallel.layout import ParallelLayout
from megarl.resharding.buckets import LocalPieces, dest_view, empty_dest, make_buckets
from megarl.resharding.plan import Grouping, make_plan

H, V, L, NH, NG, D = 64, 256, 2, 4, 2, 16
E, K, FE = 4, 2, 32  # experts, top-k, expert width
BF16 = 2
MOE_HF = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=V, hidden_size=H, intermediate_size=96,
              moe_intermediate_size=FE, num_experts=E, num_experts_per_tok=K, norm_topk_prob=True,
              num_hidden_layers=L, num_attention_heads=NH, num_key_value_heads=NG, head_dim=D, rms_norm_eps=1e-6,
              hidden_act="silu", tie_word_embeddings=False)

# elements per layer: q/k/v rows (4 + 2 + 2 heads of 16) x 64 and o_proj 64 x 64 (split by TP); the two norms, the
# q/k norms and the router 4 x 64 (replicated); each expert's gate, up and down 3 x 32 x 64 (whole, placed by EP)
ATTN = (NH + 2 * NG) * D * H + H * NH * D  # 12288
LAYER_REPL = 2 * H + 2 * D + E * H  # 416
EXPERT = 3 * FE * H  # 6144
EMBED = V * H  # embedding and lm_head each: 16384, split by TP
N = L * (ATTN + LAYER_REPL + E * EXPERT) + 2 * EMBED + H  # + final norm: 107392
LAYOUTS = [(1, 1, 4, 2), (2, 1, 2, 2), (1, 2, 2, 2)]  # tp, pp, dp, ep


@pytest.fixture(scope="module")
def spec():
    return spec_from_hf_config(dict(MOE_HF))


def _stages(pp):
    """Per pipeline stage: (TP-split elements, replicated elements, expert elements) of the tensors it holds."""
    if pp == 1:
        return [(2 * ATTN + 2 * EMBED, 2 * LAYER_REPL + H, 2 * E * EXPERT)]
    return [(ATTN + EMBED, LAYER_REPL, E * EXPERT),  # embedding, layer 0
            (ATTN + EMBED, LAYER_REPL + H, E * EXPERT)]  # layer 1, final norm, lm_head


def _coords(rank, tp, dp, ep):
    """(tp, dp, pp, expert shard, expert replica) of a training rank, megatron-core's order written out: TP
    fastest, then DP, then PP; within a stage, local rank r holds expert shard r mod ep, as replica r div ep."""
    local = rank % (tp * dp)
    return local % tp, local // tp, rank // (tp * dp), local % ep, local // ep


def _holds(rank, layer, expert, tp, pp, dp, ep):
    _, _, stage, shard, _ = _coords(rank, tp, dp, ep)
    return stage == layer // (L // pp) and shard == expert // (E // ep)


def _sent(plan, rank):
    return sum(plan.slab_bytes(s, BF16) for s in plan.slabs if s.src == rank and s.dst != rank)


def test_hand_counts(spec):
    assert (ATTN, LAYER_REPL, EXPERT, N) == (12288, 416, 6144, 107392)
    assert spec.num_parameters() == N
    for pp in (1, 2):
        assert sum(sum(s) for s in _stages(pp)) == N


# ------------------------------------------------------------------------------------------ bytes


@pytest.mark.parametrize("tp, pp, dp, ep", LAYOUTS)
def test_colocated_bytes_match_formula(spec, tp, pp, dp, ep):
    """docs/resharding.md §3.8, rollout tp 1 (every rank its own replica, HYBRID): rank on stage p receives
    ``M - S_p/T - R_p - X_p/ep`` and sends ``(T P - 1) S_p/T + (P - 1) R_p + (P ep - 1) X_p/ep``."""
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp, ep=ep)
    plan = make_plan(spec, layout, 1)
    assert plan.grouping is Grouping.HYBRID and plan.num_replicas == layout.world_size
    stages = _stages(pp)
    for rank in range(layout.world_size):
        split, repl, experts = stages[_coords(rank, tp, dp, ep)[2]]
        received = N - split // tp - repl - experts // ep
        sent = (tp * pp - 1) * split // tp + (pp - 1) * repl + (pp * ep - 1) * experts // ep
        assert plan.received_bytes(rank, BF16) == BF16 * received, rank
        assert _sent(plan, rank) == BF16 * sent, rank
        assert plan.dest_bytes(rank, BF16) == BF16 * N


@pytest.mark.parametrize("tp, pp, dp, ep", LAYOUTS)
def test_split_bytes_match_formula(spec, tp, pp, dp, ep):
    """A rollout pool of R = 2 ranks at tp 1: each receives M; training rank (t, d, p, expert replica j) sends its
    dense shard to the n_d receivers g with g mod D = d, its replicated tensors to those with also
    (g div D) mod T = t, and its experts to the n_j receivers i with i mod (T D / ep) = j."""
    layout, rollout = ParallelLayout(tp=tp, pp=pp, dp=dp, ep=ep), 2
    plan = make_plan(spec, layout, 1, rollout_ranks=rollout)
    world, edp, stages = layout.world_size, tp * dp // ep, _stages(pp)
    for i in range(rollout):
        assert plan.received_bytes(world + i, BF16) == BF16 * N
    for rank in range(world):
        t, d, p, _, j = _coords(rank, tp, dp, ep)
        split, repl, experts = stages[p]
        n_d = sum(g % dp == d for g in range(rollout))
        n_dt = sum(g % dp == d and (g // dp) % tp == t for g in range(rollout))
        n_j = sum(i % edp == j for i in range(rollout))
        assert _sent(plan, rank) == BF16 * (n_d * split // tp + n_dt * repl + n_j * experts // ep), rank
        assert plan.received_bytes(rank, BF16) == 0


@pytest.mark.parametrize("tp, pp, dp, ep, received, sent, pool_sent", [
    # TP1xDP4xEP2: a rank lacks the 2 x 2 experts of its EP peer; the pool's two receivers draw the dense model
    # from DP replicas 0 and 1, the experts from expert replicas 0 (ranks 0, 1) and 1 (ranks 2, 3)
    (1, 1, 4, 2, [24576] * 4, [24576] * 4, [82816, 82816, 24576, 24576]),
    (2, 1, 2, 2, [53248] * 4, [53248] * 4, [54144, 53248, 54144, 53248]),
    (1, 2, 2, 2, [66016, 66016, 65952, 65952], [65952, 65952, 66016, 66016], [53664, 53664, 53728, 53728]),
])
def test_bytes_worked_by_hand(spec, tp, pp, dp, ep, received, sent, pool_sent):
    """The formulas' numbers, worked out once by hand (elements): docs/resharding.md §3.8's table."""
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp, ep=ep)
    plan = make_plan(spec, layout, 1)
    assert [plan.received_bytes(r, BF16) for r in range(4)] == [BF16 * n for n in received]
    assert [_sent(plan, r) for r in range(4)] == [BF16 * n for n in sent]
    pool = make_plan(spec, layout, 1, rollout_ranks=2)
    assert [_sent(pool, r) for r in range(4)] == [BF16 * n for n in pool_sent]
    assert sum(pool_sent) == 2 * N


# ---------------------------------------------------------------------------------- sources, coverage

_EXPERT_NAME = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


@pytest.mark.parametrize("tp, pp, dp, ep", LAYOUTS + [(2, 2, 1, 2), (1, 1, 4, 4)])
@pytest.mark.parametrize("rollout_ranks", [None, 2, 3])
def test_expert_sources_hold_their_expert(spec, tp, pp, dp, ep, rollout_ranks):
    """Every expert slab comes from a rank that holds the expert: its own expert replica's holder (colocated), the
    holder of expert replica i mod (T D / ep) for rollout rank i of a pool; a holder keeps its own experts."""
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp, ep=ep)
    plan = make_plan(spec, layout, 1, rollout_ranks=rollout_ranks)
    world, edp, seen = layout.world_size, tp * dp // ep, 0
    for s in plan.slabs:
        m = _EXPERT_NAME.match(s.tensor)
        if m is None:
            continue
        seen += 1
        layer, expert = int(m[1]), int(m[2])
        assert _holds(s.src, layer, expert, tp, pp, dp, ep), s
        if rollout_ranks is None:
            assert _coords(s.src, tp, dp, ep)[4] == _coords(s.dst, tp, dp, ep)[4], s
            assert (s.src == s.dst) == _holds(s.dst, layer, expert, tp, pp, dp, ep), s
        else:
            assert _coords(s.src, tp, dp, ep)[4] == (s.dst - world) % edp, s
    assert seen == L * E * 3 * len(plan.receivers)


@pytest.mark.parametrize("tp, pp, dp, ep", LAYOUTS)
@pytest.mark.parametrize("rollout_ranks", [None, 2])
def test_every_rollout_rank_gets_every_byte_once(spec, tp, pp, dp, ep, rollout_ranks):
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp, ep=ep)
    plan = make_plan(spec, layout, 1, rollout_ranks=rollout_ranks)
    pieces: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for b in make_buckets(plan, 8192, BF16):
        for s in b.slabs:
            pieces.setdefault((s.tensor, s.dst), []).append((s.start, s.stop))
    assert set(pieces) == {(t.name, r) for t in plan.tensors for r in plan.receivers}
    for t in plan.tensors:
        whole = (0, 1) if t.dim is None else (0, t.shape[t.dim])
        for r in plan.receivers:
            ranges = sorted(pieces[(t.name, r)])
            assert ranges[0][0] == whole[0] and ranges[-1][1] == whole[1], (t.name, r)
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)), (t.name, r)
            assert plan.dest[(t.name, r)] == whole


def _hf_state(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for m in mapping.tensor_maps(spec)
            for name, shape in zip(m.hf, mapping.hf_shapes(m, spec), strict=True)}


def _training_params(spec, layout, hf, rank):
    """The Megatron shards ``rank`` holds: its stage's tensors, its TP slice, and only its own experts."""
    tp, dp, ep = layout.tp, layout.dp, layout.ep
    t, _, stage, _, _ = _coords(rank, tp, dp, ep)
    params = {}
    for m in mapping.tensor_maps(spec):
        holder_stage = (m.layer // (L // layout.pp) if m.layer is not None
                        else 0 if m.mcore.startswith("embedding") else layout.pp - 1)
        if holder_stage != stage or (m.expert is not None and not _holds(rank, m.layer, m.expert, tp, layout.pp,
                                                                         dp, ep)):
            continue
        full = mapping.to_mcore(m, spec, [hf[n] for n in m.hf], spec.padded_vocab_size(tp))
        params[m.mcore] = mapping.tp_shard(m, full, tp, t)
    return params


def _execute(plan, spec, hf):
    """The plan run with in-process copies (fp32): receiver -> {HF name: rollout tensor}."""
    layout = plan.train
    pieces = {r: LocalPieces(plan, spec, layout.coords(r).tp, _training_params(spec, layout, hf, r), torch.float32)
              for r in range(layout.world_size)}
    out = {r: {} for r in plan.receivers}
    for bucket in make_buckets(plan, cap_bytes=16384, itemsize=4):
        for t in bucket.tensors:
            for r in out:
                out[r].setdefault(t.name, empty_dest(t, plan.dest[(t.name, r)], torch.float32))
        for s in bucket.slabs:
            t = plan.tensor(s.tensor)
            dest_view(out[s.dst][t.name], t, plan.dest[(t.name, s.dst)][0], s).copy_(pieces[s.src].slab(s))
    return out


@pytest.mark.parametrize("tp, pp, dp, ep", LAYOUTS)
@pytest.mark.parametrize("rollout_ranks", [None, 2])
def test_execution_from_expert_shards_rebuilds_the_checkpoint(spec, tp, pp, dp, ep, rollout_ranks):
    """Ranks that hold only their own experts (a wrong source would find nothing to send) give every rollout
    rank the HF checkpoint, bit for bit."""
    hf = _hf_state(spec)
    plan = make_plan(spec, ParallelLayout(tp=tp, pp=pp, dp=dp, ep=ep), 1, rollout_ranks=rollout_ranks)
    for r, tensors in _execute(plan, spec, hf).items():
        assert tensors.keys() == hf.keys()
        for name, t in hf.items():
            assert torch.equal(tensors[name], t), (r, name)


def test_sync_into_the_embedded_engine(spec):
    """End to end without processes: a random Qwen3-MoE, its Megatron shards at TP1xPP2xDP2xEP2, the plan's slabs
    into an embedded engine on rank 1 (stage 0, expert shard 1): logits equal the model's."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from megarl.rollout import EmbeddedEngine
    from megarl.testing.tiny import per_expert, randomize_

    config = Qwen3MoeConfig(**MOE_HF, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_(model, seed=1)
    hf = per_expert(model.state_dict(), FE)  # transformers' fused experts -> per-expert checkpoint tensors
    assert hf.keys() == _hf_state(spec).keys()
    plan = make_plan(spec, ParallelLayout(tp=1, pp=2, dp=2, ep=2), 1)
    engine = EmbeddedEngine(config, pad_token_id=0)
    engine.update_weights(_execute(plan, spec, hf)[1].items())
    engine.finish_weight_update()
    ids = torch.tensor([[5, 17, 42, 9, 100, 3]])
    with torch.no_grad():
        assert torch.equal(engine.model(ids).logits, model(ids).logits)


# ------------------------------------------------------------------------------------- refusals, EP1


# the dimension vLLM's fused-MoE layer cuts an expert's HF tensor along over its TP ranks (written out by hand:
# gate/up [FE, H] by rows, down [H, FE] by columns, as a dense MLP)
_EXPERT_CUT = {"gate_proj": 0, "up_proj": 0, "down_proj": 1}


@pytest.mark.parametrize("tp, pp, dp, ep", LAYOUTS)
@pytest.mark.parametrize("rollout_ranks", [None, 2])
def test_rollout_tp2_ranks_receive_their_slice_of_every_expert(spec, tp, pp, dp, ep, rollout_ranks):
    """Rollout tp 2 (vLLM, CONSECUTIVE groups): rollout TP rank g ends up with rows / columns [g FE/2, (g+1) FE/2) of
    every expert's projections, sliced by hand out of the HF tensors, from ranks that hold only their own experts;
    and each rank receives exactly L E EXPERT / 2 expert elements (minus what it keeps)."""
    hf = _hf_state(spec)
    layout = ParallelLayout(tp=tp, pp=pp, dp=dp, ep=ep)
    plan = make_plan(spec, layout, 2, grouping=None if rollout_ranks else Grouping.CONSECUTIVE,
                     rollout_ranks=rollout_ranks)
    out = _execute(plan, spec, hf)
    half = FE // 2
    for r, tensors in out.items():
        g = plan.places[r].tp_rank
        for name, full in hf.items():
            m = _EXPERT_NAME.match(name)
            if m is None:
                continue
            dim = _EXPERT_CUT[name.split(".")[-2]]
            assert torch.equal(tensors[name], full.narrow(dim, g * half, half)), (r, name)
        expert_recv = sum(plan.slab_bytes(s, BF16) for s in plan.slabs
                          if s.dst == r and _EXPERT_NAME.match(s.tensor))
        assert expert_recv == BF16 * L * E * EXPERT // 2, r


def test_rollout_tp_must_fit_the_experts():
    """vLLM cuts every expert's width over its TP ranks and needs at least as many experts as ranks."""
    from megarl.resharding.plan import check_expert_rollout

    narrow = spec_from_hf_config({**MOE_HF, "moe_intermediate_size": 30})
    with pytest.raises(LayoutError, match=r"tp=4 cannot split the 4 experts.*intermediate size 30.*\[1, 2, 3\]"):
        check_expert_rollout(narrow, 4)
    with pytest.raises(LayoutError, match=r"rollout tp=8 cannot split the 4 experts.*tp <= the number of experts"):
        make_plan(spec_from_hf_config(dict(MOE_HF)), ParallelLayout(tp=1, pp=1, dp=8, ep=2), 8,
                  grouping=Grouping.CONSECUTIVE)
    check_expert_rollout(narrow, 2)
    check_expert_rollout(narrow, 3)


def test_ep1_experts_come_from_where_replicated_tensors_do(spec):
    """At ep 1 every rank of a stage holds every expert: an expert travels like the layer's router."""
    plan = make_plan(spec, ParallelLayout(tp=2, pp=2, dp=2), 1)
    router = {(int(s.tensor.split(".")[2]), s.dst): s.src for s in plan.slabs if s.tensor.endswith("mlp.gate.weight")}
    for s in plan.slabs:
        m = _EXPERT_NAME.match(s.tensor)
        if m is not None:
            assert s.src == router[(int(m[1]), s.dst)], s


@pytest.mark.parametrize("tp, pp, dp, cp, ep", [(1, 1, 2, 2, 2), (2, 1, 1, 2, 4), (1, 2, 1, 2, 2)])
@pytest.mark.parametrize("rollout_ranks", [None, 2])
def test_context_parallel_ranks_place_experts_as_data_parallel_ranks_do(spec, tp, pp, dp, cp, ep, rollout_ranks):
    """Context parallelism: a stage's TP x CP x DP ranks are numbered as TP x (CP*DP) ranks are, and CP ranks are
    replicas like DP ranks, so the plan (places and slabs) is the one at dp' = cp * dp, which the tests above check;
    at ep 4 over TP2 x CP2 an expert comes from the other CP copy of the receiver's expert-parallel group."""
    plan = make_plan(spec, ParallelLayout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep), 1, rollout_ranks=rollout_ranks)
    as_dp = make_plan(spec, ParallelLayout(tp=tp, pp=pp, dp=dp * cp, ep=ep), 1, rollout_ranks=rollout_ranks)
    assert (plan.places, plan.slabs) == (as_dp.places, as_dp.slabs)
    layout, crossing = plan.train, 0
    for s in plan.slabs:
        m = _EXPERT_NAME.match(s.tensor)
        if m is not None:
            assert _holds(s.src, int(m[1]), int(m[2]), tp, pp, dp * cp, ep), s
            crossing += rollout_ranks is None and layout.coords(s.src).cp != layout.coords(s.dst).cp
    assert (crossing > 0) == (rollout_ranks is None and tp % ep != 0)  # ep 4 > tp 2: the group spans both copies


# ------------------------------------------------------------------------------------ dense unchanged

_DENSE = [  # architecture, V, heads, KV heads, tied, (tp, pp, dp), rollout tp, grouping, rollout ranks, digest
    ("Qwen2ForCausalLM", 300, 4, 2, False, (2, 2, 2), 1, None, None, "72b152389fe7a9b5"),
    ("Qwen2ForCausalLM", 300, 4, 2, False, (2, 2, 2), 2, Grouping.CONSECUTIVE, None, "dc1d29da6fae7342"),
    ("LlamaForCausalLM", 300, 8, 4, False, (4, 1, 2), 2, None, None, "e71fd89e698961bd"),
    ("Qwen3ForCausalLM", 300, 4, 2, True, (2, 2, 1), 4, None, None, "3594ed0cd32ca97e"),
    ("Qwen2ForCausalLM", 300, 4, 2, False, (1, 2, 2), 1, None, 3, "6d6fed0d04e5a88f"),
    ("Qwen2ForCausalLM", 300, 4, 2, False, (2, 1, 2), 2, None, 4, "4481569c2303ebb7"),
]


@pytest.mark.parametrize("arch, vocab, heads, kv, tied, layout, tp_g, grouping, rollout_ranks, digest", _DENSE)
def test_dense_plans_unchanged(arch, vocab, heads, kv, tied, layout, tp_g, grouping, rollout_ranks, digest):
    """Digests of dense plans (tensors, places, slabs, destinations, buckets) recorded with the plan as it was
    before it placed experts by expert parallelism: that change must not move a byte of a dense model."""
    dense = spec_from_hf_config(dict(architectures=[arch], vocab_size=vocab, hidden_size=64, intermediate_size=96,
                                     num_hidden_layers=4, num_attention_heads=heads, num_key_value_heads=kv,
                                     head_dim=64 // heads, rms_norm_eps=1e-5, hidden_act="silu",
                                     tie_word_embeddings=tied))
    tp, pp, dp = layout
    plan = make_plan(dense, ParallelLayout(tp=tp, pp=pp, dp=dp), tp_g, grouping=grouping, rollout_ranks=rollout_ranks)
    parts = [plan.grouping.value, plan.padded_vocab,
             [(t.name, t.shape, t.dim, t.split.value, t.mcore, t.index, t.stage) for t in plan.tensors],
             [None if p is None else (p.replica, p.tp_rank) for p in plan.places],
             [(s.tensor, s.start, s.stop, s.src, s.dst) for s in plan.slabs], sorted(plan.dest.items()),
             [([t.name for t in b.tensors], [(s.tensor, s.start, s.stop, s.src, s.dst) for s in b.slabs], b.final)
              for b in make_buckets(plan, 20000, 2)]]
    assert hashlib.sha256(repr(parts).encode()).hexdigest()[:16] == digest
    assert all(t.expert is None for t in plan.tensors)
