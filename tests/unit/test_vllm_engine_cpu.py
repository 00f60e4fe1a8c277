"""The pure parts of the vLLM rollout engine, on CPU without vLLM: output conversion, rollout-group
check, fused-parameter buffering, manifest check, and the errors a CPU machine gets.

The vLLM output objects below are data records with exactly the attributes of vLLM's
``RequestOutput`` / ``CompletionOutput`` (vllm/outputs.py) and ``Logprob`` (vllm/logprobs.py) that
:func:`to_rollout_output` reads; they stand for vLLM's data, not for any of its behaviour.
Expectations are worked out by hand.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
import torch

from megarl.errors import ConfigError, LayoutError, MissingDependencyError, UnsupportedModelError
from megarl.models.spec import spec_from_hf_config
from megarl.parallel.layout import ParallelLayout
from megarl.resharding.plan import make_plan
from megarl.rollout.base import FINISH_LENGTH, FINISH_STOP, WeightUpdateError
from megarl.rollout.vllm_engine import (
    FusedParts,
    VLLMEngine,
    _import_vllm,
    check_manifest,
    check_places,
    to_rollout_output,
)
from megarl.testing.tiny import tiny_config

PAD = 0


@dataclasses.dataclass
class Logprob:  # vllm/logprobs.py
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:  # vllm/outputs.py
    index: int
    text: str
    token_ids: object
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class RequestOutput:  # vllm/outputs.py (the attributes a generate() result carries)
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: object
    outputs: list[CompletionOutput]
    finished: bool = True


def _completion(index, tokens, lps, reason, extra=None, stop_reason=None):
    """``extra``: per position, another (token, logprob) vLLM lists beside the sampled one (logprobs >= 1)."""
    positions = []
    for j, (t, lp) in enumerate(zip(tokens, lps, strict=True)):
        entry = {t: Logprob(lp, rank=2)}
        if extra is not None:
            entry[extra[j][0]] = Logprob(extra[j][1], rank=1)
        positions.append(entry)
    return CompletionOutput(index, "", tokens, sum(lps), positions, reason, stop_reason)


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


# ----------------------------------------------------------------------------------------- check_places


def _plan(tp, pp, dp, rollout_tp):
    spec = spec_from_hf_config(tiny_config("llama").to_dict())  # 4 heads, 2 KV heads, 4 layers
    return make_plan(spec, ParallelLayout(tp=tp, pp=pp, dp=dp), rollout_tp)


@pytest.mark.parametrize("tp, pp, dp, rollout_tp", [
    (2, 1, 2, 2),  # rollout group = training TP group: [0, 1], [2, 3]
    (2, 2, 2, 2),  # PP and DP peers are 2 and 4 ranks away; TP groups stay consecutive
    (4, 1, 1, 4),
    (2, 2, 2, 1),
    (1, 2, 1, 2),  # TP1 x PP2, rollout tp 2: ranks 0 (stage 0) and 1 (stage 1), consecutive
])
def test_places_matching_vllm_pass_on_every_rank(tp, pp, dp, rollout_tp):
    plan = _plan(tp, pp, dp, rollout_tp)
    for rank in range(tp * pp * dp):
        check_places(plan, rank)


def test_strided_hybridflow_group_is_refused():
    # TP4 -> rollout tp 2 (k = 2): training TP rank t plays rollout TP rank t // 2 in micro-DP replica t % 2,
    # so rank 0's group is {0, 2}; vLLM would build {0, 1}. Layout-compatible values: 1 and 4.
    plan = _plan(4, 1, 1, 2)
    with pytest.raises(LayoutError) as err:
        check_places(plan, 0)
    msg = str(err.value)
    assert "rollout group [0, 2]" in msg and "here [0, 1]" in msg
    assert "layout: [1, 4]" in msg


def test_group_across_pipeline_stages_with_dp_is_refused():
    # TP2 x PP2 x DP2, rollout tp 4: the plan joins stages 0 and 1 of one DP replica, ranks {0, 1, 4, 5}
    # (rank = tp + 2 * (dp + 2 * pp)); vLLM would build {0, 1, 2, 3}. Works: 1, 2 (= training tp), 8 (gather).
    plan = _plan(2, 2, 2, 4)
    with pytest.raises(LayoutError) as err:
        check_places(plan, 0)
    msg = str(err.value)
    assert "rollout group [0, 1, 4, 5]" in msg and "here [0, 1, 2, 3]" in msg
    assert "layout: [1, 2, 8]" in msg


# ------------------------------------------------------------------------------- weight-sync building blocks


def test_fused_parts_wait_for_their_siblings_across_buckets():
    parts = FusedParts()
    t = {name: torch.full((1,), float(i)) for i, name in enumerate([
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight", "model.layers.0.input_layernorm.weight",
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.self_attn.q_proj.bias"])}
    first = parts.add([(n, t[n]) for n in ["model.layers.0.self_attn.k_proj.weight",
                                           "model.layers.0.self_attn.q_proj.weight",
                                           "model.layers.0.input_layernorm.weight",
                                           "model.layers.0.mlp.up_proj.weight",
                                           "model.layers.0.self_attn.q_proj.bias"]])
    assert [n for n, _ in first] == ["model.layers.0.input_layernorm.weight"]
    second = parts.add([(n, t[n]) for n in ["model.layers.0.mlp.gate_proj.weight",
                                            "model.layers.0.self_attn.v_proj.weight"]])
    assert [n for n, _ in second] == ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
                                      "model.layers.0.self_attn.q_proj.weight",
                                      "model.layers.0.self_attn.k_proj.weight",
                                      "model.layers.0.self_attn.v_proj.weight"]
    assert all(tensor is t[n] for n, tensor in second)
    assert list(parts.waiting) == ["model.layers.0.self_attn.q_proj.bias"]  # k/v biases never came


def test_manifest_check_names_the_unknown_parameter_and_the_shape_mismatch():
    manifest = {"model.layers.0.self_attn.qkv_proj.weight": (48, 64), "lm_head.weight": (320, 64)}
    check_manifest({"lm_head.weight": torch.zeros(320, 64)}, manifest)
    with pytest.raises(WeightUpdateError, match="nearest vLLM parameter: 'model.layers.0.self_attn.qkv_proj.weight'"):
        check_manifest({"model.layers.0.self_attn.qkv_proj.weights": torch.zeros(48, 64)}, manifest)
    with pytest.raises(WeightUpdateError, match=r"has shape \(320, 64\), the shards give \(300, 64\)"):
        check_manifest({"lm_head.weight": torch.zeros(300, 64)}, manifest)


# ------------------------------------------------------------------------------------ errors on this machine


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_missing_vllm_says_how_to_install():
    with pytest.raises(MissingDependencyError, match=r"pip install megarl\[vllm\]"):
        _import_vllm()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_engine_without_cuda_points_to_the_embedded_engine(tmp_path):
    (tmp_path / "config.json").write_text(tiny_config("llama").to_json_string())
    with pytest.raises(ConfigError, match="backend=embedded"):
        VLLMEngine(tmp_path)


def test_engine_needs_an_unquantized_config(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        VLLMEngine(tmp_path)
    cfg = tiny_config("llama").to_dict() | {"quantization_config": {"quant_method": "fp8"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="quantized"):
        VLLMEngine(tmp_path)
