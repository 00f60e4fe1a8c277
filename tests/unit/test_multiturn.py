"""Multi-turn trajectories and environments (issue #25), without an engine: a ChatML tokenizer with tools
(megarl.testing.tiny), conversations built turn by turn against the chat template's own rendering of the same
messages, the loss mask and log-probs checked by hand; the model's and the environment's tokens counted apart in
the training rows and the response metrics (by hand); tool calls (well-formed and malformed, each error's kind
and text); environment contract violations; the run's record of environment errors (every text in the file, the
first of each kind in the log); GAE and GRPO on responses with masked observation gaps against float64 by hand.
"""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch

from megarl.multiturn import (
    ChatRenderer,
    EnvError,
    EnvErrorLog,
    EnvironmentFailure,
    Step,
    TemplateError,
    ToolEnvironment,
    Trajectory,
    checked_step,
    parse_tool_calls,
    tool_schema,
)
from megarl.testing.tiny import CHATML_SPECIAL_TOKENS, CHATML_TOOLS_TEMPLATE, make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer(special_tokens=CHATML_SPECIAL_TOKENS, chat_template=CHATML_TOOLS_TEMPLATE,
                          eos_token="<|im_end|>")


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def _encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def _two_turns(tok):
    """User question -> model calls add(2, 3) -> tool answers 5 -> model answers; both model turns end with
    <|im_end|> as a sampling engine would emit it."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    renderer = ChatRenderer(tok, tools=[tool_schema(add)])
    traj = Trajectory(renderer, [{"role": "user", "content": "What is 2+3?"}], stop_ids=[end])
    turn1 = [*_encode(tok, CALL), end]
    traj.add_model_turn(turn1, [-0.5] * len(turn1))
    obs = traj.add_observation([{"role": "tool", "content": "5"}])
    turn2 = [*_encode(tok, "The answer is 5."), end]
    traj.add_model_turn(turn2, [-0.25] * len(turn2))
    return traj, renderer, turn1, obs, turn2


def test_trajectory_equals_the_templates_rendering(tok):
    traj, renderer, turn1, obs, turn2 = _two_turns(tok)
    messages = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": CALL},
                {"role": "tool", "content": "5"}, {"role": "assistant", "content": "The answer is 5."}]
    assert traj.messages == messages
    rendered = renderer.render(messages, generation_prompt=False)
    # the template closes the last turn with "<|im_end|>\n"; the model's tokens end at its <|im_end|>
    assert rendered.endswith("<|im_end|>\n")
    assert traj.ids == _encode(tok, rendered[:-1])
    # the observation, hand-written: the newline after the model's <|im_end|>, the tool turn, the next prompt
    assert tok.decode(obs) == ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
                               "<|im_start|>assistant\n")
    assert traj.ids[traj.prompt_length:] == turn1 + obs + turn2


def test_loss_mask_and_log_probs_cover_exactly_the_models_tokens(tok):
    traj, _, turn1, obs, turn2 = _two_turns(tok)
    p = traj.prompt_length
    assert traj.loss_mask() == [0] * p + [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    assert traj.rollout_log_probs() == [0.0] * p + [-0.5] * len(turn1) + [0.0] * len(obs) + [-0.25] * len(turn2)
    assert [s.kind for s in traj.segments] == ["prompt", "model", "observation", "model"]


def test_model_and_environment_tokens_are_counted_apart(tok):
    """Two conversations: model turns of 3 and 2 tokens around one observation, and a single model turn of 4 tokens.
    ``response/length_*`` counts the model's tokens (5 and 4), ``response/env_tokens_*`` the observation's (its text
    written out by hand below, encoded on its own)."""
    from megarl.multiturn.rollout import Conversation, conversations_batch
    from megarl.trainer.experience import Experience

    end = tok.convert_tokens_to_ids("<|im_end|>")
    a, b, c = _encode(tok, "a")[0], _encode(tok, "b")[0], _encode(tok, "c")[0]
    renderer = ChatRenderer(tok)
    two = Trajectory(renderer, [{"role": "user", "content": "hi"}], stop_ids=[end])
    two.add_model_turn([a, b, end], [-1.0] * 3)
    two.add_observation([{"role": "user", "content": "ok"}])
    two.add_model_turn([c, end], [-1.0] * 2)
    one = Trajectory(renderer, [{"role": "user", "content": "hey"}], stop_ids=[end])
    one.add_model_turn([a, a, b, end], [-1.0] * 4)
    env_tokens = len(_encode(tok, "\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"))
    # the tiny BPE: "\n" <|im_start|> u s er "\n" o k <|im_end|> "\n" <|im_start|> a s s is t a n t "\n"
    assert env_tokens == 20
    convs = [Conversation(0, None, two, finish="done"), Conversation(1, None, one, finish="done")]
    batch = conversations_batch(convs, tok.pad_token_id)
    assert batch["response_lengths"].tolist() == [5, 4]
    assert batch["observation_lengths"].tolist() == [env_tokens, 0]
    assert batch["response_mask"].sum(-1).tolist() == [5.0, 4.0]  # what trains: the same tokens
    batch.meta["metrics"] = {}
    metrics = Experience.rollout_metrics(batch)
    assert metrics["response/length_mean"] == 4.5 and metrics["response/length_max"] == 5.0
    assert metrics["rollout/num_tokens"] == 9.0  # what the engines generated
    assert metrics["response/env_tokens_mean"] == env_tokens / 2 and metrics["response/env_tokens_max"] == env_tokens


def test_sampled_tokens_are_kept_as_sampled(tok):
    """A model turn the tokenizer would encode differently (here: character by character) stays as sampled; its
    text still renders the same, so the observation after it is unchanged."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    renderer = ChatRenderer(tok)
    traj = Trajectory(renderer, [{"role": "user", "content": "hi"}], stop_ids=[end])
    odd = [i for ch in "The answer" for i in _encode(tok, ch)] + [end]
    assert odd[:-1] != _encode(tok, "The answer")  # not the canonical encoding
    traj.add_model_turn(odd, [0.0] * len(odd))
    obs = traj.add_observation([{"role": "user", "content": "and?"}])
    assert traj.segments[1].ids == odd
    assert tok.decode(traj.ids) == renderer.render([{"role": "user", "content": "hi"},
                                                    {"role": "assistant", "content": "The answer"},
                                                    {"role": "user", "content": "and?"}], generation_prompt=True)
    assert tok.decode(obs) == "\n<|im_start|>user\nand?<|im_end|>\n<|im_start|>assistant\n"


def test_a_turn_cut_by_the_token_limit_gets_its_end_from_the_template(tok):
    """Without a stop token the template's own <|im_end|> closes the turn inside the observation."""
    renderer = ChatRenderer(tok)
    traj = Trajectory(renderer, [{"role": "user", "content": "hi"}], stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")])
    traj.add_model_turn(_encode(tok, "The"), [0.0])
    obs = traj.add_observation([{"role": "user", "content": "go on"}])
    assert tok.decode(obs) == "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_rewrites_past_turns_is_refused(tok):
    """Like Qwen3's, this template drops the <think> block of every assistant turn but the last: the trajectory
    could not equal its rendering."""
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
                "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    thinking = make_tokenizer(special_tokens=CHATML_SPECIAL_TOKENS, chat_template=template, eos_token="<|im_end|>")
    end = thinking.convert_tokens_to_ids("<|im_end|>")
    traj = Trajectory(ChatRenderer(thinking), [{"role": "user", "content": "hi"}], stop_ids=[end])
    ids = [*_encode(thinking, "<think>hmm</think>The answer"), end]
    traj.add_model_turn(ids, [0.0] * len(ids))
    with pytest.raises(TemplateError, match=r"renders the conversation differently.*'The answer.*'<think>hmm"):
        traj.add_observation([{"role": "user", "content": "and?"}])


def test_observation_needs_a_model_turn_and_a_template(tok):
    traj = Trajectory(ChatRenderer(tok), [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="add the model's turn first"):
        traj.add_observation([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="2 tokens came with 1 log-probs"):
        traj.add_model_turn([5, 6], [0.0])
    bare = make_tokenizer(chat_template=None)
    with pytest.raises(TemplateError, match="has no chat template"):
        ChatRenderer(bare)


# ------------------------------------------------------------------------------------------------ tools


def test_tool_calls_parse_and_run(tok):
    env = ToolEnvironment({"add": add})
    assert env.reset({"prompt": "What is 2+3?", "answer": 5}) == [{"role": "user", "content": "What is 2+3?"}]
    step = env.step(f"Let me compute. {CALL}")
    assert step == Step([{"role": "tool", "content": "5"}], reward=0.0, done=False, errors=0)
    assert env.step("The answer is 5") == Step([], reward=0.0, done=True)  # the answer: the reward function's
    assert tool_schema(add) == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}}


@pytest.mark.parametrize("call, error, kind", [
    ("<tool_call>{not json}</tool_call>", r"error: the tool call is not valid JSON \(Expecting property name",
     "malformed tool call"),
    ('<tool_call>["add"]</tool_call>', 'error: a tool call must be an object', "malformed tool call"),
    ('<tool_call>{"name": "mul", "arguments": {"a": 1}}</tool_call>', r"error: unknown tool 'mul'; tools: \['add'\]",
     "unknown tool"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', r"error: tool 'add' cannot take the arguments",
     "bad arguments to tool add"),
    ('<tool_call>{"name": "add", "arguments": "1, 2"}</tool_call>', "error: the arguments of tool 'add' are not",
     "malformed tool call"),
    ('<tool_call>{"name": "add", "arguments": {"a": "x", "b": []}}</tool_call>', r"error: tool 'add' raised TypeError",
     "TypeError in tool add"),
])
def test_a_malformed_call_gets_an_error_observation_and_is_counted(call, error, kind):
    env = ToolEnvironment({"add": add})
    env.reset({"prompt": "q"})
    step = env.step(f"{call} and {CALL}")
    assert step.errors == 1 and not step.done and len(step.messages) == 2
    assert any(m["role"] == "tool" and re.match(error, m["content"]) for m in step.messages), step
    assert {"role": "tool", "content": "5"} in step.messages  # the well-formed call still runs
    (detail,) = step.error_details  # what the run's env_errors.jsonl keeps: the kind, the text the model saw
    assert detail.kind == kind and re.match(error, f"error: {detail.message}")
    # a tool that raised: where, in its traceback (this file's add alone, not the environment calling it)
    assert (detail.traceback.count("  File ") == 1 and "in add\n" in detail.traceback and detail.traceback.endswith(
        'TypeError: can only concatenate str (not "list") to str\n')) == (kind[0] == "T")



def test_string_arguments_are_accepted():
    calls, errors = parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>')
    assert errors == [] and calls[0].arguments == {"a": 1, "b": 2}


@pytest.mark.parametrize("step, match", [
    ({"messages": []}, "returned dict"),
    (Step([{"role": "tool"}]), "messages a chat template cannot render"),
    (Step([{"role": "user", "content": "x"}], reward=float("nan")), "the reward nan; expected a finite number"),
    (Step([], done=False), "no messages for a turn that does not end the episode"),
])
def test_environment_contract_violations_are_named(step, match):
    with pytest.raises(EnvironmentFailure, match=match):
        checked_step(step, "env.py:MyEnv.step")
    assert checked_step(Step([], reward=1.0, done=True), "x").reward == 1.0


def test_the_error_log_keeps_every_text_and_logs_the_first_of_each_kind(tmp_path, caplog):
    """Step 1: three failures of one kind (two lines kept: per_kind 2) and a tool error; step 2: the first kind
    again. Four lines in the file; one warning per kind for the whole run, naming the file."""
    log = EnvErrorLog(tmp_path / "env_errors.jsonl")
    log.per_kind = 2

    def error(conversation, kind, message, ended=True, traceback=""):
        return {"conversation": conversation, "row": conversation // 2, "turn": 1, "kind": kind, "ended": ended,
                "message": message, "traceback": traceback}

    step1 = [error(0, "KeyError in Env.step", "Env.step (row 0, turn 1) raised KeyError: 'a'", traceback="tb 0"),
             error(3, "KeyError in Env.step", "Env.step (row 1, turn 1) raised KeyError: 'b'"),
             error(5, "unknown tool", "unknown tool 'mul'; tools: ['add']", ended=False),
             error(6, "KeyError in Env.step", "Env.step (row 3, turn 1) raised KeyError: 'c'")]
    with caplog.at_level(logging.WARNING, logger="megarl.multiturn.errors"):
        log.record(1, step1)
        log.record(2, [error(1, "KeyError in Env.step", "Env.step (row 0, turn 1) raised KeyError: 'd'")])
        log.record(3, [])
    lines = [json.loads(line) for line in (tmp_path / "env_errors.jsonl").read_text().splitlines()]
    assert [(r["step"], r["conversation"], r["kind"], r["kind_count"]) for r in lines] == [
        (1, 0, "KeyError in Env.step", 3), (1, 3, "KeyError in Env.step", 3), (1, 5, "unknown tool", 1),
        (2, 1, "KeyError in Env.step", 1)]
    assert lines[0] == {"step": 1, "phase": "train", **step1[0], "kind_count": 3}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("multi-turn: first KeyError in Env.step (train step 1, conversation 0, row 0, "
                                  "turn 1; 3 of this kind in the step, ended its conversation; every one's text "
                                  f"goes to {tmp_path / 'env_errors.jsonl'}")
    assert warnings[0].endswith("raised KeyError: 'a'\ntb 0")
    assert "first unknown tool" in warnings[1] and "answered to the model" in warnings[1]
    assert EnvError("k", "m").traceback == ""


# ---------------------------------------------------------------------------------------- estimators


def test_gae_skips_observation_gaps():
    """One row: model tokens at 1, 2, 5, 6 (an observation at 3-4), reward 1 on the last; values by hand. With the
    masked positions skipped, GAE over (1, 2, 5, 6) equals GAE over a contiguous 4-token response (float64)."""
    from megarl.algos.advantages import gae

    gamma, lam = 0.9, 0.8
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0]], dtype=torch.float64)
    values = torch.tensor([[0.0, 0.5, 0.4, 9.0, 9.0, 0.3, 0.2, 0.0]], dtype=torch.float64)
    rewards = torch.zeros_like(values)
    rewards[0, 6] = 1.0
    out = gae(rewards, values, mask, gamma, lam)
    v, r = [0.5, 0.4, 0.3, 0.2], [0.0, 0.0, 0.0, 1.0]
    adv, nxt_v, nxt_a = [0.0] * 4, 0.0, 0.0
    for t in reversed(range(4)):
        delta = r[t] + gamma * nxt_v - v[t]
        adv[t] = delta + gamma * lam * nxt_a
        nxt_v, nxt_a = v[t], adv[t]
    expected = torch.zeros_like(values)
    expected[0, [1, 2, 5, 6]] = torch.tensor(adv, dtype=torch.float64)
    assert torch.allclose(out.advantages, expected, rtol=0, atol=1e-12)
    assert torch.equal(out.advantages[0, [0, 3, 4, 7]], torch.zeros(4, dtype=torch.float64))  # gaps carry nothing


def test_grpo_spreads_each_score_over_model_tokens_only():
    from megarl.algos.advantages import grpo

    mask = torch.tensor([[1, 1, 0, 0, 1], [1, 0, 1, 1, 0]], dtype=torch.float64)
    out = grpo(torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0, 0]), mask)
    a = 1 / (2 ** 0.5 / 2 + 1e-6) / 2  # (s - mean) / (std + eps): mean 0.5, unbiased std sqrt(0.5)
    assert torch.allclose(out.advantages, torch.tensor([[a, a, 0, 0, a], [-a, 0, -a, -a, 0]], dtype=torch.float64),
                          rtol=0, atol=1e-12)


def _rows_of(tok, conversations):
    from megarl.multiturn.rollout import Conversation, conversations_batch

    return conversations_batch([Conversation(0, None, t, finish=f) for t, f in conversations], tok.pad_token_id)


def test_rows_carry_each_tokens_version_and_first_fed_routing(tok):
    """Issue #42, one trajectory: a conversation whose turns were sampled at versions 3 and 4 (as a partial rollout
    would be) and whose calls recorded MoE routing. By hand: the prompt has P tokens, turn 1 n1, the observation o,
    turn 2 n2. Call 1 fed P + n1 - 1 tokens (routed to experts (1, 1) in every layer), call 2 fed P + n1 + o + n2 - 1
    (all routed to (2, 2)): the rows keep call 1's routing where it fed first, call 2's from turn 1's last token
    on, and experts 0..k-1 at the last token (never fed) and the padding."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    renderer = ChatRenderer(tok)
    traj = Trajectory(renderer, [{"role": "user", "content": "hi"}], stop_ids=[end])
    p = traj.prompt_length
    turn1, turn2 = [*_encode(tok, "ab"), end], [*_encode(tok, "c"), end]
    n1, n2, layers = len(turn1), len(turn2), 3
    traj.add_model_turn(turn1, [-1.0] * n1, version=3, routing=torch.full((p + n1 - 1, layers, 2), 1))
    o = len(traj.add_observation([{"role": "user", "content": "ok"}]))
    length = p + n1 + o + n2
    traj.add_model_turn(turn2, [-2.0] * n2, version=4, routing=torch.full((length - 1, layers, 2), 2))
    short = Trajectory(renderer, [{"role": "user", "content": "hey"}], stop_ids=[end])  # one turn, 2 tokens shorter
    turn = [*_encode(tok, "a"), end]
    short.add_model_turn(turn, [-1.0] * len(turn), version=5,
                         routing=torch.full((short.prompt_length + 1, layers, 2), 7))
    batch = _rows_of(tok, [(traj, "done"), (short, "done")])
    assert batch["rollout_versions"][0].tolist() == [0] * p + [3] * n1 + [0] * o + [4] * n2
    assert batch["policy_version"].tolist() == [3, 5]  # a row's oldest token
    assert batch["rollout_log_probs"][0].tolist() == [0.0] * p + [-1.0] * n1 + [0.0] * o + [-2.0] * n2
    routed = batch["routed_experts"]
    assert routed.dtype == torch.int16 and tuple(routed.shape) == (2, length, layers, 2)
    unfed = [0, 1]  # experts 0..k-1
    first = [[1, 1]] * (p + n1 - 1) + [[2, 2]] * (o + n2) + [unfed]
    second = [[7, 7]] * (short.prompt_length + 1) + [unfed] * (length - short.prompt_length - 1)
    for row, expected in enumerate((first, second)):
        assert routed[row].tolist() == [[e] * layers for e in expected], row


def test_a_conversations_routing_must_cover_every_fed_token(tok):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    traj = Trajectory(ChatRenderer(tok), [{"role": "user", "content": "hi"}], stop_ids=[end])
    turn = [*_encode(tok, "ab"), end]
    traj.add_model_turn(turn, [-1.0] * len(turn), routing=torch.zeros(traj.prompt_length, 2, 2))  # 2 tokens short
    with pytest.raises(RuntimeError, match=rf"routed experts of {traj.prompt_length} of its {len(traj.ids)} tokens"):
        _rows_of(tok, [(traj, "done")])


def test_truncated_conversations_and_their_overlong_penalty(tok):
    """Which conversations DAPO's overlong filtering masks (``finish_reasons`` "length"): cut by a token budget --
    the total budget ended it, or it ended after a model turn no stop token closed -- and the soft overlong penalty
    of each, from its tokens after the prompt against ``max_total_tokens`` (float64 by hand:
    ``-factor * min(1, max(0, L - (budget - buffer)) / buffer)``)."""
    from types import SimpleNamespace

    from megarl.trainer.experience import _overlong_scores

    end = tok.convert_tokens_to_ids("<|im_end|>")
    renderer = ChatRenderer(tok)
    a = _encode(tok, "a")[0]

    def conversation(turns: list[int], closed: bool) -> Trajectory:
        traj = Trajectory(renderer, [{"role": "user", "content": "hi"}], stop_ids=[end])
        for k, n in enumerate(turns):
            if k:
                traj.add_observation([{"role": "user", "content": "ok"}])
            ids = [a] * n + ([end] if closed or k < len(turns) - 1 else [])
            traj.add_model_turn(ids, [-1.0] * len(ids))
        return traj

    cases = [(conversation([2], True), "done", "stop"), (conversation([2], False), "done", "length"),
             (conversation([1, 3], True), "tokens", "length"), (conversation([1, 1], True), "turns", "stop"),
             (conversation([1, 2], False), "turns", "length"), (conversation([2], False), "env_error", "stop")]
    batch = _rows_of(tok, [(t, f) for t, f, _ in cases])
    assert batch.non_tensors["finish_reasons"] == [reason for _, _, reason in cases]
    after = [len(t.ids) - t.prompt_length for t, _, _ in cases]
    assert after == [3, 2, 2 + 20 + 4, 2 + 20 + 2, 2 + 20 + 2, 2]  # the observation: 20 tokens (see above)
    budget, buffer, factor = 30, 10, 0.5
    cfg = SimpleNamespace(reward=SimpleNamespace(overlong_buffer=buffer, overlong_penalty_factor=factor),
                          rollout=SimpleNamespace(max_new_tokens=4,
                                                  multi_turn=SimpleNamespace(enabled=True, max_total_tokens=budget)))
    expected = [-factor * min(1.0, max(0, n - (budget - buffer)) / buffer) for n in after]
    assert expected[2] == -0.5 * 6 / 10 and expected[0] == 0.0
    assert _overlong_scores(cfg, batch).tolist() == pytest.approx(expected, abs=1e-7)


def test_check_config_takes_every_algorithm_feature_with_multi_turn(tmp_path):
    """Issue #42: DAPO's overlong penalty and filtering, ReMax, router replay and a teacher with multi-turn
    rollouts pass the config check; the overlong ramp must fit the conversation's budget, not max_new_tokens."""
    from pathlib import Path

    from megarl.config.checks import check_config
    from megarl.config.train import load_config
    from megarl.errors import ConfigError

    example = Path(__file__).resolve().parents[2] / "examples" / "multiturn_lookup_tiny" / "config.yaml"
    base = {"algorithm.advantage.estimator": "remax", "algorithm.mask_truncated": "true",
            "reward.overlong_buffer": 6, "rollout.max_new_tokens": 2, "policy.router_replay": "true",
            "model.path": tmp_path, "teacher.model.path": tmp_path, "trainer.output_dir": tmp_path / "run"}
    check_config(load_config(example, [f"{k}={v}" for k, v in base.items()]))  # buffer 6 > max_new_tokens 2: fine
    with pytest.raises(ConfigError, match=r"buffer=9 must lie in \(0, rollout.multi_turn.max_total_tokens=8\]"):
        check_config(load_config(example, [f"{k}={v}" for k, v in (base | {"reward.overlong_buffer": 9}).items()]))
