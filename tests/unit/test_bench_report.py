"""The benchmark report's arithmetic on hand-worked steps, and the trace recorder's event format."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megarl.bench import report
from megarl.metrics import trace

STEP = {  # seconds; "values" and "update_critic" did not run. Driver stages: weight_sync (the worker's
    # to_rollout inside it), rollout (generate and to_train inside it), old_log_probs, reward, ...
    "timing/weight_sync_s": 0.6, "timing/to_rollout_s": 0.5, "timing/rollout_s": 1.5, "timing/generate_s": 1.0,
    "timing/to_train_s": 0.25, "timing/old_log_probs_s": 2.0, "timing/reward_s": 0.1, "timing/reference_s": 1.0,
    "timing/advantages_s": 0.05, "timing/update_policy_s": 3.0, "timing/bookkeeping_s": 0.02, "timing/step_s": 8.5,
    "batch/tokens": 40.0, "batch/num_sequences": 4.0, "rollout/num_tokens": 16.0, "memory/host_peak_gb": 1.5,
}
SETUP = report.Setup(config="c.yaml", overrides=(), workload=None, devices=2, device_kind="cpu",
                     train_layout="TP2 x PP1 x DP1", rollout_layout="embedded, TP1 x 2 replicas", parameters=100,
                     num_layers=2, attention_width=8, ppo_epochs=1, has_critic=False, warmup=1, iterations=2,
                     peak_flops=1e4, peak_flops_source="given")


def test_breakdown_and_coverage_by_hand():
    cols = report.breakdown(STEP)
    assert cols == pytest.approx({"generation": 1.0, "weight_sync": 0.6 + 0.25, "log_probs": 2.0, "reference": 1.0,
                                  "values": 0.0, "reward": 0.1, "training": 3.0,
                                  "other": 0.05 + 0.02 + (1.5 - 1.0 - 0.25)})
    assert sum(cols.values()) == pytest.approx(0.6 + 1.5 + 2.0 + 0.1 + 1.0 + 0.05 + 3.0 + 0.02)
    assert report.coverage(STEP) == pytest.approx(8.27 / 8.5)


def test_step_flops_by_hand():
    # per token 2*100 + 2 * 2 layers * 8 * (40 / 4 mean length) = 520; 16 generated tokens, then
    # old log-probs + reference (2 forwards) + one policy epoch (3) over 40 tokens
    assert report.step_flops(STEP, SETUP) == pytest.approx(520 * (16 + 5 * 40))
    critic = STEP | {"timing/values_s": 0.1}
    two_epochs = report.Setup(**{**SETUP.__dict__, "ppo_epochs": 2, "has_critic": True})
    assert report.step_flops(critic, two_epochs) == pytest.approx(520 * (16 + (3 + 12) * 40))


def test_summarize_means_throughput_mfu_and_markdown():
    slow = STEP | {"timing/step_s": 9.5, "timing/update_policy_s": 4.0, "memory/host_peak_gb": 2.5}
    ranks = [{"rank": 0, "coords": {"tp": 0, "pp": 0, "dp": 0}, "params": 2**20, "grads": 2**20, "optimizer": 0,
              "reshard_bytes_sent": 300, "reshard_bytes_received": 500, "host_rss": 0}]
    out = report.summarize([STEP, slow], SETUP, ranks)
    assert out["step_s"] == pytest.approx(9.0) and out["stages_s"]["training"] == pytest.approx(3.5)
    assert out["tokens_per_s_per_device"] == pytest.approx(40 / 9.0 / 2)
    assert out["peak_host_gb_per_device"] == 2.5 and out["reshard_bytes_received_max"] == 500
    assert out["mfu"] == pytest.approx(520 * 216 / 9.0 / 2 / 1e4)
    json.dumps(out)  # the JSON file's content
    md = report.markdown(out)
    assert "| 2 x cpu | TP2 x PP1 x DP1 |" in md and "| 0 | tp0 pp0 dp0 | 1 | 1 |" in md
    with pytest.raises(ValueError, match="no measured steps"):
        report.summarize([], SETUP, ranks)


def test_trace_records_only_while_enabled_and_lays_out_tracks():
    trace.enable(False)
    with trace.span("ignored"):
        pass
    trace.enable(True)
    try:
        with trace.span("outer", cat="stage", n=3), trace.span("inner"):
            pass
        events = trace.drain()
    finally:
        trace.enable(False)
    assert [e["name"] for e in events] == ["inner", "outer"] and trace.drain() == []
    inner, outer = events
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
    assert outer["args"] == {"n": 3} and outer["cat"] == "stage"
    doc = trace.chrome_trace({"driver": events, "rank 0": events[:1]})
    names = [e for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    assert [(e["pid"], e["args"]["name"]) for e in names] == [(0, "driver"), (1, "rank 0")]
    assert sum(e["ph"] == "X" for e in doc["traceEvents"]) == 3


def test_cpu_description_names_the_model_and_widest_simd():
    amd = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx avx2 fma\n\n" * 2
    xeon = "model name\t: Intel(R) Xeon(R) Processor\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
    assert report.cpu_description(amd) == "AMD EPYC 7B13 (AVX2)"
    assert report.cpu_description(xeon) == "Intel(R) Xeon(R) Processor (AVX-512, AVX-512 BF16, AMX)"
    assert report.cpu_description("flags\t: fpu\n") == "unknown CPU"


def test_padding_columns_mean_the_steps_and_skip_a_pass_that_did_not_run():
    ranks = []
    a = STEP | {"bench/padding_log_probs": 0.4, "bench/padding_update": 0.3}
    b = STEP | {"bench/padding_log_probs": 0.2, "bench/padding_update": 0.1}
    out = report.summarize([a, b], SETUP, ranks)
    assert out["padding"] == pytest.approx({"log_probs": 0.3, "update": 0.2})
    assert f"| {40 / 8.5 / 2:.1f} | 30.0% / 20.0% | 8.500 |" in report.markdown(out)  # beside tokens/s
    no_log_probs = {k: v for k, v in a.items() if k != "timing/old_log_probs_s"}
    out = report.summarize([no_log_probs], SETUP, ranks)
    assert out["padding"] == {"log_probs": None, "update": 0.3}
    assert "| - / 30.0% |" in report.markdown(out)
    assert report.summarize([STEP], SETUP, ranks)["padding"] == {"log_probs": None, "update": None}


def test_step_padding_by_hand():
    """Six rows over DP2: shards [10, 4, 3] and [2, 6, 6]; budget 24 tokens. Padded: [10, 4] (2 x 10) + [3] and
    [6, 6, 2] (3 x 6): 41 tokens computed for 31 real; packed: one micro-batch per rank, no padding."""
    from megarl.algos.config import AlgorithmConfig
    from megarl.bench import padding
    from megarl.engine.config import EngineConfig, MicroBatchConfig
    from megarl.parallel.layout import ParallelLayout

    lengths = [10, 4, 3, 2, 6, 6]
    padded = EngineConfig(micro_batch=MicroBatchConfig(max_tokens=24), packing=False)
    got = padding.step_padding(lengths, padded, AlgorithmConfig(), ParallelLayout(dp=2))
    assert got == padding.StepPadding(log_probs=pytest.approx(10 / 41), update=pytest.approx(10 / 41))
    assert got.metrics() == {"bench/padding_log_probs": got.log_probs, "bench/padding_update": got.update}
    packed = EngineConfig(micro_batch=MicroBatchConfig(max_tokens=24))
    assert padding.step_padding(lengths, packed, AlgorithmConfig(), ParallelLayout(dp=2)) == padding.StepPadding(0, 0)
    # three mini-batches of 2 rows, 1 row per DP rank each: nothing to pad in the updates
    three = padding.step_padding(lengths, padded, AlgorithmConfig(mini_batches=3), ParallelLayout(dp=2))
    assert three.update == 0.0 and three.log_probs == pytest.approx(10 / 41)
    # TP2 with sequence parallelism: padded widths even ([3] -> 4, 24 tokens on rank 0), packed streams even (17 -> 18)
    sp = padding.step_padding(lengths, dataclasses.replace(padded, sequence_parallel=True), AlgorithmConfig(),
                              ParallelLayout(tp=2, dp=2))
    assert sp.update == pytest.approx(1 - 31 / (24 + 18))
    sp_packed = padding.step_padding(lengths, dataclasses.replace(packed, sequence_parallel=True), AlgorithmConfig(),
                                     ParallelLayout(tp=2, dp=2))
    assert sp_packed.update == pytest.approx(1 - 31 / (18 + 14))
    # the log-prob forward's shards are filled with the first rows; the updates' chunks must divide
    assert padding.shards([5, 7, 9], 2) == [[5, 7], [9, 5]]
    with pytest.raises(ValueError, match="3 rows into 2"):
        padding.chunks([5, 7, 9], 2)
