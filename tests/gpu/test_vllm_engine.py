"""The vLLM rollout engine on a GPU (skipped without CUDA or vLLM): greedy generation against
``transformers.generate``, sampled log-probs against a transformers forward, stop tokens, and a
sleep / wake / weight-sync cycle through both weight paths.

One engine serves the whole module (vLLM's parallel state is per process), built in a torch.distributed
world of one like a colocated policy worker's, with rollout tp 1. Weights arrive only through
``update_weights`` (vLLM starts from its dummy init).
"""

import importlib.util

import pytest
import torch

from megarl.rollout.base import FINISH_LENGTH, FINISH_STOP, SamplingParams, WeightUpdateError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (pip install megarl[vllm] on a CUDA machine)"),
]

DTYPE = torch.bfloat16
EOS = 1  # tiny_config's eos_token_id
TIE_MARGIN = 0.25  # greedy tokens are compared while the reference's top-2 logit gap exceeds bf16 noise
PROMPTS = [[5, 17, 42, 99], [3], [250, 12, 7, 7, 64, 200]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megarl.testing.tiny import make_tiny_model

    # head_dim 64 (every vLLM attention backend supports it; the shared tiny models have 16); vocab 300 is
    # not a multiple of 64, so vLLM's padded vocabulary rows are exercised
    return make_tiny_model(tmp_path_factory.mktemp("vllm") / "llama", "llama", hidden_size=256, num_heads=4,
                           num_kv_heads=2, intermediate_size=512, num_layers=2, seed=3)


@pytest.fixture(scope="module")
def hf_weights(model_dir):
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()


@pytest.fixture(scope="module")
def engine(model_dir, hf_weights):
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.rollout.vllm_engine import VLLMEngine

    init_distributed(ParallelLayout())
    eng = VLLMEngine(model_dir, tp=1, dtype=DTYPE, gpu_memory_utilization=0.3, seed=0, max_model_len=256,
                     enforce_eager=True, pad_token_id=0, expected_tp_ranks=[0])
    _sync(eng, hf_weights)
    yield eng
    eng.sleep()  # give the GPU back to later tests


def _sync(engine, weights, bucket=5):
    """One weight sync in small buckets (q/k/v and gate/up end up split across buckets)."""
    engine.wake_up()
    items = [(name, t.to(DTYPE).cuda()) for name, t in weights.items()]
    for i in range(0, len(items), bucket):
        engine.update_weights(items[i : i + bucket])
    engine.finish_weight_update()


def test_greedy_matches_transformers_generate(engine, reference):
    out = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.0, max_new_tokens=8, stop_token_ids=(EOS,)))
    assert out.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
    rows = out.token_lists()
    for i, prompt in enumerate(PROMPTS):
        ours = rows[2 * i]
        assert rows[2 * i + 1] == ours  # greedy: n identical rows
        with torch.no_grad():
            gen = reference.generate(torch.tensor([prompt]).cuda(), do_sample=False, max_new_tokens=8,
                                     eos_token_id=EOS, pad_token_id=0, output_logits=True,
                                     return_dict_in_generate=True)
        theirs = gen.sequences[0, len(prompt):].tolist()
        compared = 0
        for j, step_logits in enumerate(gen.logits):
            top = step_logits[0].float().topk(2).values
            if top[0] - top[1] < TIE_MARGIN:
                break  # a near tie: bf16 and fp32 may legitimately pick different tokens from here on
            assert ours[j] == theirs[j], f"prompt {i} position {j}: {ours} vs transformers {theirs}"
            compared += 1
        else:
            assert ours == theirs
            assert out.finish_reasons[2 * i] == (FINISH_STOP if theirs[-1] == EOS else FINISH_LENGTH)
        assert compared >= 1


def _reference_log_probs(reference, prompt, tokens, temperature, top_k=0):
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + tokens]).cuda()).logits[0, len(prompt) - 1 : -1].double()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    picked = logp.gather(-1, torch.tensor(tokens).cuda()[:, None])[:, 0]
    if top_k:  # renormalised over the top-k kept tokens, as vLLM's processed_logprobs are
        picked = picked - torch.logsumexp(logp.topk(top_k, dim=-1).values, dim=-1)
    return picked.cpu()


@pytest.mark.parametrize("top_k", [0, 5])
def test_sampled_log_probs_match_a_transformers_forward(engine, reference, top_k):
    t = 0.8
    params = SamplingParams(n=3, temperature=t, top_k=top_k, max_new_tokens=6, seed=1234)
    out = engine.generate(PROMPTS, params)
    assert engine.generate(PROMPTS, params).token_lists() == out.token_lists()  # seeded: reproducible
    diffs = []
    for i, tokens, lps in zip(out.prompt_index.tolist(), out.token_lists(), out.log_prob_lists(), strict=True):
        ref = _reference_log_probs(reference, PROMPTS[i], tokens, t, top_k)
        diffs.append((ref - torch.tensor(lps, dtype=torch.float64)).abs())
    d = torch.cat(diffs)
    assert d.mean() < 2e-2 and d.max() < 0.15, (d.mean(), d.max())


def test_stop_token_ends_the_row_and_stays_in_it(engine):
    free = engine.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_new_tokens=8)).token_lists()[0]
    stop = free[2]
    cut = free.index(stop) + 1
    out = engine.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop,)))
    assert out.token_lists() == [free[:cut]]
    assert out.finish_reasons == [FINISH_STOP]
    assert out.response_lengths.tolist() == [cut]


def test_sleep_wake_and_weight_updates(engine, hf_weights):
    from megarl.rollout.vllm_engine import WeightPath

    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = engine.generate(PROMPTS, greedy).token_lists()

    free = torch.cuda.mem_get_info()[0]
    engine.sleep()
    weight_bytes = sum(t.numel() for t in hf_weights.values()) * 2
    assert torch.cuda.mem_get_info()[0] - free >= weight_bytes  # weights and KV cache released
    with pytest.raises(WeightUpdateError, match="asleep"):
        engine.generate(PROMPTS, greedy)
    with pytest.raises(WeightUpdateError, match="asleep"):
        engine.update_weights([])

    engine.wake_up()
    names = list(hf_weights)
    engine.update_weights([(n, hf_weights[n].to(DTYPE).cuda()) for n in names[:-1]])
    with pytest.raises(WeightUpdateError, match="incomplete weight update"):  # a partial sync is refused
        engine.finish_weight_update()
    with pytest.raises(WeightUpdateError, match="weight sync"):
        engine.generate(PROMPTS, greedy)

    # all-zero weights give all-zero logits, so greedy picks token 0 everywhere; the same prompts right after
    # the next sync must not reuse KV blocks cached under these weights (prefix cache reset)
    _sync(engine, {n: torch.zeros_like(t) for n, t in hf_weights.items()})
    assert engine.generate(PROMPTS, greedy).token_lists() == [[0] * 8] * len(PROMPTS)
    _sync(engine, hf_weights)
    assert engine.generate(PROMPTS, greedy).token_lists() == before

    # the path used at rollout tp > 1 (vllm_params + copy by name), here with tp-1 "shards"
    engine.weight_path = WeightPath.COPY
    try:
        engine.wake_up()
        bad = hf_weights["model.norm.weight"][:-1]
        with pytest.raises(WeightUpdateError, match="shape"):
            engine.update_weights([("model.norm.weight", bad.to(DTYPE).cuda())])
        _sync(engine, {n: torch.zeros_like(t) for n, t in hf_weights.items()})
        assert engine.generate(PROMPTS, greedy).token_lists() == [[0] * 8] * len(PROMPTS)
        _sync(engine, hf_weights)
        assert engine.generate(PROMPTS, greedy).token_lists() == before
    finally:
        engine.weight_path = WeightPath.LOAD_WEIGHTS
