"""The pure parts of the vLLM rollout engine, on CPU without an engine: output conversion (with vLLM's own
output classes), vLLM's TP groups against a training layout, layer-complete buffering, and the errors a
user gets before any engine starts. Expectations are worked out by hand.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megarl.errors import ConfigError, LayoutError, MissingDependencyError, UnsupportedModelError
from megarl.models.spec import spec_from_hf_config
from megarl.parallel.layout import ParallelLayout
from megarl.resharding.plan import Grouping, check_vllm_groups, make_plan
from megarl.rollout.base import FINISH_LENGTH, FINISH_STOP, WeightUpdateError
from megarl.rollout.vllm_engine import LayerGroups, VLLMEngine, _import_vllm, layer_key
from megarl.rollout.vllm_outputs import to_rollout_output
from megarl.testing.tiny import tiny_config

outputs = pytest.importorskip("vllm.outputs", reason="vLLM is not installed (make install brings its CPU build)")
Logprob = pytest.importorskip("vllm.logprobs").Logprob

PAD = 0


def RequestOutput(request_id, prompt, prompt_token_ids, prompt_logprobs, completions):  # noqa: N802
    return outputs.RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
                                 prompt_logprobs=prompt_logprobs, outputs=completions, finished=True)


def _completion(index, tokens, lps, reason, extra=None, stop_reason=None):
    """``extra``: per position, another (token, logprob) vLLM lists beside the sampled one (logprobs >= 1)."""
    positions = []
    for j, (t, lp) in enumerate(zip(tokens, lps, strict=True)):
        entry = {t: Logprob(lp, rank=2)}
        if extra is not None:
            entry[extra[j][0]] = Logprob(extra[j][1], rank=1)
        positions.append(entry)
    return outputs.CompletionOutput(index=index, text="", token_ids=tokens, cumulative_logprob=sum(lps),
                                    logprobs=positions, finish_reason=reason, stop_reason=stop_reason)


# ------------------------------------------------------------------------------------ to_rollout_output


def test_rows_grouped_by_prompt_padded_with_stop_token_kept():
    # prompt 0: two samples; prompt 1: two samples returned out of index order
    outs = [
        RequestOutput("0", None, [5, 6], None, [
            _completion(0, [11, 12, 2], [-0.5, -1.0, -0.25], "stop", extra=[(9, -0.1)] * 3, stop_reason=2),
            _completion(1, (13,), [-2.0], "length"),
        ]),
        RequestOutput("1", None, [7], None, [
            _completion(1, [21, 22], [-0.75, -1.5], "length"),
            _completion(0, [2], [-3.0], "stop", stop_reason=2),
        ]),
    ]
    out = to_rollout_output(outs, n=2, pad_token_id=PAD)
    assert out.prompt_index.tolist() == [0, 0, 1, 1]
    assert out.responses.tolist() == [[11, 12, 2], [13, PAD, PAD], [2, PAD, PAD], [21, 22, PAD]]
    assert out.response_lengths.tolist() == [3, 1, 1, 2]
    assert out.response_mask.tolist() == [[True, True, True], [True, False, False], [True, False, False],
                                          [True, True, False]]
    assert out.log_probs.tolist() == [[-0.5, -1.0, -0.25], [-2.0, 0.0, 0.0], [-3.0, 0.0, 0.0], [-0.75, -1.5, 0.0]]
    assert out.log_probs.dtype == torch.float32
    assert out.finish_reasons == [FINISH_STOP, FINISH_LENGTH, FINISH_STOP, FINISH_LENGTH]
    assert out.token_lists() == [[11, 12, 2], [13], [2], [21, 22]]


def test_single_completion_stands_for_n_identical_rows():
    # greedy: vLLM refuses n > 1, so it samples once and the rows are repeated
    outs = [RequestOutput("0", None, [1], None, [_completion(0, [4, 5], [-0.25, -0.5], "length")])]
    out = to_rollout_output(outs, n=3, pad_token_id=PAD)
    assert out.prompt_index.tolist() == [0, 0, 0]
    assert out.responses.tolist() == [[4, 5]] * 3
    assert out.log_probs.tolist() == [[-0.25, -0.5]] * 3
    assert out.finish_reasons == [FINISH_LENGTH] * 3


def test_no_prompts_gives_an_empty_output():
    out = to_rollout_output([], n=4, pad_token_id=PAD)
    assert len(out) == 0
    assert tuple(out.responses.shape) == (0, 0)
    assert tuple(out.log_probs.shape) == (0, 0)


@pytest.mark.parametrize("completions, match", [
    ([_completion(0, [1], [-1.0], "length"), _completion(1, [1], [-1.0], "length")], "2 completions"),
    ([_completion(0, [1], [-1.0], "abort")], "'abort'"),
    ([dataclasses.replace(_completion(0, [1, 2], [-1.0, -1.0], "length"), logprobs=None)], "none of log-probs"),
    ([dataclasses.replace(_completion(0, [1, 2], [-1.0, -1.0], "length"), logprobs=[{1: Logprob(-1.0)}])],
     "1 positions"),
    ([dataclasses.replace(_completion(0, [1], [-1.0], "length"), logprobs=[{7: Logprob(-1.0)}])],
     "lack the sampled token 1"),
])
def test_malformed_outputs_raise(completions, match):
    with pytest.raises(RuntimeError, match=match):
        to_rollout_output([RequestOutput("0", None, [1], None, completions)], n=3, pad_token_id=PAD)


def _routed(completion, experts):
    return dataclasses.replace(completion, routed_experts=None if experts is None else __import__("numpy").array(
        experts, dtype="int32"))


def test_routed_experts_become_token_aligned_rows():
    """vLLM's routed_experts (every fed token: prompt, then response but its last token; [tokens, layers, k]) ->
    [rows, W, layers, k] aligned with the training row; positions a row never fed hold experts 0..k-1."""
    a = [[[3, 1], [0, 2]], [[2, 3], [1, 0]], [[1, 2], [3, 3]], [[0, 3], [2, 1]]]  # prompt [5, 6] + 3 tokens: 4 fed
    b = [[[2, 1], [1, 3]], [[3, 0], [0, 2]]]  # prompt [5, 6] + 1 token: 2 fed
    c = [[[1, 0], [2, 3]], [[0, 1], [3, 2]]]  # prompt [7] + 2 tokens: 2 fed
    outs = [RequestOutput("0", None, [5, 6], None, [_routed(_completion(0, [11, 12, 2], [-0.5] * 3, "stop"), a),
                                                    _routed(_completion(1, [13], [-2.0], "length"), b)]),
            RequestOutput("1", None, [7], None, [_routed(_completion(0, [21, 22], [-0.75] * 2, "length"), c),
                                                 _routed(_completion(1, [23, 24], [-0.75] * 2, "length"), c)])]
    out = to_rollout_output(outs, n=2, pad_token_id=PAD, routing=(2, 2))
    unfed = [[0, 1], [0, 1]]
    assert out.routed_experts.dtype == torch.int16
    assert out.routed_experts.tolist() == [a + [unfed], b + [unfed] * 3, c + [unfed] * 3, c + [unfed] * 3]
    assert to_rollout_output(outs, n=2, pad_token_id=PAD).routed_experts is None  # not asked for: not read
    with pytest.raises(RuntimeError, match="no routed_experts for a response of prompt 0"):
        to_rollout_output([RequestOutput("0", None, [5, 6], None, [_completion(0, [11], [-0.5], "stop")])], n=1,
                          pad_token_id=PAD, routing=(2, 2))
    with pytest.raises(RuntimeError, match=r"3-token row of prompt 0 has shape \(4, 2, 2\); expected \[2, 2, 2\]"):
        to_rollout_output([RequestOutput("0", None, [5, 6], None, [_routed(_completion(0, [11], [-0.5], "stop"), a)])],
                          n=1, pad_token_id=PAD, routing=(2, 2))


# ------------------------------------------------------------------------------------ vLLM's TP groups


@pytest.mark.parametrize("tp, pp, dp, rollout_tp", [
    (2, 1, 2, 2),  # rollout group = training TP group: [0, 1], [2, 3]
    (2, 2, 2, 2),  # PP and DP peers are 2 and 4 ranks away; TP groups stay consecutive
    (4, 1, 1, 2),  # inside a training TP group: [0, 1], [2, 3] (checkpoint-format tensors need no striding)
    (4, 1, 1, 4),
    (2, 2, 2, 1),
    (1, 2, 1, 2),  # TP1 x PP2, rollout tp 2: ranks 0 (stage 0) and 1 (stage 1)
    (2, 2, 1, 4),  # DP1: the whole world is one replica
])
def test_consecutive_groups_inside_a_data_parallel_replica_pass(tp, pp, dp, rollout_tp):
    check_vllm_groups(ParallelLayout(tp=tp, pp=pp, dp=dp), rollout_tp)


def test_group_across_data_parallel_replicas_is_refused():
    # TP2 x PP2 x DP2 (rank = tp + 2 * (dp + 2 * pp)), rollout tp 4: vLLM's group {0, 1, 2, 3} holds DP
    # replicas 0 and 1, which sample different prompts. Fitting values: 1 and 2 (divisors of the training tp).
    with pytest.raises(LayoutError) as err:
        check_vllm_groups(ParallelLayout(tp=2, pp=2, dp=2), 4)
    msg = str(err.value)
    assert "ranks 0..3 belong to data-parallel replicas [0, 1]" in msg and "fit: [1, 2]" in msg
    with pytest.raises(LayoutError, match="positive divisor of the world size 8"):
        check_vllm_groups(ParallelLayout(tp=2, pp=2, dp=2), 3)


def test_vllm_plan_groups_are_consecutive_ranks():
    spec = spec_from_hf_config(tiny_config("llama").to_dict())
    plan = make_plan(spec, ParallelLayout(tp=4, pp=1), 2, grouping=Grouping.CONSECUTIVE)
    assert [(p.replica, p.tp_rank) for p in plan.places] == [(0, 0), (0, 1), (1, 0), (1, 1)]  # HYBRID: strided


# ------------------------------------------------------------------------------- weight-sync building blocks


def test_layer_key_is_the_decoder_layer_or_the_module():
    assert layer_key("model.layers.3.self_attn.q_proj.bias") == "model.layers.3"
    assert layer_key("model.layers.3.mlp.experts.7.up_proj.weight") == "model.layers.3"  # experts stay whole
    assert layer_key("model.embed_tokens.weight") == "model.embed_tokens"
    assert layer_key("lm_head.weight") == "lm_head"


def _shapes():
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.up_proj.weight",
             "model.layers.1.input_layernorm.weight", "model.norm.weight"]
    return {n: (i + 1,) for i, n in enumerate(names)}


def test_layer_groups_release_whole_layers_only():
    shapes = _shapes()
    groups = LayerGroups(shapes)
    t = {n: torch.zeros(s) for n, s in shapes.items()}
    first = groups.add([(n, t[n]) for n in ["model.layers.0.self_attn.q_proj.bias", "model.norm.weight",
                                            "model.layers.0.mlp.up_proj.weight"]])
    assert [n for n, _ in first] == ["model.norm.weight"]
    assert groups.waiting == ["model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.bias"]
    second = groups.add([("model.layers.0.self_attn.q_proj.weight", t["model.layers.0.self_attn.q_proj.weight"])])
    assert sorted(n for n, _ in second) == ["model.layers.0.mlp.up_proj.weight",
                                            "model.layers.0.self_attn.q_proj.bias",
                                            "model.layers.0.self_attn.q_proj.weight"]
    assert all(tensor is t[n] for n, tensor in second)
    assert groups.waiting == [] and groups.missing() == ["model.embed_tokens.weight",
                                                         "model.layers.1.input_layernorm.weight"]


def test_layer_groups_check_names_shapes_and_repeats():
    shapes = _shapes()
    groups = LayerGroups(shapes)
    with pytest.raises(WeightUpdateError, match="nearest: 'model.layers.0.mlp.up_proj.weight'"):
        groups.add([("model.layers.0.mlp.up_proj.weights", torch.zeros(4))])
    with pytest.raises(WeightUpdateError, match=r"full HF shape \(6,\); found \(5,\)"):
        groups.add([("model.norm.weight", torch.zeros(5))])
    groups.add([("model.norm.weight", torch.zeros(6))])
    with pytest.raises(WeightUpdateError, match="arrived twice"):
        groups.add([("model.norm.weight", torch.zeros(6))])


# ------------------------------------------------------------------------------------ errors on this machine


def test_missing_vllm_says_how_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # what an environment without vLLM sees on import
    with pytest.raises(MissingDependencyError, match=r"pip install megarl\[vllm\]"):
        _import_vllm()


@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM's CPU attention applies without CUDA only")
def test_engine_refuses_what_vllm_cannot_run_before_starting(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        VLLMEngine(tmp_path)
    (tmp_path / "config.json").write_text(tiny_config("llama").to_json_string())  # head_dim 16
    with pytest.raises(UnsupportedModelError, match=r"head_dim \[32, .*this model has 16.*backend=embedded"):
        VLLMEngine(tmp_path)
    moe = tiny_config("qwen3_moe", hidden_size=128).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(moe))
    with pytest.raises(ConfigError, match=r"router replay with the vLLM backend.*Model Runner V2.*backend=embedded"):
        VLLMEngine(tmp_path, record_routing=True)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config("qwen2", hidden_size=128).to_dict()))
    with pytest.raises(ConfigError, match="recording expert routing needs a Mixture-of-Experts model"):
        VLLMEngine(tmp_path, record_routing=True)
    cfg = tiny_config("llama").to_dict() | {"quantization_config": {"quant_method": "fp8"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="quantized"):
        VLLMEngine(tmp_path)


def test_adapter_directories_are_removed_even_after_a_killed_engine(tmp_path, monkeypatch):
    """Adapter sync writes each version to a directory of the engine's process (megarl/rollout/vllm_lora.py): removed
    at close and when the engine is collected; one left by a process that is gone (a killed worker) is removed by
    the next engine on the machine, a live process's is not. Every request must report the adapter loaded last."""
    import gc
    import os
    import subprocess
    import sys
    import tempfile
    import types

    from megarl.rollout.vllm_lora import AdapterVersions

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    orphan, live = tmp_path / f"megarl-lora-{gone}-x", tmp_path / f"megarl-lora-{os.getpid()}-y"
    orphan.mkdir(), live.mkdir()
    versions = AdapterVersions()
    assert not orphan.exists() and live.exists() and versions.root.parent == tmp_path
    root = versions.root
    versions.close()
    assert not root.exists()
    collected = AdapterVersions()
    root = collected.root
    del collected
    gc.collect()
    assert not root.exists()
    versions = AdapterVersions()
    versions.current = types.SimpleNamespace(lora_name="megarl-2-v1")
    versions.check_outputs([types.SimpleNamespace(request_id="0", lora_request=versions.current)])
    for stale in (None, types.SimpleNamespace(lora_name="megarl-1-v0")):
        with pytest.raises(WeightUpdateError, match="did not reach generate, or a stale one did"):
            versions.check_outputs([types.SimpleNamespace(request_id="0", lora_request=stale)])
    versions.close()
