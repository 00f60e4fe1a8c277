"""Resharding plan: which slices of which HF tensors every rank sends, receives and keeps.

A pure, deterministic function of (training layout TP_t/PP_t/DP_t/VPP/CP_t, rollout TP size TP_g,
model spec). It imports torch only for dtypes: no process group, no megatron-core, no engine.

Everything is expressed in *HF space*: the model's HF tensors (``q_proj``, ``gate_proj``,
``embed_tokens`` ... trimmed to the true vocabulary). Every HF tensor is either replicated or cut
into contiguous ranges along one dimension, both by Megatron's tensor parallelism and by vLLM's
(docs/resharding.md §2.1-2.2): q/k/v rows by whole query groups, gate/up rows per half, o/down columns,
vocabulary rows (Megatron: ``Vp/T`` per rank; vLLM: ``ceil(V/64)*64/G`` per rank). So a transfer
is a :class:`Slab`: one range of one HF tensor from one rank to another.

Context parallelism: the CP_t ranks of one data-parallel replica hold the same weights (each TP_t x PP_t slice
with the same CP index is a whole copy of the model), so a training world holds DP_t x CP_t copies; the plan treats
each copy as the data-parallel replicas are treated below: its own rollout replicas, its own sources.

Rollout places (which rollout replica and TP rank each training rank plays):

* ``HYBRID`` (TP_g divides TP_t*PP_t), the HybridFlow grouping (docs/resharding.md §3.2): inside one copy's
  model-parallel group (one data-parallel replica's, at one CP index), with k = TP_t/TP_g, training TP rank t plays
  rollout TP rank t // k and micro-DP replica (t mod k) + k*pp — so the rollout TP group is strided
  and a rank's training shard lies inside its rollout shard (received bytes per rank
  ``M/TP_g - own shard``). When TP_g does not divide TP_t the model-parallel group is numbered
  TP-fastest and cut into consecutive rollout groups. Copy ``dp*CP + cp`` holds replicas ``copy*(TP_t*PP_t/TP_g)``
  onwards.
* ``CONSECUTIVE`` (otherwise, and vLLM's: its TP groups are consecutive global ranks): rollout group g is
  global ranks ``[g*TP_g, (g+1)*TP_g)``, each rank receiving its rollout shard (no layout constraint,
  but a rank's training shard need not lie inside its rollout shard, so more bytes move than with
  ``HYBRID``).

Sources (dense tensors): a rank keeps what it holds; otherwise a slab comes from the holder in the receiver's
own copy (its data-parallel replica and CP index; same TP rank for replicated tensors), so all traffic stays inside
one model-parallel group, as in HybridFlow, and each copy is read once, by its own ranks.

Split placement (``rollout_ranks``: the rollout engines run on a pool of their own): the plan's world is
the training ranks ``0..T-1`` followed by the rollout ranks ``T..T+R-1`` (CONSECUTIVE groups among them);
training ranks only send, rollout ranks only receive. Rollout replica ``g`` draws every slab from training copy
``g mod (DP*CP)`` (copy ``dp*CP + cp``: data-parallel replica ``dp`` at CP index ``cp``; replicated tensors from TP
rank ``(g div (DP*CP) + its TP rank) mod TP``), so the sending load spreads over the copies and their TP ranks.

MoE experts (docs/resharding.md §3.8): in training an expert's HF tensors are held whole (expert TP is 1), and only
by the ranks of the layer's stage whose expert-parallel rank owns the expert (:meth:`ParallelLayout.expert_coords`):
one holder in each *expert-parallel group* of the stage (of its TP_t*CP_t*DP_t ranks), the ``ep`` ranks with the
same expert-data-parallel index ``edp`` (stage-local ranks ``edp*ep .. edp*ep+ep-1``, which together hold every expert
once). A rollout rank holds every expert, cut by its TP like a dense MLP (vLLM's fused-MoE layer without expert
parallelism: ``gate_proj``/``up_proj`` rows, ``down_proj`` columns, ``I/TP_g`` each; whole at TP_g = 1, the embedded
engine).
Source rule, deterministic: a colocated receiver takes an expert from the holder in the group with its own ``edp``
index on the layer's stage -- itself when it holds the expert; a holder in its own copy whenever ep divides
tp; the rank a replicated tensor comes from when ep is 1. Rollout rank ``i`` of a split pool takes it from group
``i mod (tp*cp*dp/ep)``. So each holder sends its experts (its receivers' slices of them)
to the ``ep*PP - 1`` other ranks with its ``edp`` index (colocated), and the pool's receivers spread evenly over
the groups.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Iterable

from megarl.errors import LayoutError
from megarl.models.mapping import Kind, TensorMap, hf_shapes, tensor_maps
from megarl.models.spec import ModelSpec
from megarl.parallel.layout import ParallelLayout

VLLM_VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


class Grouping(enum.Enum):
    HYBRID = "hybrid"
    CONSECUTIVE = "consecutive"


class Split(enum.Enum):
    """How an HF tensor is cut along its tensor-parallel dimension."""

    NONE = "none"  # replicated
    EVEN = "even"  # equal contiguous ranges
    KV = "kv"  # key/value rows: by KV head; vLLM replicates heads when TP_g > groups
    VOCAB = "vocab"  # vocabulary rows with padding rules on both sides


@dataclasses.dataclass(frozen=True)
class HFTensor:
    name: str
    shape: tuple[int, ...]
    dim: int | None  # the tensor-parallel dimension; None when replicated
    split: Split
    mcore: str  # the Megatron parameter it is part of
    index: int  # its position in that parameter's HF tuple
    stage: int  # pipeline rank that holds it
    expert: int | None = None  # global expert index of an MoE expert's tensor (whole, placed by expert parallelism)

    @property
    def row_elems(self) -> int:
        """Elements per unit of the split dimension (the whole tensor when replicated)."""
        if self.dim is None:
            return math.prod(self.shape)
        return math.prod(self.shape) // self.shape[self.dim]

    @property
    def length(self) -> int:
        return 1 if self.dim is None else self.shape[self.dim]


@dataclasses.dataclass(frozen=True)
class RolloutPlace:
    replica: int  # global rollout replica index
    tp_rank: int  # rank inside that replica's rollout TP group


@dataclasses.dataclass(frozen=True)
class Slab:
    """Range [start, stop) of ``tensor`` along its TP dim (whole tensor when replicated), src -> dst."""

    tensor: str
    start: int
    stop: int
    src: int
    dst: int


@dataclasses.dataclass(frozen=True)
class ReshardPlan:
    train: ParallelLayout
    rollout_tp: int
    grouping: Grouping
    padded_vocab: int
    tensors: tuple[HFTensor, ...]  # the global order every rank agrees on
    places: tuple[RolloutPlace | None, ...]  # by rank of the plan's world; None: a training rank that only sends
    slabs: tuple[Slab, ...]  # in tensor order, then destination rank, then start
    dest: dict[tuple[str, int], tuple[int, int]]  # (tensor, rank) -> range that rank ends up holding

    def tensor(self, name: str) -> HFTensor:
        return self._by_name[name]

    @functools.cached_property
    def _by_name(self) -> dict[str, HFTensor]:
        return {t.name: t for t in self.tensors}

    def slab_bytes(self, slab: Slab, itemsize: int) -> int:
        t = self._by_name[slab.tensor]
        return (slab.stop - slab.start) * t.row_elems * itemsize

    def received_bytes(self, rank: int, itemsize: int) -> int:
        """Bytes ``rank`` receives from other ranks (its own kept slabs excluded)."""
        by_name = self._by_name
        return sum(
            (s.stop - s.start) * by_name[s.tensor].row_elems * itemsize
            for s in self.slabs
            if s.dst == rank and s.src != rank
        )

    def dest_bytes(self, rank: int, itemsize: int) -> int:
        """Bytes of rollout weights ``rank`` ends up holding."""
        by_name = self._by_name
        return sum((b - a) * by_name[n].row_elems * itemsize for (n, r), (a, b) in self.dest.items() if r == rank)

    @property
    def num_replicas(self) -> int:
        return len({p.replica for p in self.places if p is not None})

    @property
    def split(self) -> bool:
        """Whether the rollout ranks are apart from the training ranks (ranks ``train.world_size`` and up)."""
        return len(self.places) > self.train.world_size

    def tp_group(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s rollout replica, in rollout TP order."""
        replica = self.places[rank].replica
        return [r for _, r in sorted((p.tp_rank, r) for r, p in enumerate(self.places)
                                     if p is not None and p.replica == replica)]

    @property
    def receivers(self) -> list[int]:
        """The ranks that hold rollout shards."""
        return [r for r, p in enumerate(self.places) if p is not None]


def make_plan(
    spec: ModelSpec, train: ParallelLayout, rollout_tp: int, *, padded_vocab: int | None = None,
    grouping: Grouping | None = None, rollout_ranks: int | None = None,
) -> ReshardPlan:
    """The plan for moving ``spec``'s weights from ``train`` to rollout replicas of TP size ``rollout_tp``.

    ``grouping``: None picks ``HYBRID`` where it applies, else ``CONSECUTIVE``; engines with fixed TP groups
    (vLLM) ask for ``CONSECUTIVE``. ``rollout_ranks``: the size of a separate rollout pool (split placement,
    always ``CONSECUTIVE``); None: the rollout engines live in the training ranks."""
    check_rollout_tp(spec, train, rollout_tp, rollout_ranks)
    vp = padded_vocab or spec.padded_vocab_size(train.tp)
    hybrid_fits = rollout_ranks is None and (train.tp * train.pp) % rollout_tp == 0
    if grouping is Grouping.HYBRID and not hybrid_fits:
        raise LayoutError(f"the HYBRID grouping needs colocated rollout engines and rollout tp {rollout_tp} to divide "
                          f"tp*pp = {train.tp * train.pp}")
    grouping = grouping or (Grouping.HYBRID if hybrid_fits else Grouping.CONSECUTIVE)
    tensors = tuple(hf_tensors(spec, train))
    if rollout_ranks is None:
        places: tuple[RolloutPlace | None, ...] = tuple(rollout_places(train, rollout_tp, grouping))
    else:
        places = (None,) * train.world_size + tuple(RolloutPlace(i // rollout_tp, i % rollout_tp)
                                                    for i in range(rollout_ranks))
    slabs: list[Slab] = []
    dest: dict[tuple[str, int], tuple[int, int]] = {}
    for t in tensors:
        sources = [source_range(t, spec, train, tp, vp) for tp in range(train.tp)]
        holders = expert_holders(t, spec, train) if t.expert is not None else []
        for rank, place in enumerate(places):
            if place is None:
                continue
            lo, hi = dest_range(t, spec, rollout_tp, place.tp_rank)
            dest[(t.name, rank)] = (lo, hi)
            if holders:
                slabs.append(Slab(t.name, lo, hi, expert_source(holders, train, rank), rank))
            else:
                slabs.extend(_slabs_for(t, train, rank, place, lo, hi, sources))
    return ReshardPlan(train, rollout_tp, grouping, vp, tensors, places, tuple(slabs), dest)


def check_rollout_tp(spec: ModelSpec, train: ParallelLayout, rollout_tp: int, rollout_ranks: int | None = None) -> None:
    """Raise LayoutError unless vLLM-style TP of size ``rollout_tp`` can split this model on this world (or on
    a rollout pool of ``rollout_ranks``)."""
    if not isinstance(rollout_tp, int) or rollout_tp < 1:
        raise LayoutError(f"rollout tensor-parallel size must be a positive integer, found {rollout_tp!r}.")
    if rollout_ranks is not None and (rollout_ranks < 1 or rollout_ranks % rollout_tp):
        raise LayoutError(f"rollout tp={rollout_tp} must divide the rollout pool's {rollout_ranks} ranks: every rank "
                          "hosts one rollout shard.")
    if rollout_ranks is None and train.world_size % rollout_tp:
        raise LayoutError(
            f"rollout tp={rollout_tp} must divide the training world ({train}, {train.world_size} ranks): "
            "every rank hosts one rollout shard."
        )
    check_expert_rollout(spec, rollout_tp)
    g = spec.num_query_groups
    if spec.num_attention_heads % rollout_tp or (g % rollout_tp and rollout_tp % g):
        raise LayoutError(
            f"rollout tp={rollout_tp} must divide the {spec.num_attention_heads} attention heads, and divide or be "
            f"a multiple of the {g} key/value heads; choose another rollout tp."
        )
    if spec.ffn_hidden_size % rollout_tp:
        raise LayoutError(f"rollout tp={rollout_tp} must divide the FFN size {spec.ffn_hidden_size}.")


def check_expert_rollout(spec: ModelSpec, rollout_tp: int) -> None:
    """Raise LayoutError unless vLLM's fused-MoE layer can cut this model's experts over ``rollout_tp`` ranks: it
    splits every expert's intermediate dimension (``moe_intermediate_size``) evenly and needs at least as many
    experts as TP ranks."""
    if spec.moe is None or rollout_tp == 1:
        return
    width, experts = spec.moe.ffn_hidden_size, spec.moe.num_experts
    if width % rollout_tp or rollout_tp > experts:
        raise LayoutError(
            f"rollout tp={rollout_tp} cannot split the {experts} experts of {spec.architecture}: vLLM cuts each "
            f"expert's intermediate size {width} over its TP ranks (tp must divide it) and needs tp <= the number of "
            f"experts. Rollout tp values that fit: {[g for g in range(1, experts + 1) if width % g == 0]}.")


# ---------------------------------------------------------------------------------------------- tensors


def hf_tensors(spec: ModelSpec, train: ParallelLayout) -> list[HFTensor]:
    """Every HF tensor of the model in the global order, with its split and owning pipeline stage."""
    stage_of = {}
    for pp in range(train.pp):
        for vp in range(train.vpp_size):
            for layer in train.layers_of_stage(spec.num_layers, pp, vp):
                stage_of[layer] = pp
    out = []
    for m in tensor_maps(spec):
        stage = stage_of[m.layer] if m.layer is not None else (0 if m.mcore.startswith("embedding") else train.pp - 1)
        for i, (name, shape) in enumerate(zip(m.hf, hf_shapes(m, spec), strict=True)):
            split = _split_of(m, i)
            dim = _EXPERT_ROLLOUT_DIM[m.kind] if m.expert is not None else m.tp_dim
            out.append(HFTensor(name, shape, dim if split is not Split.NONE else None, split, m.mcore, i, stage,
                                m.expert))
    return out


# the dimension a rollout engine's TP cuts an expert's HF tensors along, as for a dense MLP (vLLM's fused MoE):
# gate_proj/up_proj [I, H] by rows, down_proj [H, I] by columns
_EXPERT_ROLLOUT_DIM = {Kind.GATE_UP: 0, Kind.COPY: 1}


def _split_of(m: TensorMap, index: int) -> Split:
    if m.expert is not None:
        return Split.EVEN
    if m.tp_dim is None:
        return Split.NONE
    if m.kind is Kind.VOCAB:
        return Split.VOCAB
    if m.kind is Kind.QKV and index > 0:
        return Split.KV
    return Split.EVEN


def source_range(
    t: HFTensor, spec: ModelSpec, train: ParallelLayout, tp_rank: int, padded_vocab: int
) -> tuple[int, int]:
    """Range of ``t`` (along its TP dim) held by training TP rank ``tp_rank``; may be empty for vocab. An expert's
    holders (:func:`expert_holders`) hold it whole."""
    if t.split is Split.NONE:
        return (0, 1)
    if t.expert is not None:
        return (0, t.length)
    if t.split is Split.VOCAB:
        per = padded_vocab // train.tp
        return (min(tp_rank * per, t.length), min((tp_rank + 1) * per, t.length))
    per = t.length // train.tp
    return (tp_rank * per, (tp_rank + 1) * per)


def dest_range(t: HFTensor, spec: ModelSpec, rollout_tp: int, tp_rank: int) -> tuple[int, int]:
    """Range of ``t`` that vLLM's tensor-parallel rank ``tp_rank`` of ``rollout_tp`` holds."""
    if t.split is Split.NONE:
        return (0, 1)
    if t.split is Split.VOCAB:
        per = -(-t.length // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING // rollout_tp
        return (min(tp_rank * per, t.length), min((tp_rank + 1) * per, t.length))
    if t.split is Split.KV and rollout_tp > spec.num_query_groups:  # vLLM's num_kv_head_replicas
        head = tp_rank // (rollout_tp // spec.num_query_groups)
        return (head * spec.head_dim, (head + 1) * spec.head_dim)
    per = t.length // rollout_tp
    return (tp_rank * per, (tp_rank + 1) * per)


# ----------------------------------------------------------------------------------------------- places


def rollout_places(train: ParallelLayout, rollout_tp: int, grouping: Grouping) -> list[RolloutPlace]:
    """(rollout replica, rollout TP rank) of every global training rank."""
    places = []
    mp = train.tp * train.pp
    for rank in range(train.world_size):
        c = train.coords(rank)
        copy = c.dp * train.cp + c.cp  # the whole model copy this rank belongs to (module docstring)
        if grouping is Grouping.CONSECUTIVE:
            places.append(RolloutPlace(rank // rollout_tp, rank % rollout_tp))
            continue
        per_group = mp // rollout_tp
        if train.tp % rollout_tp == 0:
            k = train.tp // rollout_tp
            local, tp_rank = c.tp % k + k * c.pp, c.tp // k
        else:
            j = c.pp * train.tp + c.tp
            local, tp_rank = j // rollout_tp, j % rollout_tp
        places.append(RolloutPlace(copy * per_group + local, tp_rank))
    return places


def check_vllm_groups(layout: ParallelLayout, rollout_tp: int) -> None:
    """Raise LayoutError unless vLLM's TP groups (consecutive global ranks) each lie inside one data-parallel
    replica: the ranks of a group must generate from the same prompts."""
    if rollout_tp < 1 or layout.world_size % rollout_tp:
        raise LayoutError(f"rollout tp={rollout_tp} must be a positive divisor of the world size {layout.world_size}")
    for start in range(0, layout.world_size, rollout_tp):
        dps = {layout.coords(r).dp for r in range(start, start + rollout_tp)}
        if len(dps) > 1:
            works = [g for g in range(1, layout.world_size + 1) if layout.world_size % g == 0 and (
                layout.dp == 1 or (layout.tp * layout.cp) % g == 0)]
            raise LayoutError(
                f"rollout tp={rollout_tp} does not fit vLLM on training layout {layout}: vLLM builds TP groups "
                f"from consecutive global ranks, and ranks {start}..{start + rollout_tp - 1} belong to data-parallel "
                f"replicas {sorted(dps)} (megatron-core numbers ranks TP-fastest, then CP, DP, PP). "
                f"Rollout tp values that fit: {works}.")


# ------------------------------------------------------------------------------------------------ slabs


def _slabs_for(
    t: HFTensor, train: ParallelLayout, rank: int, place: RolloutPlace, lo: int, hi: int,
    sources: list[tuple[int, int]],
) -> list[Slab]:
    """The slabs ``rank`` receives (or keeps) of ``t``'s range [lo, hi): from the holders in its own copy (data-parallel
    replica and CP index) when it is a training rank, else from training copy ``replica mod (DP*CP)`` (module
    docstring)."""
    if rank < train.world_size:
        me = train.coords(rank)
        dp, cp, replicated_tp = me.dp, me.cp, me.tp
    else:
        me, copies = None, train.dp * train.cp
        dp, cp = divmod(place.replica % copies, train.cp)
        replicated_tp = (place.replica // copies + place.tp_rank) % train.tp
    if t.split is Split.NONE:
        src = rank if me is not None and me.pp == t.stage else train.rank_of(replicated_tp, t.stage, dp, cp)
        return [Slab(t.name, 0, 1, src, rank)]
    slabs = []
    for tp, (a, b) in enumerate(sources):
        start, stop = max(a, lo), min(b, hi)
        if start >= stop:
            continue
        src = rank if me is not None and (me.tp, me.pp) == (tp, t.stage) else train.rank_of(tp, t.stage, dp, cp)
        slabs.append(Slab(t.name, start, stop, src, rank))
    return slabs


def expert_holders(t: HFTensor, spec: ModelSpec, train: ParallelLayout) -> list[int]:
    """The global ranks holding expert tensor ``t`` in training, by expert-data-parallel index ``edp``: the ranks
    of its stage whose expert-parallel rank owns its expert (:meth:`ParallelLayout.experts_of`)."""
    ep_rank = next(r for r in range(train.ep) if t.expert in train.experts_of(spec.moe.num_experts, r))
    first = t.stage * train.tp * train.cp * train.dp  # the stage's ranks are consecutive (pp outermost)
    holders = [first + edp * train.ep + ep_rank for edp in range(train.expert_dp)]
    assert all(train.expert_coords(r) == (ep_rank, edp) for edp, r in enumerate(holders)), holders
    return holders


def expert_source(holders: list[int], train: ParallelLayout, rank: int) -> int:
    """The rank that sends an expert tensor (whole, held by ``holders``: :func:`expert_holders`) to ``rank``
    (module docstring): the holder with the receiver's own expert-data-parallel index (colocated), or with index
    ``i mod edp`` for rollout rank ``i`` of a split pool."""
    if rank < train.world_size:
        return holders[train.expert_coords(rank).edp]
    return holders[(rank - train.world_size) % len(holders)]


@dataclasses.dataclass
class RankSlabs:
    """One rank's part of a plan, in plan order."""

    send: list[Slab] = dataclasses.field(default_factory=list)
    recv: list[Slab] = dataclasses.field(default_factory=list)
    keep: list[Slab] = dataclasses.field(default_factory=list)


def slabs_of_rank(slabs: Iterable[Slab], rank: int) -> RankSlabs:
    """What ``rank`` sends, receives and keeps among ``slabs`` (order preserved)."""
    out = RankSlabs()
    for s in slabs:
        if s.src == s.dst == rank:
            out.keep.append(s)
        elif s.src == rank:
            out.send.append(s)
        elif s.dst == rank:
            out.recv.append(s)
    return out
