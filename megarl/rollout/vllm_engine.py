"""The vLLM rollout engine, colocated inside a policy worker process (one process per device).

Owns a ``vllm.LLM`` built in this process with the ``external_launcher`` executor (vLLM joins the
torch.distributed world the worker already initialised; its worker runs in this process, so
``collective_rpc`` passes tensors by reference), the weight sync into it, sleeping and waking, and the
pure helper :class:`LayerGroups`; its outputs become megarl's by :mod:`megarl.rollout.vllm_outputs`. It does not
own the plan, the transport or the training model. Imports torch and megarl; vLLM only inside the engine, whose
construction sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``RANK`` and ``LOCAL_RANK`` in this process.
The same code runs on vLLM's CPU build and on its CUDA wheel.

Weight sync: vLLM's weight-transfer API, checkpoint format, whole layers per call. Three routes were
measured on vLLM 0.32 (CPU build):

* copying this rank's fused shards into the live parameters by name (megarl's earlier route, also what
  vLLM's ``nccl_m2n`` backend does where it can) assumes the kernel format equals the checkpoint
  format. It does not on CPU: ``process_weights_after_loading`` repacks every linear weight into a
  oneDNN handle and leaves the parameter empty; nor for quantized layers on GPU. Dropped.
* ``model_runner.reload_weights(weights)`` (vLLM's layer-wise reload) runs the repack, but each call is
  a whole reload session: a layer whose tensors arrive in two calls is processed half-loaded, and the
  tokens are silently wrong.
* the weight-transfer API (``start_weight_update`` / ``update_weights`` / ``finish_weight_update``, the
  route TRL, verl and NeMo-RL moved to) keeps one layer-wise session open for the whole sync. Chosen,
  with megarl's in-process backend (:mod:`megarl.rollout.vllm_transfer`). :class:`LayerGroups` still
  holds each decoder layer's tensors until the layer is complete, so no layer is ever split across
  ``update_weights`` calls, whatever the bucket cap (vLLM's own grouping unit, ``layerwise_groups``).

Checkpoint format means full-shape HF tensors on every rank of a rollout TP group; vLLM's weight loaders
narrow each to the rank's slice. The resharding plan moves only that slice (``M/TP_g`` per rank, as for a
sharded target): the transport receives it into a full-shape buffer whose other rows are NaN, so a
loader reading outside its slice would poison the logits instead of passing silently. The plan's
rollout groups are ``CONSECUTIVE`` global ranks -- exactly vLLM's TP groups
(vllm/distributed/parallel_state.py builds them as ``reshape(-1, DP, PP, TP)`` of the world it joins and
takes no rank permutation, so HybridFlow's strided groups cannot be vLLM's); a group must lie inside one
data-parallel replica (:func:`megarl.resharding.plan.check_vllm_groups`).

Sleep: on CUDA, level 2 (weights and KV cache dropped; nothing copied to the host): every sync rewrites
all weights, and vLLM 0.32 saves and restores the model's buffers (RoPE caches: the garbage rollouts of
NVIDIA-NeMo/RL#2631, OpenRLHF#723 came from their loss in earlier vLLMs). Level 1 copied every weight to host
memory at each sleep and back at each wake, two copies per step that the sync then overwrote.
:class:`megarl.rollout.vllm_args.SleepCycle` makes the calls. vLLM's CPU platform has no sleep mode: weights
and KV cache stay resident (:attr:`VLLMEngine.sleep_frees_memory` is False, logged once). Adapter-only LoRA sync
(``lora``, :mod:`megarl.rollout.vllm_lora`) sleeps at level 1 instead: its base weights are synced once and must
survive; a sync is then the adapter alone (:meth:`VLLMEngine.load_adapter`).

Log-probs. Ours (megarl.rollout.base) are of ``softmax(logits / T)`` before top-k/top-p (T = 1 when
greedy). ``logprobs_mode="processed_logprobs"`` gives ``log_softmax`` of the logits vLLM sampled from:
greedy -> raw logits (equal to ours); sampling -> after temperature and after top-k/top-p masking, so
equal to ours when top-k/top-p are off, and otherwise renormalised over the kept tokens (vLLM's value =
ours - log(kept probability mass) >= ours; ``rollout/logprob_abs_diff`` shows the gap); likewise min-p, and a
repetition penalty makes them the penalised distribution's. The default ``raw_logprobs`` ignores the temperature.

Every request carries a seed (:func:`megarl.rollout.vllm_args.request_seeds`), an unseeded call's drawn from
(engine seed, group, call count): vLLM's V2 runner (CUDA) would otherwise draw one from NumPy's global RNG, and
its V1 runners (CPU) use the device's default generator; neither is megarl's, and every rank of a TP group must
sample the same tokens. The engine arguments, sleep calls and model directory are decided per platform in
:mod:`megarl.rollout.vllm_args` (tested on CPU for CUDA).
"""

from __future__ import annotations

import dataclasses
import difflib
import gc
import glob
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megarl.engine.config import LoRAConfig
from megarl.errors import ConfigError, LayoutError, MegarlError, MissingDependencyError, UnsupportedModelError
from megarl.models import adapters
from megarl.models.spec import spec_from_hf_config
from megarl.parallel.layout import ParallelLayout
from megarl.resharding.plan import hf_tensors
from megarl.rollout import vllm_args
from megarl.rollout.base import RolloutOutput, SamplingParams, WeightUpdateError
from megarl.rollout.config import RolloutConfig
from megarl.rollout.vllm_args import EngineOptions, Platform, SleepCycle, request_seeds
from megarl.rollout.vllm_lora import AdapterVersions
from megarl.rollout.vllm_outputs import to_rollout_output
from megarl.rollout.vllm_routing import prepare_routing_output, routing_shape

logger = logging.getLogger(__name__)

_MIN_TEMPERATURE = 1e-2  # vllm/sampling_params.py _MAX_TEMP: vLLM raises 0 < T < 0.01 to 0.01
_REQUIRED_ENGINE_ARGS = ("worker_extension_cls", "weight_transfer_config", "logprobs_mode", "kv_cache_memory_bytes")
_SHM_DIR = Path("/dev/shm")


# vLLM's fused-MoE parameters (RoutedExperts under the layer's ``mlp.experts``) and the per-expert HF projections
# each one holds; vLLM's loaders take the per-expert names and narrow them to the rank's slice
_FUSED_MOE = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?:routed_experts\.)?(?P<kind>w13|w2)_weight$")
_FUSED_MOE_PROJ = {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}


class _KnownNoise(logging.Filter):
    """Drops vLLM warnings that are false alarms for megarl's use, at every sync: RoPE's derived cache and a
    tied ``lm_head`` (its weight is ``embed_tokens``', loaded there; see ``reprocess_tied_modules``) reported
    as layers that "failed to load weights" (the engine's own coverage check covers every parameter), and
    the chat-template warm-up of an engine that never has a tokenizer (ids in, ids out)."""

    LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.renderers.base")
    MESSAGES = frozenset({"RotaryEmbedding: Failed to load weights", "ParallelLMHead: Failed to load weights",
                          "Chat template warmup failed"})

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in self.MESSAGES


class WeightReceiver:
    """Mixed into vLLM's worker (``worker_extension_cls``); ``self`` is the worker.

    Method names carry a ``megarl_`` prefix: vLLM refuses an extension whose names clash with the worker's.
    """

    def megarl_parameter_names(self) -> list[str]:
        """The model's parameters by their checkpoint-side names: with LoRA enabled vLLM wraps each adapted linear
        and its weight becomes ``<module>.base_layer.weight``, which loads as ``<module>.weight`` (vLLM's own
        ``reload_weights`` strips the segment likewise)."""
        return [name.replace(".base_layer.", ".") for name, _ in self.model_runner.get_model().named_parameters()]

    def megarl_packed_modules(self) -> dict[str, list[str]]:
        return dict(getattr(self.model_runner.get_model(), "packed_modules_mapping", {}) or {})

    def megarl_tp_ranks(self) -> list[int]:
        from vllm.distributed.parallel_state import get_tp_group

        return list(get_tp_group().ranks)

    def megarl_shm_names(self) -> list[str]:
        """Names of the shared-memory segments vLLM's CPU communicators created for this rank's groups."""
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        names = []
        for group in (get_tp_group(), get_pp_group()):
            name = getattr(getattr(group.device_communicator, "dist_module", None), "group_name", None)
            if name is not None:
                names.append(name)
        return names

    def megarl_clear_kv_cache(self) -> None:
        """Zero every KV cache block (see :meth:`VLLMEngine.generate`)."""
        for cache in self.model_runner.kv_caches:
            cache.zero_()

    def megarl_loaded(self) -> set[str]:
        """vLLM parameter names loaded since the current weight update began."""
        return set(self.weight_transfer_engine.loaded)


class VLLMEngine:
    """A :class:`megarl.rollout.base.RolloutEngine` over vLLM, for a process that already joined its world.

    ``model_dir`` holds the model's ``config.json`` (e.g. a Megatron checkpoint's ``hf/``); the tokenizer is
    never loaded (ids in, ids out) and weights start as vLLM's dummy init until the first sync, which takes
    full-shape HF-named tensors on every rank of a rollout TP group; vLLM's loaders read only the rank's
    slice (the hybrid engine's transport fills only that).
    ``expected_tp_ranks``: the global ranks of this rank's rollout group, verified against vLLM's TP group.
    ``prefix_caching``: vLLM's prefix cache (on: a multi-turn conversation's next turn prefills only its new
    tokens; off only to measure what that saves, benchmarks/multiturn.py).
    ``kv_cache_bytes``: the KV cache size; None lets vLLM size it from ``gpu_memory_utilization`` on a GPU
    and uses :data:`megarl.rollout.vllm_args.DEFAULT_CPU_KV_CACHE_BYTES` on CPU (where that fraction is of the
    host's memory). On a GPU the utilization is capped at what is free when the engine is built
    (:func:`megarl.rollout.vllm_args.cuda_memory_args`).
    ``lora``: adapter-only LoRA sync (:mod:`megarl.rollout.vllm_lora`): vLLM is built with LoRA for this adapter
    shape, a sync is the base weights (:meth:`update_weights`, only while :attr:`holds_base_weights` is False) then
    :meth:`load_adapter`, and every generation runs with the adapter loaded last.
    """

    def __init__(self, model_dir: str | Path, *, tp: int = 1, dtype: torch.dtype | str = torch.bfloat16,
                 gpu_memory_utilization: float = RolloutConfig.COLOCATED_MEMORY_UTILIZATION,
                 kv_cache_bytes: int | None = None, seed: int = 0,
                 max_model_len: int | None = None, enforce_eager: bool = False, pad_token_id: int = 0,
                 expected_tp_ranks: Sequence[int] | None = None, record_routing: bool = False,
                 prefix_caching: bool = True, lora: LoRAConfig | None = None) -> None:
        cfg = _read_config(Path(model_dir))
        self.vocab_size = int(cfg["vocab_size"])
        self.tp, self.pad_token_id, self._seed = tp, pad_token_id, seed
        spec = spec_from_hf_config(cfg)
        self._num_experts = spec.moe.num_experts if spec.moe is not None else 0
        self._routing = routing_shape(spec) if record_routing else None
        self._shapes = {t.name: t.shape for t in hf_tensors(spec, ParallelLayout())}
        if self._routing is not None and not prefix_caching:
            raise ConfigError("recording expert routing needs vLLM's prefix caching (its routed-experts output "
                              "requires it); leave prefix_caching on")
        options = EngineOptions(tp=tp, dtype=str(dtype).removeprefix("torch."),
                                gpu_memory_utilization=gpu_memory_utilization, kv_cache_bytes=kv_cache_bytes,
                                seed=seed, max_model_len=max_model_len, enforce_eager=enforce_eager,
                                prefix_caching=prefix_caching, record_routing=record_routing,
                                lora_rank=None if lora is None else lora.rank,
                                lora_modules=() if lora is None else adapters.hf_modules(lora.targets))
        self._lora = lora
        self._vllm = vllm = _import_vllm()
        _check_head_dim(spec.head_dim)
        self._llm = _build_llm(vllm, self._engine_args(vllm, options, model_dir, cfg))
        _unlink_shm(self._rpc("megarl_shm_names"))
        self._rpc("init_weight_transfer_engine", {})
        self._groups = LayerGroups(self._shapes)
        self._check_names(self._rpc("megarl_parameter_names"), self._rpc("megarl_packed_modules"))
        ranks = self._rpc("megarl_tp_ranks")
        if expected_tp_ranks is not None and list(expected_tp_ranks) != ranks:
            raise LayoutError(f"vLLM built the TP group {ranks} for rank {dist.get_rank()}, but the rollout "
                              f"plan groups this rank with {list(expected_tp_ranks)}.")
        self._group_leader = ranks[0]
        self._memory = SleepCycle(self._llm, self.sleep_frees_memory, options.sleep_level)
        self._adapters = AdapterVersions() if lora is not None else None
        self._updating = False  # inside vLLM's weight-update session
        self._weights_ready = False  # every weight loaded by a complete sync, and resident since
        self._synced = False  # a sync ended since the engine last woke (adapter sync: its adapter loaded too)
        self._kv_stale = False  # the KV cache holds values computed with earlier weights
        self._calls = 0

    def _engine_args(self, vllm: Any, options: EngineOptions, model_dir: str | Path, cfg: dict) -> dict:
        """``vllm.LLM``'s arguments on this machine (:mod:`megarl.rollout.vllm_args`), this process prepared."""
        platform = _platform(vllm)
        if options.record_routing:
            prepare_routing_output(vllm, platform.cuda)  # refuses what cannot return routing
        kwargs = options.args(model_dir, cfg, platform)
        _prepare_process(options.tp)
        for name in _KnownNoise.LOGGERS:
            logging.getLogger(name).addFilter(_KnownNoise())
        from megarl.rollout import vllm_transfer

        vllm_transfer.register()
        self.sleep_frees_memory = platform.sleep_mode
        if not self.sleep_frees_memory:
            logger.warning("vLLM has no sleep mode on this platform (%s): its weights and KV cache stay resident "
                           "while the policy trains", vllm.platforms.current_platform.device_name)
        return dict(kwargs, worker_extension_cls=f"{__name__}.WeightReceiver",
                    weight_transfer_config={"backend": vllm_transfer.BACKEND})

    @classmethod
    def from_hf_config(cls, hf_config: dict, **kwargs: Any) -> VLLMEngine:
        """An engine for the model described by ``hf_config``, whose ``config.json`` is written once per model
        config under vLLM's cache root (:func:`megarl.rollout.vllm_args.model_dir`): vLLM's compile cache is
        keyed by the model's path, so a fresh directory per engine recompiled at every start."""
        _import_vllm()
        import vllm.envs

        return cls(vllm_args.model_dir(hf_config, Path(vllm.envs.VLLM_CACHE_ROOT) / "megarl-models"), **kwargs)

    def _rpc(self, method: str, *args: Any) -> Any:
        return self._llm.collective_rpc(method, args=args)[0]  # one in-process worker per engine

    def _check_names(self, vllm_names: list[str], packed: Mapping[str, list[str]]) -> None:
        """vLLM's parameters, unpacked to HF names, must be exactly the tensors a sync delivers."""
        theirs = set()
        for name in vllm_names:
            experts = _FUSED_MOE.match(name)
            if experts:  # one fused-MoE parameter holds every expert's gate+up (w13) or down (w2) projection
                theirs |= {f"{experts['prefix']}.{e}.{proj}.weight" for e in range(self._num_experts)
                           for proj in _FUSED_MOE_PROJ[experts['kind']]}
                continue
            module, _, leaf = name.rpartition(".")
            prefix, _, last = module.rpartition(".")
            parts = packed.get(last)
            theirs |= {f"{prefix}.{p}.{leaf}" for p in parts} if parts else {name}
        ours = set(self._shapes)
        if theirs != ours:
            raise UnsupportedModelError(
                f"vLLM's model has parameters megarl's mapping does not deliver ({sorted(theirs - ours)[:5]}) or "
                f"lacks ones it does ({sorted(ours - theirs)[:5]}); this architecture is not supported on vLLM")

    # ---- weights -------------------------------------------------------------------------------

    @property
    def parameter_names(self) -> list[str]:
        """HF tensor names a full weight sync must deliver."""
        return list(self._shapes)

    def weight_buffer(self, name: str, shape: Sequence[int], dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor | None:
        """None: vLLM's loaders take checkpoint-format tensors and place (fuse, shard) them themselves."""
        return None

    def update_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load full HF-named tensors. Tensors are held until their decoder layer is complete, then the
        whole layer goes to vLLM in one call; returns the HF names loaded by this call."""
        if not self._memory.weights_awake:
            raise WeightUpdateError("the engine is asleep: call wake_up() before update_weights()")
        self._weights_ready = self._synced = False
        ready = self._groups.add(tensors)
        if not ready:
            return set()
        if not self._updating:
            self._rpc("start_weight_update")
            self._updating = True
        try:
            self._rpc("update_weights", {"weights": ready})
        except (KeyError, ValueError, AssertionError, RuntimeError) as e:
            self._end_update()
            raise WeightUpdateError(f"vLLM could not load {[n for n, _ in ready][:8]}...: "
                                    f"{type(e).__name__}: {e}") from e
        return {name for name, _ in ready}

    def finish_weight_update(self) -> None:
        """End a sync: every tensor must have arrived and every vLLM parameter been loaded since it began;
        then vLLM finishes its layer-wise processing and the prefix cache is dropped."""
        waiting, missing = self._groups.waiting, self._groups.missing()
        loaded = self._rpc("megarl_loaded") if self._updating else set()
        self._end_update()  # ends vLLM's session in every case: layers that got nothing keep their weights
        if waiting or missing:
            shown = ", ".join(missing[:20]) + (f", ... ({len(missing) - 20} more)" if len(missing) > 20 else "")
            raise WeightUpdateError(f"incomplete weight update: {len(missing)} of {len(self._shapes)} tensors were "
                                    f"not loaded since the sync began: {shown}")
        unloaded = sorted(set(self._rpc("megarl_parameter_names")) - loaded)
        if unloaded:
            raise WeightUpdateError(f"vLLM loaded every tensor but not the parameters {unloaded[:20]}")
        if self._llm.reset_prefix_cache() is False:  # cached KV blocks were computed with the old weights
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")
        logger.debug("weight sync complete: %d tensors", len(self._shapes))
        self._weights_ready = self._kv_stale = True
        self._synced = self._adapters is None  # adapter sync: ends with its adapter (load_adapter)

    @property
    def holds_base_weights(self) -> bool:
        """Adapter sync: whether the engine holds the base weights of a complete sync (they survive its sleep), so
        a sync may send the adapter alone."""
        return self._weights_ready

    def load_adapter(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """End an adapter-only sync: load the policy's adapter of ``version`` (peft-format tensors, every factor of
        :func:`megarl.models.adapters.peft_adapter`) as a vLLM LoRA adapter of its own, over the base weights the
        engine holds. Every rank of a TP group loads the same (vLLM slices it)."""
        if self._adapters is None:
            raise WeightUpdateError("load_adapter needs an engine built for adapter sync (lora=...); this one takes "
                                    "merged weights through update_weights()")
        if not self._memory.weights_awake:
            raise WeightUpdateError("the engine is asleep: call wake_up() before load_adapter()")
        if not self._weights_ready:
            raise WeightUpdateError("load_adapter before the base weights: a first sync (or one after the engine "
                                    "lost its weights) sends every base weight through update_weights() and "
                                    "finish_weight_update() first")
        engine = self._llm.llm_engine
        config = adapters.peft_config(self._lora.rank, self._lora.alpha, 0.0, self._lora.targets)
        self._adapters.load(tensors, config, version, engine.add_lora, engine.list_loras)
        if self._llm.reset_prefix_cache() is False:  # a new name keys new blocks; none of the old are valid either
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")
        self._synced = self._kv_stale = True

    def _end_update(self) -> None:
        self._groups = LayerGroups(self._shapes)
        if self._updating:
            self._updating = False
            self._rpc("finish_weight_update")

    def close(self) -> None:
        """Tear vLLM down: the engine, then its process groups (vLLM keeps them in module globals), whose
        shared-memory message queues vLLM unlinks only on this teardown. A worker killed without it leaves
        ~25 MB per TP group in /dev/shm. vLLM's teardown destroys the torch.distributed world too (the worker's):
        close an engine when its worker is done with the world, at shutdown."""
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        self._llm = None
        if self._adapters is not None:
            self._adapters.close()
        destroy_model_parallel()
        destroy_distributed_environment()
        gc.collect()

    # ---- memory --------------------------------------------------------------------------------

    def sleep(self) -> None:
        """Free the weights and the KV cache where vLLM can sleep (level 2: the next sync rewrites every weight;
        adapter sync: level 1, the base weights kept in host memory); elsewhere only the engine's state changes
        (generation needs a new sync)."""
        if not self._memory.weights_awake:
            return
        self._end_update()
        self._memory.sleep()
        self._synced = False
        self._weights_ready = self._weights_ready and self._memory.keeps_weights

    def wake_up(self) -> None:
        """Map the weights' memory back (not the KV cache: :meth:`generate` wakes it) and begin a weight sync."""
        self._memory.wake_weights()
        self._synced = False
        self._end_update()

    # ---- generation ----------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutOutput:
        """Sample ``params.n`` responses per prompt; rows grouped by prompt. Every rank of the TP group must
        call it with the same arguments (external_launcher engines do not exchange requests)."""
        self._check_generate(prompts, params)
        if not prompts:
            return to_rollout_output([], params.n, self.pad_token_id, routing=self._routing)
        self._memory.wake_kv()  # after the weight sync, so the sync never holds KV memory
        if self._kv_stale:
            # vLLM's CPU attention reads every slot of a block and masks the unused ones by weight 0, and
            # 0 * NaN is NaN: non-finite keys/values an earlier model wrote (a diverged policy, a bad sync) would
            # poison rows long after a good sync (measured: all-zero greedy rows in ~1 of 12 tries). The prefix
            # cache was dropped with the sync, so nothing in the cache is valid any more: zero it (0.14 s per GB
            # on this CPU, milliseconds on a GPU).
            self._rpc("megarl_clear_kv_cache")
            self._kv_stale = False
        inputs = [self._vllm.TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
        self._calls += 1
        seeds = request_seeds(len(prompts), params.n, params.seed, engine_seed=self._seed, group=self._group_leader,
                              call=self._calls)
        per_prompt = [sampling_params(self._vllm, params, seed) for seed in seeds]
        adapter = {} if self._adapters is None else {"lora_request": self._adapters.current}
        outputs = self._llm.generate(inputs, sampling_params=per_prompt, use_tqdm=False, **adapter)
        if self._adapters is not None:
            self._adapters.check_outputs(outputs)
        return to_rollout_output(outputs, params.n, self.pad_token_id, routing=self._routing)

    def _check_generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> None:
        if not (self._synced and self._weights_ready):
            state = "asleep" if not self._memory.weights_awake else "waiting for a complete weight sync"
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


def sampling_params(vllm: Any, params: SamplingParams, seed: int) -> Any:
    """vLLM's ``SamplingParams`` of one prompt's request (``seed``: :func:`megarl.rollout.vllm_args.request_seeds`)."""
    return vllm.SamplingParams(
        n=1 if params.greedy else params.n,  # vLLM refuses n > 1 when greedy; to_rollout_output repeats
        temperature=params.temperature, top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1,  # -1 is "off" in every V1 release (0 only lately)
        min_p=params.min_p, repetition_penalty=params.repetition_penalty,
        max_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids),
        ignore_eos=True,  # our rows stop at stop_token_ids only; vLLM would also stop at the model's EOS
        seed=seed, logprobs=0,  # 0: only the sampled token's log-prob
        detokenize=False)


def layer_key(name: str) -> str:
    """The unit vLLM processes together: the decoder layer (outermost numbered segment, so a MoE layer's
    experts stay with their layer), else the module (``model.embed_tokens``, ``model.norm``, ``lm_head``)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name.rpartition(".")[0]


class LayerGroups:
    """Holds HF tensors until every tensor of their layer (:func:`layer_key`) has arrived, checking each
    name and shape against ``shapes`` (the tensors one sync delivers) on arrival."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.shapes = dict(shapes)
        self._members: dict[str, set[str]] = {}
        for name in shapes:
            self._members.setdefault(layer_key(name), set()).add(name)
        self._waiting: dict[str, dict[str, torch.Tensor]] = {}
        self._done: set[str] = set()

    def add(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The tensors of every layer completed by ``tensors``, layer by layer."""
        ready = []
        for name, tensor in tensors:
            self._check(name, tensor)
            key = layer_key(name)
            waiting = self._waiting.setdefault(key, {})
            waiting[name] = tensor
            if len(waiting) == len(self._members[key]):
                ready.extend(self._waiting.pop(key).items())
                self._done |= self._members[key]
        return ready

    def _check(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.shapes.get(name)
        if expected is None:
            near = difflib.get_close_matches(name, list(self.shapes), n=1)
            hint = f"; nearest: {near[0]!r}" if near else ""
            raise WeightUpdateError(f"no tensor {name!r} in this model's weight sync{hint}")
        if tuple(tensor.shape) != tuple(expected):
            raise WeightUpdateError(f"tensor {name!r} must have the full HF shape {tuple(expected)}; "
                                    f"found {tuple(tensor.shape)}")
        if name in self._done or name in self._waiting.get(layer_key(name), {}):
            raise WeightUpdateError(f"tensor {name!r} arrived twice in one weight sync")

    @property
    def waiting(self) -> list[str]:
        """Names held for a layer that is not complete yet."""
        return sorted(n for group in self._waiting.values() for n in group)

    def missing(self) -> list[str]:
        """Names not loaded yet (held ones included), in sync order."""
        return [n for n in self.shapes if n not in self._done]


def _read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"vLLM needs the model's config.json in {model_dir} (a Megatron checkpoint's hf/ "
                          "directory has it); none found")
    cfg = json.loads(path.read_text())
    if cfg.get("quantization_config"):
        raise UnsupportedModelError(f"{path} describes a quantized checkpoint; megarl streams the policy's "
                                    "unquantized training weights into vLLM, so the rollout model must be unquantized")
    return cfg


def _platform(vllm: Any) -> Platform:
    """This machine for :mod:`megarl.rollout.vllm_args`; on CUDA with the device memory free now, measured as vLLM
    measures it (after emptying the caching allocator, whose cached blocks count as used)."""
    sleep_mode = vllm.platforms.current_platform.is_sleep_mode_available()
    if not torch.cuda.is_available():
        return Platform(cuda=False, sleep_mode=sleep_mode)
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return Platform(cuda=True, sleep_mode=sleep_mode, free_bytes=free, total_bytes=total)


def _prepare_process(tp: int) -> None:
    if not dist.is_initialized():
        raise ConfigError("the vLLM rollout engine joins this process's torch.distributed world "
                          "(external_launcher); initialise it first (megarl.parallel.init.init_distributed)")
    if not isinstance(tp, int) or tp < 1 or dist.get_world_size() % tp:
        raise LayoutError(f"rollout tp={tp} must be a positive divisor of the world size {dist.get_world_size()}")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core must run in this process
    os.environ["RANK"] = str(dist.get_rank())  # read by ExecutorWithExternalLauncher._distributed_args
    # the device vLLM's worker binds to; vLLM's CPU worker uses it for nothing but its name
    os.environ["LOCAL_RANK"] = str(torch.cuda.current_device() if torch.cuda.is_available() else dist.get_rank())


def _build_llm(vllm: Any, kwargs: dict) -> Any:
    try:
        return vllm.LLM(**kwargs)
    except RuntimeError as e:
        if "create shm in SHMManager failed" not in str(e):
            raise
        stale = sorted(str(p) for p in _SHM_DIR.glob("*-cpushm_*"))
        raise MegarlError(f"vLLM could not create its CPU communicator's shared memory ({e}): a vLLM engine on this "
                          f"machine was killed while starting, or another job starts one now. Segments present: "
                          f"{stale[:8]}; if no other vLLM job runs here, remove them and start again.") from e


def _unlink_shm(names: Sequence[str]) -> None:
    """Remove the names of vLLM's CPU shared-memory segments once every rank has mapped them (the mappings
    live on). vLLM names them after the ranks alone, never unlinks them, and fails on an existing name, so
    without this every run on a machine would break the next one (and a killed run every later one)."""
    if not names:
        return
    dist.barrier()  # every rank of every group has joined its segments
    for name in names:
        for path in _SHM_DIR.glob(f"{glob.escape(name.lstrip('/'))}_*"):  # names hold "[0-1]"
            path.unlink(missing_ok=True)


def _check_head_dim(head_dim: int) -> None:
    if torch.cuda.is_available():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in supported:
        raise UnsupportedModelError(f"vLLM's CPU attention supports head_dim {supported}; this model has {head_dim}. "
                                    "Use rollout.engine.backend=embedded for it on CPU.")


def _import_vllm() -> Any:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # read at import: INFO lines would flood workers' logs
    try:
        import vllm
        from vllm.distributed.weight_transfer.base import WeightTransferEngine
    except ImportError as e:
        raise MissingDependencyError("rollout.engine.backend=vllm needs vLLM: `pip install megarl[vllm]` on a CUDA "
                                     f"machine, `make install` (vLLM's CPU build) on CPU ({e})") from e
    fields = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    missing = [name for name in _REQUIRED_ENGINE_ARGS if name not in fields]
    if missing or not hasattr(WeightTransferEngine, "start_weight_update"):
        raise MissingDependencyError(f"vLLM {getattr(vllm, '__version__', '?')} lacks the weight-transfer interface "
                                     f"megarl implements (EngineArgs missing: {missing}); megarl needs vLLM 0.32")
    return vllm
