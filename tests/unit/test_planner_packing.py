"""Planner: packed micro-batches, context parallelism and the padding fraction (issue #46), against hand arithmetic.

Every expected number is written out below: micro-batches formed by the engine's rules on small length lists, the
quantiles of a response distribution, Llama-3-70B's activation bytes per CP rank from the per-token count of
``test_planner.py`` (49408 values per token and layer at TP8), the distributed optimizer's shards over DP x CP,
and the one layout of a 32k-token workload that fits (TP4 x CP2), with its activations by hand.
"""

from __future__ import annotations

import math

import pytest

from megarl.config.train import load_config
from megarl.engine.config import Precision
from megarl.errors import ConfigError, LayoutError
from megarl.parallel.layout import ParallelLayout
from megarl.planner import (
    GB,
    Alignment,
    Cluster,
    Recompute,
    ResponseLengths,
    Role,
    Workload,
    context_parallel_sizes,
    expected_padding,
    memory,
    pass_tokens,
    plan_layout,
    preset_spec,
    propose,
    training_state_bytes,
)
from megarl.planner.packing import packed_tokens, padded_tokens

LONG = Workload(roles=(Role.POLICY, Role.REFERENCE), micro_batch_tokens=8192, prompt_tokens=1024,
                response_tokens=31744, concurrent_seqs=16)  # one 32768-token sequence per micro-batch
NODE = Cluster(nodes=1, gpus_per_node=8, gpu_mem_gb=80)


@pytest.fixture(scope="module")
def llama70b():
    return preset_spec("llama3-70b")


@pytest.fixture(scope="module")
def llama8b():
    return preset_spec("llama3-8b")


# ------------------------------------------------------------------------------------------------ padding


def test_alignment_follows_the_engine():
    assert Alignment.of(tp=4) == Alignment(1, 1)  # no sequence parallelism: nothing to align
    assert Alignment.of(tp=4, sequence_parallel=True) == Alignment(1, 4)  # the input split over 4 TP ranks
    assert Alignment.of(cp=2) == Alignment(4, 1)  # every sequence in 2 cp = 4 chunks
    assert Alignment.of(tp=2, cp=2, sequence_parallel=True) == Alignment(8, 1)  # each chunk split over TP too


def test_micro_batch_tokens_by_hand():
    assert padded_tokens([5, 3, 8]) == 3 * 8
    assert padded_tokens([5, 3, 6], multiple=4) == 3 * 8
    assert packed_tokens([5, 3, 8]) == 16
    assert packed_tokens([5, 3, 6], Alignment(1, 4)) == 16  # 14 tokens, the stream padded to 16
    assert packed_tokens([5, 3, 8], Alignment(4, 1)) == 8 + 4 + 8  # every extent a multiple of 4
    assert packed_tokens([1], Alignment(8, 1)) == 8  # at least one align per sequence


def test_pass_tokens_by_hand():
    # padded, longest first while rows x longest <= 24: [10, 4] (20 tokens), then 3 x 10 > 24: [3, 2] (2 x 3)
    t = pass_tokens([10, 4, 3, 2], max_tokens=24, max_size=64)
    assert (t.real, t.padded, t.padded_micro_batches) == (19, 20 + 6, 2)
    assert t.fraction(packed=False) == pytest.approx(7 / 26)
    # packed, first fit while the real tokens stay <= 24: all four in one micro-batch of 19 tokens
    assert (t.packed, t.packed_micro_batches, t.largest_packed) == (19, 1, 19)
    assert t.fraction(packed=True) == 0.0
    # at cp 2 every sequence is padded to a multiple of 4: 12 + 4 + 4 + 4
    cp2 = pass_tokens([10, 4, 3, 2], 24, 64, Alignment.of(cp=2))
    assert cp2.packed == 24 and cp2.fraction(packed=True) == pytest.approx(5 / 24)
    # the row cap binds both: at most 2 rows per micro-batch
    capped = pass_tokens([10, 4, 3, 2], 24, 2)
    assert capped.padded == 20 + 6 and capped.packed_micro_batches == 2
    two = capped + cp2
    assert (two.real, two.packed, two.largest_packed) == (38, 19 + 24, 24)
    with pytest.raises(ValueError, match=">= 1 token"):
        pass_tokens([3, 0], 24, 64)


def test_response_lengths_by_hand():
    r = ResponseLengths(8, 512, at_max=0.25)
    assert r.mean == 0.25 * 512 + 0.75 * 260
    # quantiles 1/8, 3/8, 5/8, 7/8; below 3/4 uniform on 8..512 (505 values) at u / (3/4): 1/6, 1/2, 5/6
    assert r.quantiles(4) == [8 + math.floor(505 / 6), 8 + 252, 8 + math.floor(505 * 5 / 6), 512] == [92, 260, 428, 512]
    assert ResponseLengths.from_mean(512, 323, low=8) == r  # (323 - 260) / (512 - 260) = 1/4 at the limit
    assert ResponseLengths.from_mean(1024, 300) == ResponseLengths(1, 599)  # below the midpoint: all stop early
    assert ResponseLengths.from_mean(1024, 300).mean == 300
    assert ResponseLengths(5, 5).quantiles(3) == [5, 5, 5]
    with pytest.raises(ConfigError, match="outside 1 .. 512"):
        ResponseLengths.from_mean(512, 600)
    with pytest.raises(ConfigError, match="1 <= low <= high"):
        ResponseLengths(10, 5)


def test_expected_padding_by_hand():
    """Prompt 40 + the quantile responses 92, 260, 428, 512: one padded micro-batch of 4 x 552 tokens."""
    t = expected_padding(ResponseLengths(8, 512, 0.25), prompt_tokens=40, sequences=4, max_tokens=8192, max_size=64)
    assert t.real == 132 + 300 + 468 + 552 == 1452
    assert t.padded == 4 * 552 and t.fraction(packed=False) == pytest.approx(1 - 1452 / 2208)  # 34.2 %
    assert t.packed == 1452 and t.fraction(packed=True) == 0.0
    # many sequences: the padded plan sorts them, so each micro-batch spans a narrow band of lengths
    many = expected_padding(ResponseLengths(8, 512, 0.25), prompt_tokens=40, sequences=256, max_tokens=8192,
                            max_size=64)
    assert many.fraction(packed=False) < 0.1 < expected_padding(
        ResponseLengths(8, 512, 0.25), prompt_tokens=40, sequences=16, max_tokens=8192, max_size=64).fraction(False)


# ----------------------------------------------------------------------------------- activations, packed and CP


def test_micro_batch_fill():
    assert memory.micro_batch_fill(2048, 1024, packed=True) == memory.micro_batch_fill(2048, 1024, False) == 2048
    assert memory.micro_batch_fill(3000, 1536, packed=False) == 1536  # one padded row fits
    assert memory.micro_batch_fill(3000, 1536, packed=True) == 3000  # packing fills the budget
    assert memory.micro_batch_fill(2048, 4096, packed=True) == 4096  # a longer sequence travels alone


def test_activations_per_cp_rank_by_hand(llama70b):
    """TP8 x CP2 x PP4: a rank keeps 1024 of each 2048-token micro-batch, plus one layer's whole K and V."""
    lay = ParallelLayout(tp=8, pp=4, dp=1, cp=2)
    per_token = 4 * 8192 + (2 * 64 * 128 + 2 * 8 * 128 + 4 * 28672) / 8  # 49408 values (test_planner.py)
    gather = 2048 * 2 * 8 * 128 // 8 * 2  # K and V of 2048 tokens, one KV head per TP rank, bf16
    got = memory.activation_bytes(llama70b, lay, 0, micro_batch_tokens=2048, seq_len=1024,
                                  recompute=Recompute.SELECTIVE, packed=True)
    assert got == 80 * int(1024 * per_token * 2) + gather
    none = memory.activation_bytes(llama70b, lay, 0, micro_batch_tokens=2048, seq_len=1024, recompute=Recompute.NONE,
                                   packed=True)
    assert none == 80 * int(1024 * (per_token + 64 * 1024 / 8) * 2) + gather  # scores over the whole sequence
    last = memory.activation_bytes(llama70b, lay, 3, micro_batch_tokens=2048, seq_len=1024,
                                   recompute=Recompute.SELECTIVE, packed=True)
    assert last == 20 * int(1024 * per_token * 2) + gather + 8 * 1024 * 16128  # this rank's logits only
    one = memory.activation_bytes(llama70b, ParallelLayout(tp=8, pp=4, dp=2), 0, micro_batch_tokens=2048,
                                  seq_len=1024, recompute=Recompute.SELECTIVE, packed=True)
    assert got - gather == one / 2


def test_optimizer_shards_over_dp_and_cp(llama70b):
    """megatron-core's distributed optimizer shards over DP x CP: T8 x P4 x CP2 holds what T8 x P4 x DP2 holds,
    13.63 GB of optimizer state on stage 0 (docs/planner.md §4)."""
    with_cp = training_state_bytes(llama70b, ParallelLayout(tp=8, pp=4, cp=2), Precision.BF16, True)
    with_dp = training_state_bytes(llama70b, ParallelLayout(tp=8, pp=4, dp=2), Precision.BF16, True)
    assert with_cp == with_dp
    assert with_cp[0].optimizer / GB == pytest.approx(13.63, abs=0.01)
    assert memory.optimizer_shards(ParallelLayout(tp=2, dp=3, cp=2)) == 6


# -------------------------------------------------------------------------------------------------- layouts


def test_context_parallel_sizes_only_for_long_sequences():
    assert context_parallel_sizes(Workload(), NODE) == (1,)  # 1024-token sequences, a 2048-token budget
    assert context_parallel_sizes(LONG, NODE) == (1, 2, 4)  # ceil(32768 / 8192) = 4
    assert context_parallel_sizes(Workload(micro_batch_tokens=512, response_tokens=1536, prompt_tokens=512),
                                  NODE) == (1, 2, 4)
    assert context_parallel_sizes(Workload(micro_batch_tokens=8192, prompt_tokens=1024, response_tokens=31744,
                                           packing=False), NODE) == (1,)  # cp needs packing


def test_a_32k_sequence_fits_only_with_cp(llama8b):
    """Llama-3-8B, one node of 8 x 80 GB, one 32768-token sequence: TP8 alone needs 81.8 GB to train; TP4 x CP2 fits,
    each rank keeping 16384 tokens of every layer."""
    plans = propose(llama8b, NODE, LONG)
    assert [(p.layout, p.rollout_tp) for p in plans] == [(ParallelLayout(tp=4, cp=2), 4)]
    p = plans[0]
    per_token = 4 * 4096 + (2 * 32 * 128 + 2 * 8 * 128 + 4 * 14336) / 4  # 33280 values
    logits = 8 * 16384 * 128512 // 4  # fp32 logits and softmax of this rank (vocabulary padded to 128 x 4)
    act = 32 * int(16384 * per_token * 2) + 32768 * 2 * 2 * 128 * 2 + logits
    assert p.peaks[0].terms[("policy", "activations")] == act
    tp8 = plan_layout(llama8b, NODE, LONG, ParallelLayout(tp=8), 8)
    assert not tp8.fits and tp8.reasons[0].startswith("train phase needs 81.8 GB")
    cfg = load_config(None, p.overrides())
    assert cfg.cluster.layout() == ParallelLayout(tp=4, cp=2) and cfg.policy.micro_batch.max_tokens == 8192


def test_cp_needs_packing_and_packing_reaches_the_config(llama8b):
    padded = Workload(roles=(Role.POLICY,), packing=False, micro_batch_rows=16)
    with pytest.raises(LayoutError, match="packed sequences"):
        plan_layout(llama8b, NODE, padded, ParallelLayout(tp=4, cp=2), 4)
    over = plan_layout(llama8b, NODE, padded, ParallelLayout(tp=8), 8).overrides()
    assert {"policy.packing=false", "policy.micro_batch.max_size=16"} <= set(over)
    cfg = load_config(None, over)
    assert cfg.policy.packing is False and cfg.policy.micro_batch.max_size == 16
    assert not any("packing" in o or "max_size" in o
                   for o in plan_layout(llama8b, NODE, Workload(roles=(Role.POLICY,)), ParallelLayout(tp=8),
                                        8).overrides())


def test_cli_cp_and_padding(plan_cli):
    base = ["--preset", "llama3-8b", "--nodes", "1", "--gpus-per-node", "8", "--gpu-mem-gb", "80", "--roles",
            "policy,reference", "--prompt-tokens", "40", "--response-tokens", "512", "--micro-batch-tokens", "8192"]
    code, out, _ = plan_cli(*base, "--tp", "4", "--cp", "2", "--response-min", "8", "--response-mean", "323",
                            "--rows-per-rank", "4")
    assert code == 0
    assert "layout: TP4xCP2xPP1xDP1" in out and "1/2 on each CP rank" in out
    assert ("padding per rank: 4 sequences of prompt 40 + responses uniform 8..512, 25% at the limit (mean 323), "
            "1452 real tokens") in out
    assert "impossible at cp > 1" in out and "packed 0.0% of 1452 in 1" in out  # every length a multiple of 4
    code, out, _ = plan_cli(*base, "--tp", "4", "--response-min", "8", "--response-mean", "323", "--rows-per-rank",
                            "4")
    assert code == 0 and "padded 34.2% of 2208 tokens computed in 1 micro-batches; packed 0.0% of 1452 in 1" in out
    code, _, err = plan_cli(*base, "--tp", "4", "--cp", "2", "--no-packing")
    assert code == 2 and "packed sequences" in err
