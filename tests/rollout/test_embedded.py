"""EmbeddedEngine against independent references: transformers' own ``generate`` (greedy token ids) and a
teacher-forced forward of the original HF model (log-probs), on tiny random Llama (GQA) and tied Qwen2."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megarl.errors import ConfigError
from megarl.rollout import (
    EmbeddedEngine,
    RolloutEngine,
    SamplingParams,
    WeightUpdateError,
    sample_next,
)
from megarl.testing.tiny import randomize_, tiny_config

PAD = 0
PROMPTS = [[5, 17, 42, 9], [77], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2], [250, 251, 252, 253, 254, 10, 11]]
MODELS = {
    "llama_gqa": dict(family="llama", vocab_size=512, hidden_size=64, intermediate_size=96, num_heads=4,
                      num_kv_heads=2),
    "qwen2_tied": dict(family="qwen2", vocab_size=300, hidden_size=32, intermediate_size=64, num_heads=4,
                       num_kv_heads=2, tied=True),
    # layer 1 attends to the last 6 tokens only: its cache is not a plain DynamicLayer (no batch merging)
    "qwen2_sliding": dict(family="qwen2", vocab_size=300, hidden_size=32, intermediate_size=64, num_heads=4,
                          num_kv_heads=2, sliding_window=6),
}


def build_reference(name: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    kwargs = {**MODELS[name], **overrides}
    window = kwargs.pop("sliding_window", None)
    config = tiny_config(kwargs.pop("family"), num_layers=2, **kwargs)
    if window is not None:
        fields = {k: v for k, v in config.to_dict().items() if k != "layer_types"}
        fields.update(use_sliding_window=True, sliding_window=window, max_window_layers=1)
        config = type(config)(**fields)
        assert config.layer_types == ["full_attention", "sliding_attention"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    return config, model.eval()


@pytest.fixture(scope="module")
def references():
    return {name: build_reference(name, seed=i) for i, name in enumerate(MODELS)}


def load(engine: EmbeddedEngine, model, buckets: int = 3) -> EmbeddedEngine:
    """Stream the model's state dict into the engine in ``buckets`` calls (generators, not lists)."""
    items = list(model.state_dict().items())
    for b in range(buckets):
        engine.update_weights((name, t.clone()) for name, t in items[b::buckets])
    engine.finish_weight_update()
    return engine


def make_engine(config, model, **kwargs) -> EmbeddedEngine:
    return load(EmbeddedEngine(config, pad_token_id=PAD, **kwargs), model)


def teacher_forced_log_probs(model, prompt, response, temperature: float, vocab_limit: int | None = None):
    """log softmax(logits / T) of the reference model at each response token (T=0 -> 1), in float64."""
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(response)])).logits[0].double()
    if vocab_limit is not None:
        logits[:, vocab_limit:] = float("-inf")
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logp[positions, torch.tensor(response)]


def assert_padding(out, pad: int = PAD) -> None:
    width = out.responses.shape[1]
    assert width == int(out.response_lengths.max())
    expected_mask = torch.arange(width)[None, :] < out.response_lengths[:, None]
    assert torch.equal(out.response_mask, expected_mask)
    assert torch.all(out.responses[~expected_mask] == pad)
    assert torch.all(out.log_probs[~expected_mask] == 0)
    assert out.log_probs.dtype == torch.float32 and out.responses.dtype == torch.long


# ---- construction ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [(dict(n=0), "n"), (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"),
     (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"), (dict(max_new_tokens=0), "max_new_tokens"),
     (dict(stop_token_ids=[1]), "stop_token_ids")],
)
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**({"max_new_tokens": 4} | kwargs))


@pytest.mark.parametrize("rope_scaling", [False, True])
def test_built_without_meta_tensors_and_with_the_reference_buffers(rope_scaling):
    """Parameters are real (empty) storage; rotary inv_freq (a non-persistent buffer) equals the reference's."""
    config, model = build_reference("llama_gqa", rope_scaling=rope_scaling)
    engine = EmbeddedEngine(config, pad_token_id=PAD)
    assert isinstance(engine, RolloutEngine)
    assert not any(t.is_meta for t in [*engine.model.parameters(), *engine.model.buffers()])
    ref_buffers = dict(model.named_buffers())
    engine_buffers = dict(engine.model.named_buffers())
    assert engine_buffers.keys() == ref_buffers.keys() and any("inv_freq" in n for n in ref_buffers)
    for name, buf in engine_buffers.items():
        assert torch.equal(buf, ref_buffers[name]), name
    assert sorted(engine.parameter_names) == sorted(n for n, _ in model.named_parameters())


# ---- the sampler -------------------------------------------------------------------------------


def sampler_logits(vocab: int = 600) -> torch.Tensor:
    """Rows from peaked to nearly flat (a flat row's 0.9-nucleus spans most of the vocabulary)."""
    gen = torch.Generator().manual_seed(0)
    scales = torch.tensor([6.0, 3.0, 1.0, 0.3, 0.01])[:, None]
    return torch.randn(len(scales), vocab, generator=gen) * scales


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (0, 0.5), (50, 1.0), (50, 0.8), (1, 1.0), (0, 1.0)])
def test_sampler_support_matches_transformers_warpers(top_k, top_p):
    """The tokens the sampler can draw are exactly those transformers' warpers leave finite."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from megarl.rollout.base import _candidates

    logits, temperature = sampler_logits(vocab=3000), 0.7
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    scaled = logits / temperature
    ids, weights = _candidates(scaled, torch.logsumexp(scaled, -1), top_k, top_p)
    ids = torch.arange(logits.shape[1]).expand_as(logits) if ids is None else ids
    for row in range(len(logits)):
        ours = set(ids[row][weights[row] > 0].tolist())
        assert ours == set(torch.isfinite(scores[row]).nonzero().squeeze(1).tolist()), row
    if top_p < 1 and not top_k:  # the flat row's nucleus needs more than the first 256 and 1024 candidates
        assert (weights[-1] > 0).sum() > 1024 and (weights[0] > 0).sum() < 256


@pytest.mark.parametrize("min_p, top_k, top_p", [(0.1, 0, 1.0), (0.5, 0, 1.0), (0.05, 50, 1.0), (0.02, 0, 0.9)])
def test_sampler_min_p_and_repetition_penalty_follow_transformers(min_p, top_k, top_p):
    """The support after transformers' repetition penalty, temperature and min-p warpers (min-p before top-k and
    top-p, vLLM's order; min-p is relative to the most likely token, so it removes the same tokens on either side of
    a renormalisation, and with top-p the nucleus is taken over what min-p left); log-probs stay the policy's
    (unpenalised, untruncated)."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from megarl.rollout.base import penalize_repetition

    logits, temperature, penalty = sampler_logits(vocab=3000), 0.7, 1.3
    history = torch.randint(0, 3000, (len(logits), 40), generator=torch.Generator().manual_seed(1))
    seen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, history, True)
    scores = RepetitionPenaltyLogitsProcessor(penalty)(history, logits.clone())
    torch.testing.assert_close(penalize_repetition(logits, seen, penalty), scores, rtol=0, atol=0)
    scores = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(temperature)(None, scores))
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    params = SamplingParams(temperature=temperature, min_p=min_p, top_k=top_k, top_p=top_p,
                            repetition_penalty=penalty, max_new_tokens=1)
    draws = 800
    tokens, log_probs = sample_next(logits.repeat_interleave(draws, 0), params, torch.Generator().manual_seed(0),
                                    seen=seen.repeat_interleave(draws, 0))
    for row in range(len(logits)):
        allowed = set(torch.isfinite(scores[row]).nonzero().squeeze(1).tolist())
        drawn = set(tokens[row * draws: (row + 1) * draws].tolist())
        assert drawn <= allowed, row
        assert len(allowed) == 1 or len(drawn) > 1, row  # it does sample, not only the argmax
    ref = torch.log_softmax(logits.double() / temperature, -1).repeat_interleave(draws, 0)
    torch.testing.assert_close(log_probs.double(), ref.gather(1, tokens[:, None]).squeeze(1), rtol=0, atol=1e-5)
    # greedy takes the argmax of the penalised logits; its log-prob is the unpenalised T=1 one
    greedy, lp = sample_next(logits, SamplingParams(temperature=0, repetition_penalty=penalty, max_new_tokens=1),
                             None, seen=seen)
    assert torch.equal(greedy, penalize_repetition(logits, seen, penalty).argmax(-1))
    torch.testing.assert_close(lp.double(), torch.log_softmax(logits.double(), -1).gather(1, greedy[:, None])[:, 0],
                               rtol=0, atol=1e-6)


def test_greedy_with_repetition_penalty_matches_hf_generate(references):
    """The penalty covers the prompt and every token generated so far (transformers' generate, the reference),
    across rows joining a running batch."""
    config, model = references["llama_gqa"]
    max_new = 12
    model.generation_config.eos_token_id = None
    expected = [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new, pad_token_id=PAD,
                               repetition_penalty=1.8)[0, len(p):].tolist() for p in PROMPTS]
    plain = [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new,
                            pad_token_id=PAD)[0, len(p):].tolist() for p in PROMPTS]
    assert expected != plain  # the penalty changes what greedy decoding picks here
    out = make_engine(config, model, max_batch_size=2).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=max_new, repetition_penalty=1.8))
    assert out.token_lists() == expected


def test_sampler_frequencies_and_log_probs():
    """4000 draws of each row: frequencies follow the renormalised nucleus (float64 reference), log-probs
    are the untruncated tempered log-softmax, and the same seed repeats the draws."""
    logits, temperature, top_p, draws = sampler_logits()[:3], 0.7, 0.9, 4000
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=64, seed=0)
    batch = logits.repeat_interleave(draws, 0)
    tokens, log_probs = sample_next(batch, params, torch.Generator().manual_seed(0))
    again, _ = sample_next(batch, params, torch.Generator().manual_seed(0))
    assert torch.equal(tokens, again)
    ref_logp = torch.log_softmax(batch.double() / temperature, -1)
    torch.testing.assert_close(log_probs.double(), ref_logp.gather(1, tokens[:, None]).squeeze(1), rtol=0, atol=1e-5)
    for row in range(len(logits)):
        probs = torch.softmax(logits[row].double() / temperature, -1)
        order = probs.argsort(descending=True)
        keep = order[(probs[order].cumsum(0) - probs[order]) <= top_p]
        expected = torch.zeros_like(probs)
        expected[keep] = probs[keep] / probs[keep].sum()
        seen = torch.bincount(tokens[row * draws : (row + 1) * draws], minlength=len(probs)).double() / draws
        assert seen[expected == 0].sum() == 0
        noise = 0.5 * (2 * expected * (1 - expected) / (torch.pi * draws)).sqrt().sum()  # E[total variation]
        assert 0.5 * (seen - expected).abs().sum() < 2 * noise + 0.01, row


# ---- generation vs transformers ----------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_matches_hf_generate_with_stop_tokens(references, name):
    """Greedy ids equal transformers' generate per prompt (no padding there), stop tokens included; chunks of 3."""
    config, model = references[name]
    max_new = 14

    def hf_generate(stop):
        kwargs = dict(do_sample=False, max_new_tokens=max_new, pad_token_id=PAD, eos_token_id=list(stop) or None)
        model.generation_config.eos_token_id = None  # the config's own eos must not stop the reference
        return [model.generate(torch.tensor([p]), **kwargs)[0, len(p):].tolist() for p in PROMPTS]

    free = hf_generate(())
    # a stop token greedy decoding emits mid-way in one row but never in another (both finish reasons occur)
    stop = next(t for t in free[0][2:] if any(t not in row for row in free[1:]))
    expected = hf_generate((stop, 1))
    engine = make_engine(config, model, max_batch_size=3)
    out = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=max_new, stop_token_ids=(stop, 1)))
    assert out.token_lists() == expected
    reasons = ["stop" if row[-1] in (stop, 1) else "length" for row in expected]
    assert out.finish_reasons == reasons and set(reasons) == {"stop", "length"}
    assert all(len(r) == max_new for r, why in zip(expected, reasons, strict=True) if why == "length")
    assert out.prompt_index.tolist() == list(range(len(PROMPTS)))
    assert_padding(out)
    for p, row, lp in zip(PROMPTS, expected, out.log_prob_lists(), strict=True):  # greedy: log-probs at T=1
        torch.testing.assert_close(torch.tensor(lp, dtype=torch.float64), teacher_forced_log_probs(model, p, row, 0),
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", list(MODELS))
def test_sampled_log_probs_match_teacher_forcing(references, name):
    """T=0.7 with top-k and top-p, n=3, stops: each row's log-probs equal the reference model's tempered,
    untruncated log-softmax over its own prompt + response; every sampled token lies in the top-k / top-p set."""
    config, model = references[name]
    temperature, top_k, top_p, n = 0.7, 40, 0.9, 3
    params = SamplingParams(n=n, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=10,
                            stop_token_ids=tuple(range(2, 40)), seed=1)
    out = make_engine(config, model, max_batch_size=5).generate(PROMPTS, params)
    assert out.prompt_index.tolist() == [i for i in range(len(PROMPTS)) for _ in range(n)]
    assert set(out.finish_reasons) == {"stop", "length"}
    assert_padding(out)
    for i, (row, lp) in enumerate(zip(out.token_lists(), out.log_prob_lists(), strict=True)):
        prompt = PROMPTS[out.prompt_index[i]]
        assert (out.finish_reasons[i] == "stop") == (2 <= row[-1] < 40) and all(not 2 <= t < 40 for t in row[:-1])
        ref = teacher_forced_log_probs(model, prompt, row, temperature)
        torch.testing.assert_close(torch.tensor(lp, dtype=torch.float64), ref, rtol=0, atol=1e-5)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + row])).logits[0, len(prompt) - 1 : -1].double() / temperature
        for step, token in enumerate(row):
            order = logits[step].argsort(descending=True)
            rank = int((order == token).nonzero())
            mass_above = torch.softmax(logits[step][order[:top_k]], -1)[:rank].sum()
            assert rank < top_k and mass_above <= top_p + 1e-6, (i, step, rank, float(mass_above))


def test_rows_joining_a_running_batch(references, monkeypatch):
    """With 2 rows at a time, waiting rows join running batches whose caches are shorter and longer than their
    prompts (both get left-padded); log-probs still equal the reference's over each row's own sequence."""
    from megarl.rollout import embedded

    merges = []
    original = embedded._Batch.merge

    def spy(self, other):
        merges.append((self.mask.shape[1], other.mask.shape[1]))
        original(self, other)

    monkeypatch.setattr(embedded._Batch, "merge", spy)
    config, model = references["llama_gqa"]
    prompts = [[7, 8], PROMPTS[2], [9], PROMPTS[3], PROMPTS[0]]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, stop_token_ids=tuple(range(2, 40)), seed=0)
    out = make_engine(config, model, max_batch_size=2).generate(prompts, params)
    assert any(old < new for old, new in merges) and any(old > new for old, new in merges), merges
    assert out.prompt_index.tolist() == [i for i in range(len(prompts)) for _ in range(2)]
    assert_padding(out)
    for i, (row, lp) in enumerate(zip(out.token_lists(), out.log_prob_lists(), strict=True)):
        ref = teacher_forced_log_probs(model, prompts[out.prompt_index[i]], row, 1.0)
        torch.testing.assert_close(torch.tensor(lp, dtype=torch.float64), ref, rtol=0, atol=1e-5)


def test_seeds_and_grouping(references):
    config, model = references["llama_gqa"]
    engine = make_engine(config, model)

    def run(seed):
        return engine.generate(PROMPTS[:3], SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=seed))

    a, b, c = run(7), run(7), run(8)
    assert torch.equal(a.responses, b.responses) and torch.equal(a.log_probs, b.log_probs)
    assert not torch.equal(a.responses, c.responses)
    assert not torch.equal(run(None).responses, run(None).responses)
    assert a.prompt_index.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    for p in range(3):  # the n samples of one prompt are distinct draws, not copies
        assert len({tuple(r) for r in a.token_lists()[4 * p : 4 * p + 4]}) > 1


def test_top_k_1_equals_greedy(references):
    config, model = references["qwen2_tied"]
    engine = make_engine(config, model)
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=12))
    top1 = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.5, top_k=1, max_new_tokens=12, seed=3))
    assert top1.token_lists() == [row for row in greedy.token_lists() for _ in range(2)]


def test_vocab_limit_masks_high_ids(references):
    config, model = references["llama_gqa"]
    limit = 200
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=12, seed=0)
    unlimited = make_engine(config, model).generate(PROMPTS, params)
    assert int(unlimited.responses.max()) >= limit  # without the limit, high ids are sampled
    out = make_engine(config, model, vocab_limit=limit).generate(PROMPTS, params)
    assert int(out.responses[out.response_mask].max()) < limit
    for i in (0, 5, 10):
        prompt, row = PROMPTS[out.prompt_index[i]], out.token_lists()[i]
        ref = teacher_forced_log_probs(model, prompt, row, 1.0, vocab_limit=limit)
        torch.testing.assert_close(torch.tensor(out.log_prob_lists()[i], dtype=torch.float64), ref, rtol=0, atol=1e-5)


# ---- weight sync and memory --------------------------------------------------------------------


def test_weight_update_errors(references):
    config, model = references["llama_gqa"]
    engine = EmbeddedEngine(config, pad_token_id=PAD)
    state = model.state_dict()
    with pytest.raises(WeightUpdateError, match="update_weights"):  # nothing loaded yet
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=4))
    missing = "model.layers.1.mlp.down_proj.weight"
    loaded = engine.update_weights((k, v) for k, v in state.items() if k != missing)
    assert loaded == set(state) - {missing}
    with pytest.raises(WeightUpdateError, match=r"1 of \d+ parameters.*model\.layers\.1\.mlp\.down_proj\.weight"):
        engine.finish_weight_update()
    with pytest.raises(WeightUpdateError, match=r"down_proj\.weight.*expected shape \(64, 96\), found \(96, 64\)"):
        engine.update_weights([(missing, state[missing].t())])
    with pytest.raises(WeightUpdateError, match=r"'model\.layers\.1\.mlp\.down_proj\.weights'.*nearest.*down_proj"):
        engine.update_weights([(missing + "s", state[missing])])
    engine.update_weights([(missing, state[missing].double())])  # cast to the engine dtype on load
    engine.finish_weight_update()
    assert engine.model.get_parameter(missing).dtype == torch.float32
    with pytest.raises(ConfigError, match="prompt 1 is empty"):
        engine.generate([[3], []], SamplingParams(max_new_tokens=4))


def test_tied_lm_head_is_optional_but_shape_checked(references):
    config, model = references["qwen2_tied"]
    engine = EmbeddedEngine(config, pad_token_id=PAD)
    assert "lm_head.weight" not in engine.parameter_names
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    engine.update_weights(state.items())
    engine.finish_weight_update()
    embed = state["model.embed_tokens.weight"]
    assert engine.update_weights([("lm_head.weight", embed)]) == set()
    with pytest.raises(WeightUpdateError, match="lm_head.weight.*expected shape"):
        engine.update_weights([("lm_head.weight", embed[:-1])])


def test_sleep_frees_storage_and_wake_up_restores_generation(references):
    config, model = references["qwen2_tied"]
    engine = make_engine(config, model)
    params = SamplingParams(n=2, temperature=0.8, top_p=0.9, max_new_tokens=10, seed=5)
    before = engine.generate(PROMPTS, params)
    engine.sleep()
    storages = [p.untyped_storage() for p in engine.model.parameters()]
    assert storages and all(s.nbytes() == 0 for s in storages)
    with pytest.raises(WeightUpdateError, match="asleep"):
        engine.generate(PROMPTS, params)
    with pytest.raises(WeightUpdateError, match="asleep"):
        engine.update_weights(model.state_dict().items())
    engine.wake_up()
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in engine.model.parameters())
    with pytest.raises(WeightUpdateError, match="complete weight sync"):
        engine.generate(PROMPTS, params)
    after = load(engine, model).generate(PROMPTS, params)
    assert torch.equal(before.responses, after.responses) and torch.equal(before.log_probs, after.log_probs)


# ---- KV kept across calls (multi-turn) ---------------------------------------------------------


def _continue(prompts, out, observations):
    """Each row's next prompt: its prompt, its response, an observation (a conversation's next turn)."""
    return [list(prompts[int(i)]) + row + obs
            for i, row, obs in zip(out.prompt_index, out.token_lists(), observations, strict=True)]


def test_kept_prefixes_continue_conversations(references):
    """Three turns over four conversations plus a fresh prompt, 3 rows at a time (rows join running batches, kept
    prefixes of different lengths share a prefill): each continuing prompt reuses exactly its previous call's prompt
    and all but its last sampled token (hand-counted), and every row's log-probs equal the reference's over its
    whole sequence. Greedy tokens equal an engine that keeps nothing; a weight sync forgets everything."""
    config, model = references["llama_gqa"]
    kept = make_engine(config, model, max_batch_size=3, prefix_cache_bytes=8 << 20)
    plain = make_engine(config, model, max_batch_size=3)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=tuple(range(2, 60)), seed=3)
    prompts = PROMPTS
    out = kept.generate(prompts, params)
    assert out.cached_tokens.tolist() == [0] * len(prompts)
    for turn in range(2):
        observations = [[300 + turn, 301], [302] * (3 + turn), [303], [304, 305, 306, 307, 308]]
        fresh = [[11, 12, 13 + turn]]
        nxt = _continue(prompts, out, observations) + fresh
        expected = [len(p) + len(r) - 1 for p, r in zip([prompts[int(i)] for i in out.prompt_index],
                                                          out.token_lists(), strict=True)] + [0]
        prompts, out = nxt, kept.generate(nxt, dataclasses.replace(params, seed=10 + turn))
        assert out.cached_tokens.tolist() == expected, turn
        for i, (row, lp) in enumerate(zip(out.token_lists(), out.log_prob_lists(), strict=True)):
            ref = teacher_forced_log_probs(model, prompts[i], row, 1.0)
            torch.testing.assert_close(torch.tensor(lp, dtype=torch.float64), ref, rtol=0, atol=1e-5)
        prompts, out = prompts[:4], _rows(out, 4)  # the fresh prompt does not go on
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    twice = PROMPTS + PROMPTS[:1]  # two equal conversations: equal kept rows, each continuing its own
    first = kept.generate(twice, greedy)
    nxt = _continue(twice, first, [[400]] * 5)
    second = kept.generate(nxt, greedy)
    assert second.cached_tokens.tolist() == [len(p) - 2 for p in nxt]  # all but the last token and the observation
    assert second.token_lists() == plain.generate(nxt, greedy).token_lists()
    load(kept, model)
    assert kept.generate(nxt, greedy).cached_tokens.tolist() == [0] * 5


def _rows(out, count):
    return dataclasses.replace(out, prompt_index=out.prompt_index[:count], responses=out.responses[:count],
                               response_mask=out.response_mask[:count], log_probs=out.log_probs[:count],
                               response_lengths=out.response_lengths[:count], finish_reasons=out.finish_reasons[:count])


def test_sliding_window_models_keep_nothing(references):
    """A cache with sliding-window layers is not kept (its columns cannot be cut and padded): every prompt is
    prefilled in full, and the results still equal the reference."""
    config, model = references["qwen2_sliding"]
    engine = make_engine(config, model, prefix_cache_bytes=8 << 20)
    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=0)
    out = engine.generate(PROMPTS, params)
    nxt = _continue(PROMPTS, out, [[7]] * 4)
    out = engine.generate(nxt, params)
    assert out.cached_tokens.tolist() == [0] * 4
    for p, row, lp in zip(nxt, out.token_lists(), out.log_prob_lists(), strict=True):
        torch.testing.assert_close(torch.tensor(lp, dtype=torch.float64), teacher_forced_log_probs(model, p, row, 1.0),
                                   rtol=0, atol=1e-5)
