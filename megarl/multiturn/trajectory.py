"""Multi-turn trajectories kept as token ids: the model's sampled tokens as sampled, observations rendered by the
chat template.

A conversation's trajectory is one token sequence: the prompt (the chat template's rendering of the row's
messages, with the generation prompt), then alternately a *model segment* (the ids the engine sampled, never
decoded and re-encoded, each with its rollout log-prob and the policy version that sampled it; trained) and an
*observation segment* (tool results, an environment's reply: the ids the chat template puts between the model's
last token and the next generation prompt; masked out of the loss). With a Mixture-of-Experts policy whose rollout
engine records routing, every segment also keeps the experts each of its tokens was routed to when the engine first
fed it (router replay: :meth:`Trajectory.record_routing`).

Observation ids come from the template itself, as a text difference: with ``history`` the messages so far and
the model's turn kept as its decoded text ``t`` (tool calls included, verbatim), the template renders
``history + [assistant: t] + observations`` with the generation prompt; the part that precedes the
observations is ``render(history, generation prompt) + t + end``, ``end`` being the text of the model's last
(stop) token -- exactly what the prompt and the model's tokens spell. Whatever the template renders after it
(the newline after ChatML's ``<|im_end|>``, the tool message, the next ``<|im_start|>assistant\\n``) is
tokenised on its own: it starts right after a special token, so byte-level BPE merges cannot cross the
boundary, and the whole trajectory equals the template's rendering of the conversation token for token
(``tests/unit/test_multiturn_trajectory.py``). A template that re-renders earlier turns differently once
later ones exist (Qwen3's drops the ``<think>`` block of past assistant turns) cannot satisfy that; it is
refused with :class:`TemplateError` rather than trained on a sequence the model never saw.

Pure module: a Hugging Face tokenizer is the only dependency (no torch.distributed, no engine).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from megarl.errors import MegarlError

Message = Mapping[str, Any]


class TemplateError(MegarlError):
    """The chat template cannot render observations after the model's tokens (not prefix-stable)."""


@dataclasses.dataclass
class Segment:
    """A run of trajectory tokens of one kind: ``prompt``, ``model`` (trained; with log-probs and versions) or
    ``observation``.

    ``routing`` (MoE, engines that record it): the experts each of the segment's tokens was routed to when the
    rollout engine first fed it, as chunks ``[tokens, layers, top_k]`` in order; it covers a prefix of the segment
    (a model turn's last token is fed by the next turn's call, or never)."""

    kind: str
    ids: list[int]
    log_probs: list[float] | None = None  # model segments: the rollout engine's log-prob of each id
    messages: int = 0  # observation segments: how many messages they render
    versions: list[int] | None = None  # model segments: the policy version of the weights that sampled each id
    routing: list[Any] = dataclasses.field(default_factory=list)  # MoE: chunks of [tokens, layers, top_k]

    @property
    def routed(self) -> int:
        """How many of the segment's tokens (from its first) have their routing recorded."""
        return sum(chunk.shape[0] for chunk in self.routing)


def model_segment(ids: Sequence[int], log_probs: Sequence[float], version: int | Sequence[int] = 0) -> Segment:
    """A ``model`` segment: the sampled ``ids`` with their rollout log-probs and the policy version of the weights that
    sampled them (one for all, or one per token); the lengths must agree."""
    ids, log_probs = [int(i) for i in ids], [float(lp) for lp in log_probs]
    if len(ids) != len(log_probs):
        raise ValueError(f"a model turn of {len(ids)} tokens came with {len(log_probs)} log-probs")
    versions = [int(version)] * len(ids) if isinstance(version, int) else [int(v) for v in version]
    if len(versions) != len(ids):
        raise ValueError(f"a model turn of {len(ids)} tokens came with {len(versions)} versions")
    return Segment("model", ids, log_probs, versions=versions)


def record_routing(segments: Sequence[Segment], routing: Any) -> None:
    """Keep the routing of the tokens a call fed first: ``routing`` (``[tokens fed, layers, top_k]``, from the first
    token of ``segments``) fills each segment's positions not recorded yet; positions already recorded keep the
    routing of the call that first fed them."""
    start = 0
    for s in segments:
        end = min(start + len(s.ids), routing.shape[0])
        if start + s.routed < end:
            s.routing.append(routing[start + s.routed: end])
        start += len(s.ids)


class ChatRenderer:
    """Renders prompts and observation turns with a tokenizer's chat template, as token ids.

    ``tools``: the tool schemas (JSON-schema dicts) the template announces, passed as ``apply_chat_template``'s
    ``tools``; ``template_kwargs``: any other keyword arguments of the template (e.g. ``enable_thinking``).
    """

    def __init__(self, tokenizer: Any, *, tools: Sequence[Mapping[str, Any]] | None = None,
                 template_kwargs: Mapping[str, Any] | None = None) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise TemplateError(f"tokenizer {type(tokenizer).__name__} has no chat template: multi-turn rollouts "
                                "render every turn with it; use a chat model's tokenizer or set one")
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.kwargs = dict(template_kwargs or {})

    def render(self, messages: Sequence[Message], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt, **self.kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The first prompt: the messages with the generation prompt."""
        return self.encode(self.render(messages, generation_prompt=True))

    def observation_ids(self, history: Sequence[Message], model_text: str, end_text: str,
                        observations: Sequence[Message]) -> list[int]:
        """The ids the template puts after a model turn and before the next generation prompt's end.

        ``history``: the messages before the model's turn; ``model_text``: its decoded content (stop token
        excluded); ``end_text``: the decoded stop token ending it ('' when it ended without one);
        ``observations``: the messages that answer it (tool results, an environment's reply)."""
        covered = self.render(history, generation_prompt=True) + model_text + end_text
        full = self.render([*history, {"role": "assistant", "content": model_text}, *observations],
                           generation_prompt=True)
        if not full.startswith(covered):
            at = next((i for i, (a, b) in enumerate(zip(covered, full, strict=False)) if a != b), len(full))
            raise TemplateError(
                "the chat template renders the conversation differently once a turn is added, so the trajectory "
                f"cannot equal its rendering: after {at} equal characters it has {full[at:at + 40]!r} where the "
                f"prompt and the model's tokens spell {covered[at:at + 40]!r} (templates that rewrite past turns, "
                "e.g. dropping a <think> block, are not supported for multi-turn rollouts)")
        return self.encode(full[len(covered):])


class Trajectory:
    """One conversation's tokens, built turn by turn (see the module docstring).

    ``messages``: the conversation as the chat template sees it (the model's turns as their decoded text);
    ``segments``: the same conversation as token ids.
    """

    def __init__(self, renderer: ChatRenderer, messages: Sequence[Message], *, stop_ids: Sequence[int] = ()) -> None:
        self.renderer = renderer
        self.messages: list[dict[str, Any]] = [dict(m) for m in messages]
        self.stop_ids = frozenset(int(i) for i in stop_ids)  # tokens that end a model turn (eos, <|im_end|>)
        self.segments = [Segment("prompt", renderer.prompt_ids(self.messages))]

    @property
    def ids(self) -> list[int]:
        return [i for s in self.segments for i in s.ids]

    @property
    def prompt_length(self) -> int:
        return len(self.segments[0].ids)

    @property
    def final_text(self) -> str:
        """The model's last turn (its text as it joined :attr:`messages`), '' before the first."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")

    def loss_mask(self) -> list[int]:
        """1 on the model's tokens, 0 on the prompt's and the observations'."""
        return [int(s.kind == "model") for s in self.segments for _ in s.ids]

    def rollout_log_probs(self) -> list[float]:
        """The engine's log-prob of every model token, 0 elsewhere (aligned with :attr:`ids`)."""
        return [lp for s in self.segments for lp in (s.log_probs if s.kind == "model" else [0.0] * len(s.ids))]

    def rollout_versions(self) -> list[int]:
        """The policy version of every model token, 0 elsewhere (aligned with :attr:`ids`)."""
        return [v for s in self.segments for v in (s.versions if s.kind == "model" else [0] * len(s.ids))]

    @property
    def stopped(self) -> bool:
        """Whether the model's last turn ended with a stop token (False: a token budget cut it)."""
        last = next((s.ids for s in reversed(self.segments) if s.kind == "model"), [])
        return bool(last) and last[-1] in self.stop_ids

    def add_model_turn(self, ids: Sequence[int], log_probs: Sequence[float], *, version: int | Sequence[int] = 0,
                       routing: Any = None) -> str:
        """Append the sampled ``ids`` (with their rollout log-probs, sampled by weights of policy ``version``,
        or of each token's version where the turn spans a weight push) as they are; returns the turn's text
        (stop token excluded), which joins :attr:`messages` as the assistant's content. ``routing`` (MoE): the
        call's ``[tokens fed, layers, top_k]`` experts of this conversation's row, from its first token (see
        :meth:`record_routing`)."""
        segment = model_segment(ids, log_probs, version)
        self.segments.append(segment)
        if routing is not None:
            self.record_routing(routing)
        text = self.renderer.decode(self._content_ids(segment.ids))
        self.messages.append({"role": "assistant", "content": text})
        return text

    def record_routing(self, routing: Any) -> None:
        """Keep the routing of the tokens this call fed first: ``routing`` (``[tokens fed, layers, top_k]``, from
        the trajectory's first token) fills each segment's positions not recorded yet; positions already recorded
        keep the routing of the call that first fed them -- the one whose KV every later turn attended to (the
        embedded engine's kept KV, vLLM's prefix cache) and whose version sampled them."""
        record_routing(self.segments, routing)

    def add_observation(self, observations: Sequence[Message]) -> list[int]:
        """Append the template's rendering of ``observations`` after the last model turn (and the next generation
        prompt); returns the ids added."""
        if not self.segments or self.segments[-1].kind != "model":
            raise ValueError("an observation answers a model turn: add the model's turn first")
        last = self.segments[-1].ids
        end = last[-1:] if last and last[-1] in self.stop_ids else []
        ids = self.renderer.observation_ids(self.messages[:-1], self.messages[-1]["content"],
                                            self.renderer.decode(end), observations)
        self.messages.extend(dict(m) for m in observations)
        self.segments.append(Segment("observation", ids, messages=len(observations)))
        return ids

    def drop_observation(self) -> None:
        """Remove the last segment, an observation, and its messages (a conversation that ends after it)."""
        if self.segments[-1].kind != "observation":
            raise ValueError(f"the last segment is a {self.segments[-1].kind} segment, not an observation")
        del self.messages[len(self.messages) - self.segments.pop().messages:]

    def _content_ids(self, ids: list[int]) -> list[int]:
        return ids[:-1] if ids and ids[-1] in self.stop_ids else ids
