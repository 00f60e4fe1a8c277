"""The vLLM rollout engine, colocated inside a policy worker process (one process per GPU).

Owns a ``vllm.LLM`` built in this process with the ``external_launcher`` executor (vLLM joins the
torch.distributed world the worker already initialised), the weight sync into vLLM's live parameters
(:class:`WeightReceiver`, mixed into vLLM's GPU worker via ``worker_extension_cls``), sleeping and waking
weights and KV cache, and the pure helpers :func:`to_rollout_output` (vLLM outputs -> RolloutOutput) and
:func:`check_places` (does a resharding plan's rollout group equal vLLM's TP group). It does not own the
plan, the transport or the training model. Imports torch and megarl; vLLM only inside the engine, whose
construction sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``RANK`` and ``LOCAL_RANK`` in this process.

Written against vLLM's V1 engine, 0.11 to current main (vllm-project/vllm): vllm/entrypoints/llm.py
(``LLM`` kwargs -> ``EngineArgs``; generate, collective_rpc, sleep, wake_up, reset_prefix_cache);
vllm/v1/executor/uniproc_executor.py (``ExecutorWithExternalLauncher`` reads RANK/LOCAL_RANK; its
collective_rpc calls the one in-process worker, so tensors pass by reference);
vllm/distributed/parallel_state.py (``initialize_model_parallel``: "ExternalDP x DP x PP x TP", TP groups
are consecutive global ranks); vllm/v1/worker/gpu_worker.py and vllm/device_allocator/cumem.py (sleep
tags "weights"/"kv_cache"; ``CuMemAllocator.sleep`` unmaps every allocation); vllm/v1/sample/sampler.py
and ops/topk_topp_sampler.py (logprobs_mode); vllm/sampling_params.py; vllm/v1/core/sched/utils.py
(check_stop); vllm/v1/engine/parallel_sampling.py; vllm/outputs.py; vllm/logprobs.py;
examples/offline_inference/rlhf_utils.py; verl's ``vLLMColocateWorkerExtension``.

Log-probs. Ours (megarl.rollout.base) are of ``softmax(logits / T)`` before top-k/top-p (T = 1 when
greedy). ``logprobs_mode="processed_logprobs"`` gives ``log_softmax`` of the logits vLLM sampled from:
greedy -> raw logits (equal to ours); sampling -> after temperature and after top-k/top-p masking, so
equal to ours when top-k/top-p are off, and otherwise renormalised over the kept tokens (vLLM's value =
ours - log(kept probability mass) >= ours; ``rollout/logprob_abs_diff`` shows the gap). The default
``raw_logprobs`` ignores the temperature. Quantized models are rejected: they would need
``process_weights_after_loading`` after every sync (a no-op on CUDA for unquantized linear layers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import json
import logging
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.errors import ConfigError, LayoutError, MissingDependencyError, UnsupportedModelError
from megarl.resharding.plan import Grouping, ReshardPlan, RolloutPlace, rollout_places
from megarl.resharding.vllm_layout import vllm_params
from megarl.rollout.base import FINISH_LENGTH, FINISH_STOP, RolloutOutput, SamplingParams, WeightUpdateError

logger = logging.getLogger(__name__)

# Level 1 offloads the weights to pinned host memory and drops the KV cache; level 2 drops both.
# Every sync rewrites all weights, so level 2 would save host memory and the H2D copy on wake, but it
# also drops buffers a weight stream does not rebuild (RESHARDING.md pitfall 4: RoPE caches, garbage
# rollouts in NVIDIA-NeMo/RL#2631, OpenRLHF#723), and NeMo-RL and OpenRLHF settled on level 1.
_SLEEP_LEVEL = 1
_VLLM_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH}
_MIN_TEMPERATURE = 1e-2  # vllm/sampling_params.py _MAX_TEMP: vLLM raises 0 < T < 0.01 to 0.01
_REQUIRED_ENGINE_ARGS = ("worker_extension_cls", "enable_sleep_mode", "logprobs_mode")  # logprobs_mode: >= 0.10.2
# Fused vLLM parameters are built from several HF tensors that may arrive in different buckets.
_FUSED_PARTS = (
    (re.compile(r"^(.*\.self_attn\.)(?:q|k|v)(_proj\.(?:weight|bias))$"), ("q", "k", "v")),
    (re.compile(r"^(.*\.mlp\.)(?:gate|up)(_proj\.weight)$"), ("gate", "up")),
)


class WeightPath(enum.Enum):
    LOAD_WEIGHTS = "load_weights"  # full HF tensors through the model's own ``load_weights`` (rollout tp 1)
    COPY = "copy"  # this rank's shards fused by ``vllm_params`` and copied into the live parameters by name


class WeightReceiver:
    """Mixed into vLLM's GPU worker (``worker_extension_cls``); ``self`` is the worker.

    Method names carry a ``megarl_`` prefix: vLLM refuses an extension whose names clash with the worker's.
    """

    def _megarl_model(self) -> torch.nn.Module:
        runner = self.model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model  # unwraps CUDA graphs

    def megarl_manifest(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(p.shape) for name, p in self._megarl_model().named_parameters()}

    def megarl_tp_ranks(self) -> list[int]:
        from vllm.distributed.parallel_state import get_tp_group

        return list(get_tp_group().ranks)

    def megarl_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str] | None:
        return self._megarl_model().load_weights(weights=weights)

    def megarl_copy_params(self, params: dict[str, torch.Tensor]) -> None:
        live = dict(self._megarl_model().named_parameters())  # names and shapes checked by the engine
        with torch.no_grad():
            for name, tensor in params.items():
                live[name].data.copy_(tensor)


class VLLMEngine:
    """A :class:`megarl.rollout.base.RolloutEngine` over vLLM, for a process that already joined its world.

    ``model_dir`` holds the model's ``config.json`` (e.g. a Megatron checkpoint's ``hf/``); the tokenizer is
    never loaded (ids in, ids out) and weights start as vLLM's dummy init until the first sync.
    ``expected_tp_ranks``: the global ranks of this rank's rollout group, verified against vLLM's TP group.
    """

    def __init__(self, model_dir: str | Path, *, tp: int = 1, dtype: torch.dtype | str = torch.bfloat16,
                 gpu_memory_utilization: float = 0.5, seed: int = 0, max_model_len: int | None = None,
                 enforce_eager: bool = False, pad_token_id: int = 0,
                 expected_tp_ranks: Sequence[int] | None = None, weight_path: WeightPath | None = None) -> None:
        cfg = _read_config(Path(model_dir))
        self.vocab_size = int(cfg["vocab_size"])
        self.tp, self.pad_token_id, self._seed = tp, pad_token_id, seed
        self.weight_path = weight_path or (WeightPath.LOAD_WEIGHTS if tp == 1 else WeightPath.COPY)
        if self.weight_path is WeightPath.LOAD_WEIGHTS and tp != 1:
            raise ConfigError(f"WeightPath.LOAD_WEIGHTS takes full tensors (rollout tp 1); found tp={tp}")
        _prepare_process(tp, gpu_memory_utilization)
        vllm = _import_vllm()
        kwargs = dict(model=str(model_dir), tensor_parallel_size=tp, dtype=str(dtype).removeprefix("torch."),
                      seed=seed, gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                      max_model_len=max_model_len, distributed_executor_backend="external_launcher",
                      enable_sleep_mode=True, load_format="dummy", skip_tokenizer_init=True,
                      worker_extension_cls=f"{__name__}.WeightReceiver", logprobs_mode="processed_logprobs",
                      generation_config="vllm")  # ignore generation_config.json: no default top-k/eos from the model
        fields = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
        if "generation_config" not in fields:
            del kwargs["generation_config"]
        self._vllm = vllm
        self._llm = vllm.LLM(**kwargs)
        self._manifest: dict[str, tuple[int, ...]] = self._rpc("megarl_manifest")
        ranks = self._rpc("megarl_tp_ranks")
        if expected_tp_ranks is not None and list(expected_tp_ranks) != ranks:
            raise LayoutError(f"vLLM built the TP group {ranks} for rank {dist.get_rank()}, but the resharding "
                              f"plan streams this rank's rollout shards for the group {list(expected_tp_ranks)}.")
        self._group_leader = ranks[0]
        self._weights_awake = self._kv_awake = True  # a fresh engine holds dummy weights and its KV cache
        self._ready = False  # True after a complete weight sync
        self._loaded: set[str] = set()  # vLLM parameter names loaded since the sync began
        self._pending = FusedParts()
        self._calls = 0
        self._tmp: tempfile.TemporaryDirectory | None = None

    @classmethod
    def from_hf_config(cls, hf_config: dict, **kwargs: Any) -> VLLMEngine:
        """An engine for the model described by ``hf_config`` (written to a private ``config.json``)."""
        tmp = tempfile.TemporaryDirectory(prefix="megarl-vllm-")
        (Path(tmp.name) / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True))
        engine = cls(tmp.name, **kwargs)
        engine._tmp = tmp  # lives as long as the engine
        return engine

    def _rpc(self, method: str, *args: Any) -> Any:
        return self._llm.collective_rpc(method, args=args)[0]  # one in-process worker per engine

    # ---- weights -------------------------------------------------------------------------------

    @property
    def parameter_names(self) -> list[str]:
        """vLLM parameter names a full weight sync must load."""
        return list(self._manifest)

    def update_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors (full with ``LOAD_WEIGHTS``, this rank's rollout shards with ``COPY``).

        Returns the HF names loaded by this call; parts of a fused parameter (q/k/v, gate/up) are held
        until all of them have arrived, and are loaded (and returned) by the call that completes them.
        """
        if not self._weights_awake:
            raise WeightUpdateError("the engine is asleep: call wake_up() before update_weights()")
        self._ready = False
        ready = self._pending.add(tensors)
        if not ready:
            return set()
        if self.weight_path is WeightPath.LOAD_WEIGHTS:
            self._loaded |= self._load_full(ready)
        else:
            self._loaded |= self._copy_shards(ready)
        return {name for name, _ in ready}

    def _load_full(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        try:
            loaded = self._rpc("megarl_load_weights", weights)
        except (KeyError, ValueError, AssertionError) as e:
            raise WeightUpdateError(f"vLLM's load_weights rejected {[n for n, _ in weights][:8]}...: "
                                    f"{type(e).__name__}: {e}") from e
        if loaded is None:
            raise WeightUpdateError("this vLLM model's load_weights does not report the parameters it loaded, so "
                                    "name coverage cannot be checked; use weight_path=WeightPath.COPY")
        return set(loaded)

    def _copy_shards(self, shards: list[tuple[str, torch.Tensor]]) -> set[str]:
        params = vllm_params(dict(shards), vocab_size=self.vocab_size, rollout_tp=self.tp)
        check_manifest(params, self._manifest)
        self._rpc("megarl_copy_params", params)
        return set(params)

    def finish_weight_update(self) -> None:
        """End a sync: every vLLM parameter must have been loaded since it began; then drop the prefix cache."""
        if self._pending.waiting:
            raise WeightUpdateError(f"incomplete weight update: parts of fused parameters arrived without their "
                                    f"siblings: {sorted(self._pending.waiting)[:20]}")
        missing = [name for name in self._manifest if name not in self._loaded]
        if missing:
            shown = ", ".join(missing[:20]) + (f", ... ({len(missing) - 20} more)" if len(missing) > 20 else "")
            raise WeightUpdateError(f"incomplete weight update: {len(missing)} of {len(self._manifest)} vLLM "
                                    f"parameters were not loaded since the sync began: {shown}")
        if self._llm.reset_prefix_cache() is False:  # cached KV blocks were computed with the old weights
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")
        logger.debug("weight sync complete: %d vLLM parameters", len(self._manifest))
        self._loaded = set()
        self._ready = True

    # ---- memory --------------------------------------------------------------------------------

    def sleep(self) -> None:
        """Free the KV cache and move the weights to host memory (level 1, see ``_SLEEP_LEVEL``)."""
        if not self._weights_awake:
            return
        if not self._kv_awake:  # CuMemAllocator.sleep unmaps every allocation: map the KV cache back first
            self._llm.wake_up(tags=["kv_cache"])
        self._llm.sleep(level=_SLEEP_LEVEL)
        self._weights_awake = self._kv_awake = self._ready = False
        self._loaded, self._pending = set(), FusedParts()

    def wake_up(self) -> None:
        """Bring the weights back (not the KV cache: :meth:`generate` wakes it) and begin a weight sync."""
        if not self._weights_awake:
            self._llm.wake_up(tags=["weights"])
            self._weights_awake = True
        self._ready = False
        self._loaded, self._pending = set(), FusedParts()

    # ---- generation ----------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutOutput:
        """Sample ``params.n`` responses per prompt; rows grouped by prompt. Every rank of the TP group must
        call it with the same arguments (external_launcher engines do not exchange requests)."""
        self._check_generate(prompts, params)
        if not prompts:
            return to_rollout_output([], params.n, self.pad_token_id)
        if not self._kv_awake:  # after the weight sync, so the sync never holds KV memory (vllm#15254)
            self._llm.wake_up(tags=["kv_cache"])
            self._kv_awake = True
        inputs = [self._vllm.TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
        per_prompt = [self._sampling_params(params, i) for i in range(len(prompts))]
        with self._generation_rng(params):
            outputs = self._llm.generate(inputs, sampling_params=per_prompt, use_tqdm=False)
        return to_rollout_output(outputs, params.n, self.pad_token_id)

    def _sampling_params(self, params: SamplingParams, prompt: int) -> Any:
        # distinct seeds per prompt (vLLM gives child j of a request seed + j), so prompts never share noise
        seed = None if params.seed is None else params.seed + prompt * params.n
        return self._vllm.SamplingParams(
            n=1 if params.greedy else params.n,  # vLLM refuses n > 1 when greedy; to_rollout_output repeats
            temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,  # -1 is "off" in every V1 release (0 only lately)
            max_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids),
            ignore_eos=True,  # our rows stop at stop_token_ids only; vLLM would also stop at the model's EOS
            seed=seed, logprobs=0,  # 0: only the sampled token's log-prob
            detokenize=False)

    @contextlib.contextmanager
    def _generation_rng(self, params: SamplingParams) -> Iterator[None]:
        """Unseeded sampling draws from the device's default CUDA generator, which must be identical on
        all ranks of the TP group (RESHARDING.md pitfall 10) and is the trainer's: seed it per call from
        (engine seed, group, call count) inside a fork, restoring the training RNG state afterwards."""
        self._calls += 1
        if params.seed is not None:  # vLLM seeds one generator per request
            yield
            return
        seed = ((self._seed * 1_000_003 + self._group_leader) * 1_000_033 + self._calls) % 2**63
        with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
            torch.cuda.manual_seed(seed)
            yield

    def _check_generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> None:
        if not self._ready:
            state = "asleep" if not self._weights_awake else "waiting for a complete weight sync"
            raise WeightUpdateError(f"cannot generate: the engine is {state}; call wake_up() if asleep, then "
                                    "update_weights(...) and finish_weight_update()")
        if 0 < params.temperature < _MIN_TEMPERATURE:
            raise ConfigError(f"vLLM would silently raise temperature {params.temperature} to {_MIN_TEMPERATURE}; "
                              f"use 0 (greedy) or a temperature >= {_MIN_TEMPERATURE}")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ConfigError(f"prompt {i} is empty; every prompt needs at least one token")
            if min(p) < 0 or max(p) >= self.vocab_size:
                raise ConfigError(f"prompt {i} has token ids outside [0, {self.vocab_size}): "
                                  f"min {min(p)}, max {max(p)}")


# ------------------------------------------------------------------------------------------- pure helpers


def check_places(plan: ReshardPlan, world_rank: int) -> None:
    """Raise LayoutError unless ``world_rank``'s rollout group in ``plan`` is the TP group vLLM builds for it:
    global ranks ``[r - r % tp, r - r % tp + tp)`` with rollout TP rank ``r % tp`` (external_launcher)."""
    tp = plan.rollout_tp
    place = plan.places[world_rank]
    group = [r for _, r in sorted((p.tp_rank, r) for r, p in enumerate(plan.places) if p.replica == place.replica)]
    start = world_rank - world_rank % tp
    if group == list(range(start, start + tp)):
        return
    train = plan.train
    works = [g for g in range(1, train.world_size + 1) if train.world_size % g == 0 and _consecutive(
        # the grouping make_plan chooses for rollout tp g
        rollout_places(train, g, Grouping.HYBRID if (train.tp * train.pp) % g == 0 else Grouping.GATHER), g)]
    raise LayoutError(
        f"rollout tp={tp} does not fit vLLM with training layout {plan.train}: the resharding plan puts rank "
        f"{world_rank} in rollout group {group} (TP rank {place.tp_rank}), but vLLM's external_launcher builds "
        f"TP groups from consecutive global ranks, here {list(range(start, start + tp))} (TP rank "
        f"{world_rank % tp}). Rollout tp values whose groups match on this layout: {works} (the training tp "
        f"{train.tp} and 1 always do); the model's heads must also divide by it."
    )


def _consecutive(places: Sequence[RolloutPlace], tp: int) -> bool:
    groups: dict[int, list[tuple[int, int]]] = {}
    for rank, p in enumerate(places):
        groups.setdefault(p.replica, []).append((p.tp_rank, rank))
    for members in groups.values():
        members.sort()
        start = members[0][1]
        if start % tp or members != [(i, start + i) for i in range(tp)]:
            return False
    return True


class FusedParts:
    """Holds the HF parts of fused vLLM parameters (q/k/v -> qkv_proj, gate/up -> gate_up_proj), which may
    arrive in different buckets, until the whole group is there."""

    def __init__(self) -> None:
        self.waiting: dict[str, torch.Tensor] = {}

    def add(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The tensors that can be loaded now: unfused ones, and every group completed by ``tensors``."""
        ready = []
        for name, tensor in tensors:
            group = _fused_group(name)
            if group is None:
                ready.append((name, tensor))
                continue
            self.waiting[name] = tensor
            if all(n in self.waiting for n in group):
                ready.extend((n, self.waiting.pop(n)) for n in group)
        return ready


def check_manifest(params: dict[str, torch.Tensor], manifest: dict[str, tuple[int, ...]]) -> None:
    """Raise WeightUpdateError unless every tensor names a vLLM parameter of this rank with its exact shape."""
    for name, tensor in params.items():
        expected = manifest.get(name)
        if expected is None:
            near = difflib.get_close_matches(name, list(manifest), n=1)
            hint = f"; nearest vLLM parameter: {near[0]!r}" if near else ""
            raise WeightUpdateError(f"no vLLM parameter {name!r} (built from this rank's shards){hint}")
        if tuple(tensor.shape) != tuple(expected):
            raise WeightUpdateError(f"vLLM parameter {name!r} on this rank has shape {tuple(expected)}, the shards "
                                    f"give {tuple(tensor.shape)}: the plan and vLLM disagree on the split")


def to_rollout_output(request_outputs: Sequence[Any], n: int, pad_token_id: int) -> RolloutOutput:
    """:class:`RolloutOutput` from vLLM ``RequestOutput``s (one per prompt, in prompt order).

    Reads ``request.outputs[j].index``, ``.token_ids``, ``.logprobs`` (per position a mapping token id ->
    ``Logprob`` with ``.logprob``; it must hold the sampled token) and ``.finish_reason`` ("stop"/"length").
    A request with a single completion stands for ``n`` identical rows (greedy: vLLM samples it once).
    Stop tokens are part of ``token_ids`` (vLLM appends a token before ``check_stop``), so they stay in the
    response, as the contract wants.
    """
    rows: list[tuple[int, list[int], list[float], str]] = []
    for i, request in enumerate(request_outputs):
        completions = sorted(request.outputs, key=lambda c: c.index)
        if len(completions) == 1 < n:
            completions = completions * n
        if len(completions) != n:
            raise RuntimeError(f"vLLM returned {len(completions)} completions for prompt {i}, expected {n}")
        for c in completions:
            ids = [int(t) for t in c.token_ids]
            rows.append((i, ids, _sampled_log_probs(c, ids, i), _finish_reason(c, i)))
    width = max((len(ids) for _, ids, _, _ in rows), default=0)
    responses = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    log_probs = torch.zeros((len(rows), width), dtype=torch.float32)
    for k, (_, ids, lps, _) in enumerate(rows):
        responses[k, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        log_probs[k, : len(ids)] = torch.tensor(lps, dtype=torch.float32)
    lengths = torch.tensor([len(ids) for _, ids, _, _ in rows], dtype=torch.long)
    return RolloutOutput(
        prompt_index=torch.tensor([i for i, _, _, _ in rows], dtype=torch.long),
        responses=responses,
        response_mask=torch.arange(width)[None, :] < lengths[:, None],
        log_probs=log_probs,
        response_lengths=lengths,
        finish_reasons=[reason for _, _, _, reason in rows],
    )


def _sampled_log_probs(completion: Any, ids: list[int], prompt: int) -> list[float]:
    positions = completion.logprobs
    if positions is None or len(positions) != len(ids):
        found = "none" if positions is None else f"{len(positions)} positions"
        raise RuntimeError(f"vLLM returned {found} of log-probs for a {len(ids)}-token response of prompt {prompt}; "
                           "it must be asked for logprobs=0 (the sampled token's)")
    out = []
    for j, (entry, token) in enumerate(zip(positions, ids, strict=True)):
        if token not in entry:
            raise RuntimeError(f"vLLM's log-probs at position {j} of prompt {prompt} lack the sampled token {token}")
        out.append(float(entry[token].logprob))
    return out


def _finish_reason(completion: Any, prompt: int) -> str:
    reason = _VLLM_FINISH.get(completion.finish_reason)
    if reason is None:
        raise RuntimeError(f"vLLM finished a response of prompt {prompt} with {completion.finish_reason!r}; "
                           f"expected one of {sorted(_VLLM_FINISH)}")
    return reason


def _fused_group(name: str) -> tuple[str, ...] | None:
    for pattern, parts in _FUSED_PARTS:
        m = pattern.match(name)
        if m:
            return tuple(f"{m.group(1)}{part}{m.group(2)}" for part in parts)
    return None


# ------------------------------------------------------------------------------------------ environment


def _read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"vLLM needs the model's config.json in {model_dir} (a Megatron checkpoint's hf/ "
                          "directory has it); none found")
    cfg = json.loads(path.read_text())
    if cfg.get("quantization_config"):
        raise UnsupportedModelError(f"{path} describes a quantized model; the vLLM rollout engine loads "
                                    "unquantized weights only (it never calls process_weights_after_loading)")
    return cfg


def _prepare_process(tp: int, gpu_memory_utilization: float) -> None:
    if not torch.cuda.is_available():
        raise ConfigError("the vLLM rollout engine needs a CUDA device; use rollout.backend=embedded on CPU")
    if not dist.is_initialized():
        raise ConfigError("the vLLM rollout engine joins this process's torch.distributed world "
                          "(external_launcher); initialise it first (megarl.parallel.init.init_distributed)")
    if not isinstance(tp, int) or tp < 1 or dist.get_world_size() % tp:
        raise LayoutError(f"rollout tp={tp} must be a positive divisor of the world size {dist.get_world_size()}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1]; found {gpu_memory_utilization}")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core must run in this process
    os.environ["RANK"] = str(dist.get_rank())  # read by ExecutorWithExternalLauncher._distributed_args
    os.environ["LOCAL_RANK"] = str(torch.cuda.current_device())  # the device vLLM's worker binds to


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as e:
        raise MissingDependencyError("rollout.backend=vllm needs vLLM: `pip install megarl[vllm]` on a CUDA "
                                     f"machine ({e})") from e
    fields = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    missing = [name for name in _REQUIRED_ENGINE_ARGS if name not in fields]
    if missing:
        raise MissingDependencyError(f"vLLM {getattr(vllm, '__version__', '?')} lacks EngineArgs {missing}; "
                                     "megarl needs vLLM >= 0.10.2 (V1 engine with logprobs_mode)")
    return vllm
