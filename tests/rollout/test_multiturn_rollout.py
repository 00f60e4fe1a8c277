"""The multi-turn rollout loop (issue #25) on the embedded engine with a tiny random Qwen2 and a ChatML tokenizer:
every conversation's tokens spell the chat template's rendering of its messages, the rollout log-probs of every
model segment equal a transformers forward over the whole trajectory, budgets and turn limits end conversations
where they should, environment steps run concurrently, and an environment that raises, hangs or returns garbage
fails the step or is scored and counted, as configured, its kind, text and traceback kept.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from megarl.multiturn import ChatRenderer, EnvironmentFailure, MultiTurnConfig, Step
from megarl.multiturn.rollout import (
    FINISH_DONE,
    FINISH_ERROR,
    FINISH_TOKENS,
    FINISH_TURNS,
    conversations_batch,
    run_conversations,
)
from megarl.rewards.base import OnError
from megarl.rollout.base import SamplingParams
from megarl.testing.tiny import CHATML_SPECIAL_TOKENS, CHATML_TOOLS_TEMPLATE, make_tokenizer, randomize_, tiny_config

ROWS = [{"prompt": "What is 2+3?", "turns": 3}, {"prompt": "Say hi.", "turns": 1}, {"prompt": "Count.", "turns": 2}]


class Scripted:
    """Replies "ok k" to the model's k-th turn and ends the episode after the row's number of turns, rewarding
    each turn with 0.25; records how many of its calls run at once (across all conversations)."""

    live = 0
    peak = 0
    lock = threading.Lock()

    def __init__(self, delay: float = 0.0) -> None:
        self.delay, self.k, self.turns = delay, 0, 0

    def reset(self, row):
        self.turns = row["turns"]
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        with Scripted.lock:
            Scripted.live += 1
            Scripted.peak = max(Scripted.peak, Scripted.live)
        time.sleep(self.delay)
        with Scripted.lock:
            Scripted.live -= 1
        self.k += 1
        return Step([{"role": "user", "content": f"ok {self.k}"}], reward=0.25, done=self.k >= self.turns)


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoModelForCausalLM

    from megarl.rollout.embedded import EmbeddedEngine

    tok = make_tokenizer(special_tokens=CHATML_SPECIAL_TOKENS, chat_template=CHATML_TOOLS_TEMPLATE,
                         eos_token="<|im_end|>")
    config = tiny_config("qwen2", vocab_size=len(tok), hidden_size=64, num_layers=2, max_positions=512)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_(model, seed=3)
    engine = EmbeddedEngine(config, pad_token_id=tok.pad_token_id, max_batch_size=16)
    engine.update_weights(model.state_dict().items())
    engine.finish_weight_update()
    return tok, model, engine


def _run(setup, config, make_env=Scripted, n=2, seed=11):
    tok, _, engine = setup
    params = SamplingParams(temperature=1.0, max_new_tokens=1, seed=seed)

    def generate(prompts, p):
        out = engine.generate(prompts, p)
        return list(zip(out.token_lists(), out.log_prob_lists(), strict=True))

    return run_conversations(ROWS, n, make_env, ChatRenderer(tok), generate, params, config,
                             stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")])


def test_conversations_spell_the_templates_rendering_and_log_probs_match_transformers(setup):
    tok, model, _ = setup
    result = _run(setup, MultiTurnConfig(max_turns=4, max_total_tokens=200, max_turn_tokens=6))
    renderer = ChatRenderer(tok)
    assert [c.row for c in result.conversations] == [0, 0, 1, 1, 2, 2]
    for c in result.conversations:
        t = c.trajectory
        assert c.finish == FINISH_DONE and c.turns == ROWS[c.row]["turns"] and c.reward == 0.25 * c.turns
        # model turns are sampled tokens (the random model rarely stops: <|im_end|> comes from the template)
        text = tok.decode(t.ids)
        assert text == renderer.render(t.messages, generation_prompt=True)[: len(text)]
        assert [s.kind for s in t.segments] == ["prompt"] + ["model", "observation"] * (c.turns - 1) + ["model"]
        ids = torch.tensor([t.ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), dim=-1)
        ref = logp.gather(-1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(t.loss_mask()[1:], dtype=torch.bool)
        got = torch.tensor(t.rollout_log_probs()[1:], dtype=torch.float64)
        assert mask.sum() == sum(len(s.ids) for s in t.segments if s.kind == "model")
        assert (got - ref)[mask].abs().max() < 1e-5
    batch = conversations_batch(result.conversations, tok.pad_token_id)
    assert batch["prompt_uid"].tolist() == [0, 0, 1, 1, 2, 2]
    assert batch["environment_scores"].tolist() == [0.75, 0.75, 0.25, 0.25, 0.5, 0.5]
    width = batch["input_ids"].shape[1]
    for i, c in enumerate(result.conversations):
        pad = width - len(c.trajectory.ids)
        assert batch["input_ids"][i].tolist() == c.trajectory.ids + [tok.pad_token_id] * pad
        assert batch["response_mask"][i].tolist() == c.trajectory.loss_mask() + [0] * pad
        assert batch["attention_mask"][i].tolist() == [1] * len(c.trajectory.ids) + [0] * pad
        model = sum(len(s.ids) for s in c.trajectory.segments if s.kind == "model")  # the model's tokens, apart
        assert batch["response_lengths"][i] == model == batch["response_mask"][i].sum()
        assert batch["observation_lengths"][i] == len(c.trajectory.ids) - c.trajectory.prompt_length - model > 0 or (
            c.turns == 1)
    assert result.metrics["multiturn/finished_done"] == 6 and result.metrics["multiturn/turns_max"] == 3
    # the environment ended every conversation, but a last turn that no <|im_end|> closed was cut at max_turn_tokens:
    # truncated, as a single-turn response cut at max_new_tokens (the random model rarely stops)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert batch.non_tensors["finish_reasons"] == ["stop" if c.trajectory.segments[-1].ids[-1] == end else "length"
                                                   for c in result.conversations]
    assert "length" in batch.non_tensors["finish_reasons"]
    assert batch.non_tensors["final_texts"] == [c.trajectory.messages[-1]["content"] for c in result.conversations]


def test_turn_and_token_limits_end_conversations(setup):
    turns = _run(setup, MultiTurnConfig(max_turns=2, max_total_tokens=200, max_turn_tokens=4)).conversations
    for c in turns:
        expected = FINISH_DONE if ROWS[c.row]["turns"] <= 2 else FINISH_TURNS
        assert c.finish == expected and c.turns == min(2, ROWS[c.row]["turns"])
        assert c.trajectory.segments[-1].kind == "model"  # no trailing observation
    tight = _run(setup, MultiTurnConfig(max_turns=4, max_total_tokens=12, max_turn_tokens=8)).conversations
    for c in tight:
        assert len(c.trajectory.ids) - c.trajectory.prompt_length <= 12
        assert c.trajectory.segments[-1].kind == "model"
    assert any(c.finish == FINISH_TOKENS for c in tight)


def test_environment_steps_run_concurrently(setup):
    Scripted.peak = 0
    _run(setup, MultiTurnConfig(max_turns=2, max_turn_tokens=2, env_workers=8), make_env=lambda: Scripted(0.2))
    assert Scripted.peak >= 4  # six conversations, one turn each at a time: their steps overlap


def test_the_timeout_counts_a_calls_own_time_not_its_wait_in_the_queue(setup):
    """Six 0.2 s steps on one worker take 1.2 s in all; each is within its 0.5 s limit."""
    result = _run(setup, MultiTurnConfig(max_turns=1, max_turn_tokens=2, env_workers=1, env_timeout_s=0.5),
                  make_env=lambda: Scripted(0.2))
    assert result.metrics["multiturn/env_errors"] == 0 and len(result.conversations) == 6


class Failing(Scripted):
    mode = "raise"

    def step(self, text):
        if self.k == 0 and self.turns == 3:  # row 0's first turn
            if Failing.mode == "raise":
                raise KeyError("lookup failed")
            if Failing.mode == "hang":
                time.sleep(1.0)
            if Failing.mode == "garbage":
                return {"messages": "nope"}
        return super().step(text)


@pytest.mark.parametrize("mode, match, kind", [
    ("raise", r"Failing.step \(row 0, turn 1\) raised KeyError", "KeyError in Failing.step"),
    ("hang", r"did not return within env_timeout_s=0.3", "timeout in Failing.step"),
    ("garbage", "returned dict", "invalid result from Failing.step")])
def test_environment_failures_raise_or_are_scored(setup, mode, match, kind):
    Failing.mode = mode
    with pytest.raises(EnvironmentFailure, match=match):
        _run(setup, MultiTurnConfig(max_turns=3, max_turn_tokens=2, env_timeout_s=0.3), make_env=Failing)
    scored = _run(setup, MultiTurnConfig(max_turns=3, max_turn_tokens=2, env_timeout_s=0.3,
                                         on_env_error=OnError.SCORE, env_error_score=-1.0), make_env=Failing)
    failed = [c for c in scored.conversations if c.finish == FINISH_ERROR]
    assert [c.row for c in failed] == [0, 0] and all(c.reward == -1.0 and c.turns == 1 for c in failed)
    assert all(c.finish == FINISH_DONE for c in scored.conversations if c.row != 0)
    assert scored.metrics["multiturn/env_errors"] == 2
    # the texts, for the run's env_errors.jsonl: conversations 0 and 1 (row 0), its first turn
    errors = scored.errors()
    assert [(e["conversation"], e["row"], e["turn"], e["kind"], e["ended"]) for e in errors] == [
        (0, 0, 1, kind, True), (1, 0, 1, kind, True)]
    assert all(re.search(match, e["message"]) for e in errors)
    if mode == "raise":  # where it raised: Failing.step's raise, without the loop's and its thread pool's frames
        tb = errors[0]["traceback"]
        assert tb.startswith("Traceback (most recent call last):\n") and tb.count("  File ") == 1
        assert tb.endswith('in step\n    raise KeyError("lookup failed")\nKeyError: \'lookup failed\'\n')
    else:
        assert errors[0]["traceback"] == ""


def test_moe_conversation_rows_carry_the_routing_of_every_fed_token_and_each_tokens_version():
    """Router replay with multi-turn rollouts (issue #42): a tiny Qwen3-MoE on the embedded engine (keeping each
    conversation's KV between turns), generation calls turned into rows the way the trainer's are
    (:func:`megarl.rollout.rows.rollout_batch`, then :func:`megarl.multiturn.rollout.model_turns`). Every row's
    ``routed_experts`` at every token but the last (prompt, model turns, observations) equal the top-k experts
    transformers' router picks in a plain forward over the whole trajectory; the last token and the padding hold
    experts 0..k-1; ``rollout_versions`` is the call's version on the model's tokens, 0 elsewhere."""
    from transformers import AutoModelForCausalLM

    from megarl.multiturn.rollout import model_turns
    from megarl.rollout.embedded import EmbeddedEngine
    from megarl.rollout.rows import rollout_batch

    tok = make_tokenizer(special_tokens=CHATML_SPECIAL_TOKENS, chat_template=CHATML_TOOLS_TEMPLATE,
                         eos_token="<|im_end|>")
    config = tiny_config("qwen3_moe", vocab_size=len(tok), num_layers=2, num_experts=4, top_k=2, max_positions=512)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_(model, seed=5)
    engine = EmbeddedEngine(config, pad_token_id=tok.pad_token_id, max_batch_size=16, prefix_cache_bytes=8 << 20)
    engine.update_weights(model.state_dict().items())
    engine.finish_weight_update()
    reused = []

    def generate(prompts, p):
        out = engine.generate(prompts, p)
        reused.append(int(out.cached_tokens.sum()))
        rows = rollout_batch(prompts, [out], tok.pad_token_id)
        rows.tensors["policy_version"] = torch.full((len(rows),), 6)
        return model_turns(rows)

    config_mt = MultiTurnConfig(max_turns=3, max_total_tokens=200, max_turn_tokens=4)
    result = run_conversations(ROWS, 2, Scripted, ChatRenderer(tok), generate,
                               SamplingParams(temperature=1.0, max_new_tokens=1, seed=5), config_mt,
                               stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")])
    assert reused[0] == 0 and all(r > 0 for r in reused[1:])  # later turns attend to the KV the engine kept
    batch = conversations_batch(result.conversations, tok.pad_token_id)
    routed, k = batch["routed_experts"], config.num_experts_per_tok
    assert routed.dtype == torch.int16 and routed.shape[2:] == (config.num_hidden_layers, k)
    for row, c in enumerate(result.conversations):
        ids, fed = c.trajectory.ids, len(c.trajectory.ids) - 1
        with torch.no_grad():
            logits = model(torch.tensor([ids]), output_router_logits=True).router_logits  # per layer [len, E]
        for layer in range(config.num_hidden_layers):
            expected = logits[layer].topk(k, dim=-1).indices.sort(-1).values[:fed]
            assert torch.equal(routed[row, :fed, layer].long().sort(-1).values, expected), (row, layer)
        assert (routed[row, fed:] == torch.arange(k, dtype=torch.int16)).all()
        mask = batch["response_mask"][row].bool()
        assert (batch["rollout_versions"][row][mask] == 6).all() and (batch["rollout_versions"][row][~mask] == 0).all()
    assert batch["policy_version"].tolist() == [6] * 6 and max(c.turns for c in result.conversations) == 3


def test_partial_rollouts_continue_a_turn_under_new_weights(setup):
    """Issue #42: with ``chunk_tokens`` a model turn is generated two tokens per call; a weight push after the second
    call (here: the next calls go to an engine holding other weights, version 1) lands inside the turns in flight.
    Every model token's rollout log-prob equals a transformers forward over the whole trajectory under the weights
    of the version recorded for it; the rows' ``rollout_versions`` and ``policy_version`` say the same."""
    from transformers import AutoModelForCausalLM

    from megarl.rollout.embedded import EmbeddedEngine

    tok, model, engine = setup
    newer = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    randomize_(newer, seed=4)
    pushed = EmbeddedEngine(model.config, pad_token_id=tok.pad_token_id, max_batch_size=16)
    pushed.update_weights(newer.state_dict().items())
    pushed.finish_weight_update()
    calls = []

    def generate(prompts, p):
        version = int(len(calls) >= 2)
        calls.append(p.max_new_tokens)
        out = (pushed if version else engine).generate(prompts, p)
        return [(ids, lps, version) for ids, lps in zip(out.token_lists(), out.log_prob_lists(), strict=True)]

    config = MultiTurnConfig(max_turns=3, max_total_tokens=200, max_turn_tokens=5)
    result = run_conversations(ROWS, 2, Scripted, ChatRenderer(tok), generate,
                               SamplingParams(temperature=1.0, max_new_tokens=1, seed=5), config,
                               stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")], chunk_tokens=2)
    assert set(calls) <= {1, 2} and len(calls) >= 6  # 5 tokens a turn: calls of 2, 2, 1 (fewer where a turn stopped)
    models, mixed = {0: model, 1: newer}, 0
    for c in result.conversations:
        t = c.trajectory
        ids = torch.tensor([t.ids])
        mask = torch.tensor(t.loss_mask()[1:], dtype=torch.bool)
        versions = torch.tensor(t.rollout_versions()[1:])
        got = torch.tensor(t.rollout_log_probs()[1:], dtype=torch.float64)
        for v, m in models.items():
            with torch.no_grad():
                logp = torch.log_softmax(m(ids).logits[0, :-1].double(), dim=-1)
            sel = mask & (versions == v)
            gap = (got - logp.gather(-1, ids[0, 1:, None])[:, 0])[sel].abs()
            assert gap.numel() == 0 or gap.max() < 1e-5, (v, gap.max())
        model_segments = [s for s in t.segments if s.kind == "model"]
        mixed += any(len(set(s.versions)) > 1 for s in model_segments)
        assert all(len(s.ids) <= 5 for s in model_segments)
    assert mixed  # a push landed inside a turn
    batch = conversations_batch(result.conversations, tok.pad_token_id)
    for i, c in enumerate(result.conversations):
        n = len(c.trajectory.ids)
        assert batch["rollout_versions"][i, :n].tolist() == c.trajectory.rollout_versions()
        assert batch["policy_version"][i] == min(v for s in c.trajectory.segments if s.kind == "model"
                                                 for v in s.versions)


def test_partial_rollouts_keep_the_routing_of_every_fed_token():
    """Issue #42, router replay with partial rollouts in conversations: a tiny Qwen3-MoE policy, model turns of up to
    five tokens generated two per call; every position a call fed (each conversation's tokens but its last) holds
    the top-2 experts transformers' router picks in a plain forward over the whole trajectory (one set of weights:
    the first call to feed a position routes it as any later one would)."""
    from transformers import AutoModelForCausalLM

    from megarl.rollout.embedded import EmbeddedEngine

    tok = make_tokenizer(special_tokens=CHATML_SPECIAL_TOKENS, chat_template=CHATML_TOOLS_TEMPLATE,
                         eos_token="<|im_end|>")
    config = tiny_config("qwen3_moe", vocab_size=len(tok), num_heads=4, num_kv_heads=2, num_experts=4, top_k=2,
                         num_layers=2, max_positions=512)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_(model, seed=3)
    engine = EmbeddedEngine(config, pad_token_id=tok.pad_token_id, max_batch_size=16)
    engine.update_weights(model.state_dict().items())
    engine.finish_weight_update()

    def generate(prompts, p):
        out = engine.generate(prompts, p)
        fed = [len(q) + n - 1 for q, n in zip(prompts, out.response_lengths.tolist(), strict=True)]
        return [(ids, lps, 0, out.routed_experts[i, : fed[i]])
                for i, (ids, lps) in enumerate(zip(out.token_lists(), out.log_prob_lists(), strict=True))]

    result = run_conversations(ROWS, 2, Scripted, ChatRenderer(tok), generate,
                               SamplingParams(temperature=1.0, max_new_tokens=1, seed=5),
                               MultiTurnConfig(max_turns=3, max_total_tokens=200, max_turn_tokens=5),
                               stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")], chunk_tokens=2)
    batch = conversations_batch(result.conversations, tok.pad_token_id)
    for i, c in enumerate(result.conversations):
        ids = c.trajectory.ids
        with torch.no_grad():
            logits = model(torch.tensor([ids]), output_router_logits=True).router_logits  # per layer [len, E]
        for layer in range(2):
            expected = logits[layer].topk(2, dim=-1).indices.sort(-1).values[: len(ids) - 1]
            got = batch["routed_experts"][i, : len(ids) - 1, layer].long().sort(-1).values
            assert torch.equal(got, expected), (i, layer)
