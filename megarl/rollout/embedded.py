"""The embedded rollout engine: a short decode loop over a transformers causal LM in this process.

Owns an HF ``*ForCausalLM`` built from a config (never from disk: weights arrive only through
:meth:`EmbeddedEngine.update_weights`) and the decode loop: left-padded prefill of each distinct prompt
with ``logits_to_keep=1``, expansion of its KV cache to the prompt's rows, sampling with
:func:`megarl.rollout.base.sample_next` (so log-probs are exact and free), and dropping finished rows
from the batch and the ``DynamicCache`` every step (whose plain layers append in place:
:mod:`megarl.rollout.kv_cache`). At most ``max_batch_size`` rows decode at once; rows
still waiting join a running batch once a quarter of it is free (prefilled, then their cache is
concatenated with the batch's, the shorter one left-padded with masked columns), so a few long samples
do not leave the rest of the work queued behind them. Joining and trimming touch the cache layers'
``keys`` / ``values`` directly and are used only when every layer is a plain ``DynamicLayer``; other
caches (sliding windows) take new rows only when the batch is empty.

With ``prefix_cache_bytes`` (plain caches only), the KV of every finished row -- its prompt and all but its last
sampled token -- is kept between calls (:class:`megarl.rollout.kv_cache.PrefixStore`), and a later prompt that
continues one (a conversation's next turn: the trajectory so far, then the observation) is prefilled from the
kept columns on: only its new tokens are computed (``RolloutOutput.cached_tokens`` counts the others). The kept
KV belongs to the weights that computed it: a weight update, ``wake_up`` or ``sleep`` forgets all of it.

Weights arrive under checkpoint (HF hub) names. Where transformers fuses a Mixture-of-Experts layer's experts
into 3-D parameters (``mlp.experts.gate_up_proj [E, 2I, H]``, gate rows then up rows, and ``mlp.experts.down_proj
[E, H, I]``; Qwen3-MoE in transformers 5), the engine accepts the per-expert names a checkpoint and the weight
sync use (``mlp.experts.{e}.gate_proj.weight`` -> ``gate_up_proj[e, :I]``, ``up_proj`` -> ``gate_up_proj[e, I:]``,
``down_proj`` -> ``down_proj[e]``) and copies each into its view of the fused parameter; those pieces partition
the fused parameter, so a sync is complete when every piece arrived (the fused name itself, whole, counts as all
of its pieces).

Construction places parameters on the meta device (no random init, no memory) and then gives each an
empty storage; buffers such as the rotary ``inv_freq`` are never on meta, so they keep the values the
model computed from its config. ``sleep()`` resizes parameter storages to 0 bytes and ``wake_up()``
re-allocates them (contents undefined until the next full weight sync).

Imports torch and (lazily) transformers; no Ray, no process groups, no vLLM.
"""

from __future__ import annotations

import difflib
import inspect
import itertools
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megarl.errors import ConfigError
from megarl.rollout.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    RolloutOutput,
    SamplingParams,
    WeightUpdateError,
    sample_next,
)
from megarl.rollout.embedded_model import build_model, expert_pieces, moe_routers

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from megarl.rollout.kv_cache import Prefix

logger = logging.getLogger(__name__)


def _left_pad(prompts: Sequence[Sequence[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(input_ids, attention_mask, position_ids) of a left-padded batch; positions count real tokens from 0."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp_(min=0)
    return ids.to(device), mask.to(device), positions.to(device)


def _pad_left(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _plain_dynamic_cache(config) -> bool:
    """Whether the model's DynamicCache has only plain full-attention layers (keys/values [B, H, L, D]), whose
    columns :class:`_Batch` may pad, trim and concatenate; sliding-window and other layers are left alone."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    layers = DynamicCache(config=config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


@dataclass
class _Batch:
    """Rows decoding together. The cache holds every token fed so far: ``mask`` is 1 on a row's own columns
    (``next_pos[i]`` of them, the last column always among them) and 0 on padding -- left padding, and between a
    kept prefix and the rest of its prompt (:meth:`EmbeddedEngine._prefill`)."""

    rows: torch.Tensor  # long [B]: output row of each batch row
    mask: torch.Tensor  # long [B, L]: attention mask over the cache's L columns
    next_pos: torch.Tensor  # long [B]: position of the next token = real tokens in the cache
    logits: torch.Tensor  # [B, V]: logits of the next token
    cache: object  # transformers DynamicCache
    seen: torch.Tensor | None = None  # bool [B, V]: tokens of each row's prompt and response (repetition penalty)

    def select(self, keep: torch.Tensor) -> None:
        self.cache.batch_select_indices(keep)
        self.rows, self.mask, self.next_pos, self.logits = (
            self.rows[keep], self.mask[keep], self.next_pos[keep], self.logits[keep])
        if self.seen is not None:
            self.seen = self.seen[keep]

    def trim_left(self) -> None:
        """Drop leading cache columns that no row attends to (plain DynamicLayer caches only)."""
        lead = int(self.mask.any(0).long().argmax())  # the first column some row attends to
        if lead > 0:
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]
            self.mask = self.mask[:, lead:]

    def merge(self, other: _Batch) -> None:
        """Append ``other``'s rows, left-padding the shorter cache with masked zero columns (DynamicLayer only)."""
        length = max(self.mask.shape[1], other.mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, length, 2), _pad_left(theirs.keys, length, 2)])
            mine.values = torch.cat([_pad_left(mine.values, length, 2), _pad_left(theirs.values, length, 2)])
        self.mask = torch.cat([_pad_left(self.mask, length, 1), _pad_left(other.mask, length, 1)])
        self.rows = torch.cat([self.rows, other.rows])
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        self.logits = torch.cat([self.logits, other.logits])
        if self.seen is not None:
            self.seen = torch.cat([self.seen, other.seen])


@dataclass
class _Results:
    """Every output row's tokens so far, padded to ``max_new_tokens``."""

    tokens: torch.Tensor  # long [rows, max_new]
    log_probs: torch.Tensor  # float32 [rows, max_new]
    lengths: torch.Tensor  # long [rows]
    stopped: torch.Tensor  # bool [rows]
    prompt_lengths: torch.Tensor  # long [rows]
    cached: torch.Tensor  # long [rows]: leading prompt tokens whose KV came from an earlier call
    routing: torch.Tensor | None = None  # int16 [rows, longest prompt + max_new, layers, top_k] (MoE)

    @classmethod
    def empty(cls, prompt_lengths: list[int], max_new: int, pad: int, device: torch.device,
              moe: tuple[int, int] | None) -> _Results:
        rows = len(prompt_lengths)
        routing = None
        if moe is not None:  # (layers, top_k): unfed positions keep experts 0..k-1
            layers, k = moe
            width = max(prompt_lengths, default=0) + max_new
            routing = torch.arange(k, dtype=torch.int16, device=device).expand(rows, width, layers, k).clone()
        return cls(tokens=torch.full((rows, max_new), pad, dtype=torch.long, device=device),
                   log_probs=torch.zeros((rows, max_new), dtype=torch.float32, device=device),
                   lengths=torch.zeros(rows, dtype=torch.long, device=device),
                   stopped=torch.zeros(rows, dtype=torch.bool, device=device),
                   prompt_lengths=torch.tensor(prompt_lengths, dtype=torch.long, device=device),
                   cached=torch.zeros(rows, dtype=torch.long, device=device), routing=routing)

    def output(self, row_prompt: list[int]) -> RolloutOutput:
        width = int(self.lengths.max()) if len(self.lengths) else 0
        return RolloutOutput(
            prompt_index=torch.tensor(row_prompt, dtype=torch.long, device=self.lengths.device),
            responses=self.tokens[:, :width].contiguous(),
            response_mask=torch.arange(width, device=self.lengths.device)[None, :] < self.lengths[:, None],
            log_probs=self.log_probs[:, :width].contiguous(),
            response_lengths=self.lengths,
            finish_reasons=[FINISH_STOP if s else FINISH_LENGTH for s in self.stopped.tolist()],
            cached_tokens=self.cached,
            routed_experts=(None if self.routing is None
                            else self.routing[:, : int((self.prompt_lengths + self.lengths).max())].contiguous()),
        )


class EmbeddedEngine:
    """A :class:`megarl.rollout.base.RolloutEngine` running an HF causal LM in this process.

    ``vocab_limit``: logits at ids >= the limit are -inf before sampling and log-probs (for configs whose
    vocabulary is padded past the tokenizer's, e.g. Qwen2.5). ``max_batch_size`` bounds the rows decoded
    at once (prefill and KV cache memory). ``prefix_cache_bytes``: memory for finished rows' KV kept for prompts
    that continue them (module docstring); 0 keeps nothing.
    """

    def __init__(
        self,
        hf_config: PretrainedConfig,
        *,
        dtype: torch.dtype = torch.float32,
        pad_token_id: int,
        device: str | torch.device = "cpu",
        vocab_limit: int | None = None,
        max_batch_size: int = 64,
        prefix_cache_bytes: int = 0,
    ) -> None:
        vocab = hf_config.get_text_config().vocab_size
        if not 0 <= pad_token_id < vocab:
            raise ConfigError(f"pad_token_id must be a token id in [0, {vocab}); found {pad_token_id}")
        if vocab_limit is not None and not 0 < vocab_limit <= vocab:
            raise ConfigError(f"vocab_limit must be in [1, {vocab}] (the config's vocab_size) or None; "
                              f"found {vocab_limit}")
        if max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be >= 1; found {max_batch_size}")
        if prefix_cache_bytes < 0:
            raise ConfigError(f"prefix_cache_bytes must be >= 0 (0: off); found {prefix_cache_bytes}")
        self.device = torch.device(device)
        self.pad_token_id = pad_token_id
        self.vocab_size = vocab
        self.vocab_limit = vocab_limit
        self.max_batch_size = max_batch_size
        self.model = build_model(hf_config, dtype, self.device)
        self._params = dict(self.model.named_parameters())
        # names that alias a parameter listed under another name (tied lm_head.weight)
        self._aliases = {
            name: canonical
            for name, param in self.model.named_parameters(remove_duplicate=False)
            for canonical, p in self._params.items()
            if p is param and name != canonical
        }
        self._pieces = expert_pieces(self._params)  # per-expert name -> view of a fused expert parameter
        self._pieces_of: dict[str, list[str]] = {}  # fused parameter -> its per-expert names
        for piece, (canonical, _) in self._pieces.items():
            self._pieces_of.setdefault(canonical, []).append(piece)
        # what a full sync must load: every parameter, fused experts as their per-expert pieces
        self._required = [n for n in self._params if n not in self._pieces_of] + list(self._pieces)
        self._loaded: set[str] = set()
        self._awake = True
        self._ready = False  # True after a complete weight sync
        self._mergeable = _plain_dynamic_cache(self.model.config)
        self._prefixes = None  # finished rows' KV for prompts that continue them (plain caches only)
        if prefix_cache_bytes and self._mergeable:
            from megarl.rollout.kv_cache import PrefixStore

            self._prefixes = PrefixStore(prefix_cache_bytes)
        # transformers >= 5.2x names the KV cache argument ``cache`` (``past_key_values`` deprecated); older
        # releases take only ``past_key_values`` and would silently ignore ``cache`` (no context after prefill)
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        self._routers = moe_routers(self.model)  # MoE: each layer's router, whose choices generate() records
        self._routed: list[torch.Tensor] = []  # the last forward's top-k experts per router, [tokens, k] each
        for router in self._routers:
            router.register_forward_hook(self._record_routing)

    def _record_routing(self, module, inputs, output) -> None:
        self._routed.append(output[2])  # transformers' top-k router: (logits, weights, indices [tokens, k])

    def _take_routing(self, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The top-k experts of the forward just run, [*shape, layers, k] (``shape``: its batch x sequence)."""
        if not self._routers:
            return None
        routed, self._routed = self._routed, []
        return torch.stack(routed, dim=1).view(*shape, len(routed), -1).to(torch.int16)

    # ---- weights -------------------------------------------------------------------------------

    @property
    def parameter_names(self) -> list[str]:
        """HF names a full weight sync must load (tied aliases excluded; fused experts by their per-expert
        checkpoint names)."""
        return list(self._required)

    def update_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy full HF-named tensors into the model (cast to its dtype); returns the names loaded.

        A tied alias (``lm_head.weight`` with tied embeddings) is shape-checked and skipped. A per-expert name
        is copied into its view of the fused expert parameter (no copy of the fused tensor is made).
        """
        if not self._awake:
            raise WeightUpdateError("the engine is asleep: call wake_up() before update_weights()")
        self._ready = False
        self._forget_prefixes()
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in tensors:
                target = self._target_for(name, tensor)
                if name in self._aliases:
                    continue
                if tensor.data_ptr() != target.data_ptr():  # else received in place (weight_buffer)
                    target.copy_(tensor)
                loaded.add(name)
        self._loaded |= loaded
        for fused in loaded & self._pieces_of.keys():  # a fused parameter loaded whole: all of its pieces
            self._loaded.update(self._pieces_of[fused])
        return loaded

    def weight_buffer(self, name: str, shape: Sequence[int], dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor | None:
        """The parameter (or expert view) ``name`` is loaded into, for a sync to receive into in place (no staging
        copy: the 70B's vocabulary would take 4.2 GB in float32). None for a tied alias or where shape, dtype,
        device or layout differ (the sync then stages a copy)."""
        if not self._awake or name in self._aliases:
            return None
        target = self._parameter(name)
        if (target is None or tuple(target.shape) != tuple(shape) or target.dtype != dtype
                or target.device != device or not target.is_contiguous()):
            return None
        return target

    def _parameter(self, name: str) -> torch.Tensor | None:
        """The parameter (or view of a fused expert parameter) that ``name`` is loaded into; None if unknown."""
        if name in self._pieces:
            canonical, index = self._pieces[name]
            return self._params[canonical][index]
        return self._params.get(self._aliases.get(name, name))

    def _target_for(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """:meth:`_parameter`, shape-checked against ``tensor``."""
        target = self._parameter(name)
        if target is None:
            near = difflib.get_close_matches(name, self._required, n=1)
            hint = f"; nearest parameter name: {near[0]!r}" if near else ""
            raise WeightUpdateError(f"unknown parameter {name!r} for {type(self.model).__name__}{hint}")
        if tuple(tensor.shape) != tuple(target.shape):
            raise WeightUpdateError(
                f"parameter {name!r}: expected shape {tuple(target.shape)}, found {tuple(tensor.shape)}"
            )
        return target

    def finish_weight_update(self) -> None:
        """End a weight sync; raises :class:`WeightUpdateError` naming every parameter (or expert piece) not
        loaded since it began."""
        missing = [name for name in self._required if name not in self._loaded]
        if missing:
            shown = ", ".join(missing[:20]) + (f", ... ({len(missing) - 20} more)" if len(missing) > 20 else "")
            raise WeightUpdateError(
                f"incomplete weight update: {len(missing)} of {len(self._required)} parameters were not loaded "
                f"since the sync began: {shown}"
            )
        self._loaded = set()
        self._ready = True
        logger.debug("weight sync complete: %d parameters", len(self._required))

    sleep_frees_memory = True

    def close(self) -> None:
        """Nothing outlives the engine object."""

    def sleep(self) -> None:
        """Free every parameter's storage (0 bytes); the KV cache only lives inside :meth:`generate`."""
        if not self._awake:
            return
        for param in self._params.values():
            param.untyped_storage().resize_(0)
        self._forget_prefixes()
        self._awake = False
        self._ready = False
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """Re-allocate (uninitialised) parameter storage and begin a weight sync."""
        if not self._awake:
            for param in self._params.values():
                param.untyped_storage().resize_(param.numel() * param.element_size())
            self._awake = True
        self._loaded = set()
        self._ready = False
        self._forget_prefixes()

    def _forget_prefixes(self) -> None:
        """Drop the kept KV: it belongs to the weights that computed it."""
        if self._prefixes is not None:
            self._prefixes.clear()

    # ---- generation ----------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutOutput:
        """Sample ``params.n`` responses per prompt; rows grouped by prompt (see :class:`RolloutOutput`).

        At most ``max_batch_size`` rows decode at once. Finished rows leave the batch and the KV cache every
        step; waiting rows join it (their prompts prefilled, the caches merged) once a quarter of the batch is
        free -- or only when the batch is empty, for caches other than plain ``DynamicLayer`` ones.
        """
        self._check_generate(prompts)
        generator = torch.Generator(device=self.device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        row_prompt = [i for i in range(len(prompts)) for _ in range(params.n)]
        start = time.perf_counter()
        moe = (len(self._routers), self.model.config.num_experts_per_tok) if self._routers else None
        results = _Results.empty([len(prompts[i]) for i in row_prompt], params.max_new_tokens, self.pad_token_id,
                                 self.device, moe)
        stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=self.device)
        kept = {}  # prompt index -> its longest kept prefix (taken out of the store)
        if self._prefixes is not None:
            kept = {i: p for i, prompt in enumerate(prompts) if (p := self._prefixes.take(prompt)) is not None}
        admit_at_least = max(1, self.max_batch_size // 4)  # amortise a prefill + cache merge over many rows
        batch, next_row, steps = None, 0, 0
        with torch.no_grad():
            while batch is not None or next_row < len(row_prompt):
                free = self.max_batch_size - (0 if batch is None else len(batch.rows))
                waiting = len(row_prompt) - next_row
                if waiting and (batch is None or (self._mergeable and free >= min(waiting, admit_at_least))):
                    rows = range(next_row, next_row + min(free, waiting))
                    joining = self._prefill(prompts, [row_prompt[r] for r in rows], rows, results, kept,
                                            seen=params.repetition_penalty != 1.0)
                    next_row = rows.stop
                    if batch is None:
                        batch = joining
                    else:
                        batch.merge(joining)
                batch = self._step(batch, params, generator, results, stop_ids, prompts, row_prompt)
                steps += 1
        out = results.output(row_prompt)
        logger.debug("generated %d rows, %d tokens, %d decode steps in %.3f s", len(out),
                     int(out.response_lengths.sum()), steps, time.perf_counter() - start)
        return out

    def _check_generate(self, prompts: Sequence[Sequence[int]]) -> None:
        if not self._ready:
            state = "asleep" if not self._awake else "waiting for a complete weight sync"
            raise WeightUpdateError(
                f"cannot generate: the engine is {state}; call wake_up() if asleep, then update_weights(...) "
                f"and finish_weight_update()"
            )
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ConfigError(f"prompt {i} is empty; every prompt needs at least one token")
            if min(p) < 0 or max(p) >= self.vocab_size:
                raise ConfigError(f"prompt {i} has token ids outside [0, {self.vocab_size}): "
                                  f"min {min(p)}, max {max(p)}")

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        self._routed = []
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1, **{self._cache_arg: cache})
        return out.logits[:, -1, :]

    def _new_cache(self):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        if self._mergeable:  # plain full-attention layers: append in place instead of torch.cat
            from megarl.rollout.kv_cache import GrowingLayer

            cache.layers = [GrowingLayer() for _ in cache.layers]
        return cache

    def _prefill(self, prompts: Sequence[Sequence[int]], row_prompts: list[int], rows: range,
                 results: _Results, kept: dict[int, Prefix], *, seen: bool) -> _Batch:
        """A batch for output ``rows`` (prompt ids ``row_prompts``, grouped): each distinct prompt is prefilled
        once -- after its kept prefix, if ``kept`` has one -- then its cache rows are repeated (and, MoE, its
        routing recorded for each of them). ``seen``: also mark each row's prompt tokens (repetition penalty)."""
        distinct, repeats = zip(*((i, len(list(g))) for i, g in itertools.groupby(row_prompts)), strict=True)
        hits = [kept.pop(i, None) for i in distinct]
        starts = [0 if hit is None else len(hit.tokens) for hit in hits]
        ids, mask, positions = _left_pad([prompts[i][s:] for i, s in zip(distinct, starts, strict=True)],
                                         self.pad_token_id, self.device)
        cache = self._new_cache()
        if any(starts):  # [kept prefix (right-aligned) | the rest of the prompt (left-padded)]
            from megarl.rollout.kv_cache import seed_cache

            mask = torch.cat([seed_cache(cache, hits, max(starts)), mask], dim=1)
            positions = positions + torch.tensor(starts, device=self.device)[:, None]
        logits = self._forward(ids, mask, positions, cache)
        routed = self._take_routing(tuple(ids.shape))
        row = rows.start
        for d, (i, count) in enumerate(zip(distinct, repeats, strict=True)):
            results.cached[row: row + count] = starts[d]
            if routed is not None:  # left-padded [distinct, width, layers, k] -> each row's prompt columns
                length, start = len(prompts[i]), starts[d]
                if hits[d] is not None:
                    results.routing[row: row + count, :start] = hits[d].routing
                results.routing[row: row + count, start:length] = routed[d, ids.shape[1] - (length - start):]
            row += count
        expand = torch.repeat_interleave(torch.arange(len(distinct), device=self.device),
                                         torch.tensor(repeats, device=self.device))
        marks = None
        if seen:
            marks = torch.zeros((len(distinct), self.vocab_size), dtype=torch.bool, device=self.device)
            for d, i in enumerate(distinct):
                marks[d, torch.as_tensor(prompts[i], device=self.device)] = True
        if len(expand) != len(distinct):
            cache.batch_select_indices(expand)
            logits, mask = logits[expand], mask[expand]
            marks = None if marks is None else marks[expand]
        row_ids = torch.arange(rows.start, rows.stop, device=self.device)
        return _Batch(rows=row_ids, mask=mask, next_pos=mask.sum(-1), logits=logits, cache=cache, seen=marks)

    def _keep_prefixes(self, batch: _Batch, done: torch.Tensor, prompts: Sequence[Sequence[int]],
                       row_prompt: list[int], results: _Results) -> None:
        """Store the KV of the finished rows (``done``: bool over the batch) for a later call that continues them:
        the columns each attends to, i.e. its prompt and every sampled token but the last (never fed)."""
        from megarl.rollout.kv_cache import Prefix

        for b in done.nonzero().squeeze(1).tolist():
            row = int(batch.rows[b])
            tokens = (*prompts[row_prompt[row]], *results.tokens[row, : int(results.lengths[row]) - 1].tolist())
            routing = None if results.routing is None else results.routing[row, : len(tokens)].clone()
            self._prefixes.put(Prefix.of_row(batch.cache, b, batch.mask[b].nonzero().squeeze(1), tokens, routing))

    def _step(
        self, batch: _Batch, params: SamplingParams, generator: torch.Generator, results: _Results,
        stop_ids: torch.Tensor, prompts: Sequence[Sequence[int]], row_prompt: list[int],
    ) -> _Batch | None:
        """Sample one token per row, record it, drop finished rows, feed the rest; None when all finished."""
        tokens, log_probs = sample_next(batch.logits, params, generator, self.vocab_limit, batch.seen)
        if batch.seen is not None:
            batch.seen[torch.arange(len(tokens), device=self.device), tokens] = True
        column = results.lengths[batch.rows]
        results.tokens[batch.rows, column] = tokens
        results.log_probs[batch.rows, column] = log_probs
        results.lengths[batch.rows] += 1
        hit = torch.isin(tokens, stop_ids)
        results.stopped[batch.rows[hit]] = True
        done = hit | (column + 1 >= params.max_new_tokens)
        if self._prefixes is not None and bool(done.any()):
            self._keep_prefixes(batch, done, prompts, row_prompt, results)
        if bool(done.all()):
            return None
        if bool(done.any()):
            keep = (~done).nonzero().squeeze(1)
            batch.select(keep)
            tokens = tokens[keep]
            if self._mergeable:
                batch.trim_left()
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch.rows), 1))], dim=1)
        batch.logits = self._forward(tokens[:, None], batch.mask, batch.next_pos[:, None], batch.cache)
        routed = self._take_routing((len(tokens),))
        if routed is not None:  # the token just fed: the row's response token number lengths - 1
            rows = batch.rows
            results.routing[rows, results.prompt_lengths[rows] + results.lengths[rows] - 1] = routed
        batch.next_pos = batch.next_pos + 1
        return batch
