"""What a rehearsal (:mod:`megarl.bench.rehearse`) predicts and measures of memory: the planner's terms of each phase
(:func:`memory_terms`, :func:`predicted_phase_bytes`), the probe that measures a phase on each device
(:class:`PhaseMemory` on the host, :class:`CudaPhaseMemory` on a GPU), the checks of one against the other, whether
a world fits this machine, and the bytes the resharding plan moves (docs/rehearsal.md §3, §6).

Pure but for the probes (torch and CUDA imported lazily, in a rank).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from megarl.errors import ConfigError
from megarl.rollout.config import RolloutBackend

if TYPE_CHECKING:
    from megarl.bench.rehearse import Rehearsal

GIB = 2**30


def world_bytes(r: Rehearsal) -> int:
    """The planner's peak of the rehearsal world on this machine: every rank's resident state (parameters,
    gradients) plus its largest phase, and the runtime of each process (torch, megatron-core: ~0.45 GiB)."""
    planned, terms = predicted_phase_bytes(r, 64, 32, len(r.prompts)), memory_terms(r)
    resident = terms.params + terms.grads
    phases = [planned["load"] - resident, planned["sync"] if r.rollout else 0, planned.get("update", 0)]
    return r.world * (resident + max(phases) + RUNTIME_BYTES)


RUNTIME_BYTES = int(0.45 * GIB)  # a rank's resident set after importing torch and megatron-core and joining


def fits(r: Rehearsal) -> bool:
    """Whether the world with its rollout phases fits 90 % of the memory available now (the probe's)."""
    return world_bytes(dataclasses.replace(r, rollout=True)) <= 0.9 * memory_probe(r.device).available_bytes(r.world)



@dataclasses.dataclass(frozen=True)
class MemoryTerms:
    """The planner's terms (bytes, the fullest rank) that the phases' predictions combine; which of them land in
    the measured memory, and when, depends on the device (each probe's ``load_bytes`` and ``sync_bytes``)."""

    params: int
    grads: int  # the gradient buffer (0 without ``update``)
    load_read: int  # megatron-core's reader: the largest tensor (the vocabulary's) in full shape, host memory
    load_merged: int  # the SwiGLU factories' merged linear_fc1 of every layer (and local expert), beside the params
    rollout: int  # the rollout engine's weights
    receive: int  # the sync's transient (embedded engine: one bucket, received in place; vLLM: send + receive)


class PhaseMemory:
    """Peak resident bytes of this process per phase, over the resident bytes when the phase began: the kernel's
    high-water mark (VmHWM) is reset before each phase (``/proc/self/clear_refs``, value 5). glibc's mmap and trim
    thresholds are fixed at 128 KiB first (``mallopt``; by default they grow to 32 MiB), so every larger tensor is
    mapped when allocated and unmapped when freed, and the resident set follows the live tensors rather than what
    the heap kept of earlier phases (benchmarks/packing.py measures the same way)."""

    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
    backend, cuda, measures = "gloo", False, "resident"

    def __init__(self) -> None:
        import ctypes

        self.device = "cpu"  # the rank's compute device (WorkerContext.device)
        self.phases: dict[str, dict[str, int]] = {}
        self.libc = ctypes.CDLL("libc.so.6")
        for param in (self.M_MMAP_THRESHOLD, self.M_TRIM_THRESHOLD):
            if not self.libc.mallopt(param, 128 * 2**10):
                raise RuntimeError(f"glibc refused mallopt({param}, 128 KiB)")

    @staticmethod
    def _status() -> dict[str, int]:
        out = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(value.split()[0]) * 1024
        return out

    def __call__(self, name: str):
        import contextlib
        import gc

        @contextlib.contextmanager
        def phase():
            gc.collect()
            self.libc.malloc_trim(0)
            start = self._status()["VmRSS"]
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            yield
            now = self._status()
            self.phases[name] = {"start": start, "peak": now["VmHWM"] - start, "end": now["VmRSS"] - start}

        return phase()

    @staticmethod
    def load_bytes(t: MemoryTerms) -> int:
        """The parameters plus the largest of what follows them: the reader's copies and the merged fc1 (host
        memory, freed when the load returns), then the gradient buffer (DDP is built after the load). The rollout
        engine's replica, made at construction and freed by its sleep, is never touched: its pages are not
        resident. (An update rehearsal of an untied 2-layer model, world 1: 1.04x; before, the gradient buffer was
        added to the transients, 0.70x.)"""
        return t.params + max(t.load_read, t.load_merged, t.grads)

    @staticmethod
    def sync_bytes(t: MemoryTerms) -> int:
        return t.rollout + t.receive  # on CPU the hybrid engine offloads nothing (rollout.offload_train_state)

    @staticmethod
    def available_bytes(world: int) -> int:
        """What the whole world may use: the host's available memory (/proc/meminfo), shared by its ranks."""
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))

    @staticmethod
    def require(world: int) -> None:
        """Raise where this machine cannot run a world of ``world`` ranks on this device (a CPU always can)."""


class CudaPhaseMemory:
    """Peak bytes the CUDA caching allocator handed out per phase, over those allocated when the phase began
    (``torch.cuda.reset_peak_memory_stats`` before, ``max_memory_allocated`` after, on the rank's current device):
    tensors only, not the allocator's cached blocks nor the CUDA context. Made in a rank after
    :func:`megarl.parallel.init.init_distributed` has chosen the rank's GPU."""

    backend, cuda, measures = "nccl", True, "CUDA allocated"

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.device = f"cuda:{torch.cuda.current_device()}"
        self.phases: dict[str, dict[str, int]] = {}

    def __call__(self, name: str):
        import contextlib
        import gc

        cuda = self.torch.cuda

        @contextlib.contextmanager
        def phase():
            gc.collect()
            cuda.synchronize()
            start = cuda.memory_allocated()
            cuda.reset_peak_memory_stats()
            yield
            cuda.synchronize()
            self.phases[name] = {"start": start, "peak": cuda.max_memory_allocated() - start,
                                 "end": cuda.memory_allocated() - start}

        return phase()

    @staticmethod
    def load_bytes(t: MemoryTerms) -> int:
        """megatron-core loads into the parameters in place (the reader's copies stay on the host), the merged fc1
        are device tensors held until the state is copied in; then the gradient buffer, then the embedded engine
        materialises its replica (``torch.empty`` on a GPU allocates; on the host untouched pages are not resident)
        and frees it when it sleeps."""
        return t.params + max(t.load_merged, t.grads + t.rollout)

    @staticmethod
    def sync_bytes(t: MemoryTerms) -> int:
        """The hybrid engine offloads the gradients before the rollout engine wakes (the parameters after the
        sync), so the phase adds the replica and the transient less the gradient buffer it freed."""
        return t.rollout + t.receive - t.grads

    @staticmethod
    def available_bytes(world: int) -> int:
        """What the whole world may use: each rank has a GPU of its own; the first one's free bytes, ``world`` times."""
        import torch

        return world * torch.cuda.mem_get_info(0)[0]

    @staticmethod
    def require(world: int) -> None:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < world:
            smaller = f", with --world {count}" if count else ""
            raise ConfigError(f"a rehearsal on cuda needs a GPU per rank, {world} for --world {world}; this machine "
                              f"has {count}: run it on a machine with {world}{smaller}, or with --device cpu.")


# the devices a rehearsal runs on: what the reference and the world compute on, and whose memory is measured
MEMORY_PROBES: dict[str, type[PhaseMemory] | type[CudaPhaseMemory]] = {"cpu": PhaseMemory, "cuda": CudaPhaseMemory}


def memory_probe(device: str) -> type[PhaseMemory] | type[CudaPhaseMemory]:
    """The probe class of ``device`` (a key of :data:`MEMORY_PROBES`)."""
    if device not in MEMORY_PROBES:
        raise ConfigError(f"unknown rehearsal device {device!r}; known: {sorted(MEMORY_PROBES)} (cuda: rank r, GPU r)")
    return MEMORY_PROBES[device]


# the measured peak of a phase is within this of the prediction: relative for what the terms leave out (Python
# objects, the resharding plan, small work buffers), absolute because glibc keeps freed chunks below its dynamic
# mmap threshold (up to 32 MiB) resident and reuses them, so a phase whose allocations are tens of MiB is not
# resolved by the resident set (docs/rehearsal.md §3)
TOLERANCE_RELATIVE = 0.05
TOLERANCE_BYTES = 64 * 2**20


def predicted_phase_bytes(r: Rehearsal, packed: int, longest: int, rows: int) -> dict[str, int]:
    """What each phase adds to the fullest rank's measured memory at its peak (resident on CPU, allocated on CUDA),
    from the planner's terms (:func:`memory_terms`) and the CPU terms a GPU plan leaves out (docs/rehearsal.md §3):

    * ``load``: the rank's parameters (and gradient buffer with ``update``) plus the larger of megatron-core's two
      load transients (:func:`load_transient_bytes`; host memory, which a GPU plan leaves out); on CUDA
      :meth:`CudaPhaseMemory.load_bytes`;
    * ``log-probs``: the output layer's logits of the ``packed`` tokens (the probes' sequences), twice
      (sequence-major, then the batch-major copy the log-prob function reads), and the two chunk buffers of
      :mod:`megarl.engine.vocab_parallel`;
    * ``sync``: the rollout engine's weights and the resharding transient (embedded engine: one bucket of slab
      copies, every shard received into the engine's own parameters; vLLM: the planner's send + receive bound); on CUDA
      less the gradient buffer offloaded first (:meth:`CudaPhaseMemory.sync_bytes`);
    * ``generate``: the KV cache of ``rows`` sequences of ``longest`` tokens and one step's logits over the vocabulary;
    * ``update``: the larger of the micro-batch's activations (no optimizer state: SGD) and two copies of the
      largest parameter's gradient (the vocabulary shard's), the update's peak in the rehearsals measured (the
      tied Qwen2.5-0.5B cut to 1 layer and an untied 0.5B-shaped model of 2 layers, world 1, CPU: 1.004x and
      1.009x; the activations of the probes' 56 tokens are gone by then). megarl builds its models without
      megatron-core's fused gradient accumulation, so autograd makes each weight's gradient before the DDP hook
      adds it into the buffer; why two exist at once is not yet traced (docs/rehearsal.md §5).
    """
    from megarl.engine.vocab_parallel import CHUNK_BYTES
    from megarl.parallel.layout import ParallelLayout
    from megarl.planner import memory

    spec, fp32, probe, terms = r.spec, 4, memory_probe(r.device), memory_terms(r)
    layout = ParallelLayout.for_world(r.world, tp=r.tp, pp=r.pp, ep=r.ep)
    local_vocab = spec.padded_vocab_size(r.tp) // r.tp
    rb = memory.itemsize(r.rollout_dtype)
    out = {"load": probe.load_bytes(terms),
           "log-probs": 2 * packed * local_vocab * fp32 + 2 * CHUNK_BYTES,
           "sync": probe.sync_bytes(terms),
           "generate": memory.kv_cache_bytes(spec, r.rollout_tp, rb, rows * longest) + rows * spec.vocab_size * fp32}
    if not r.rollout:
        del out["sync"], out["generate"]
    if r.update:
        activations = memory.activation_bytes(spec, layout, 0, micro_batch_tokens=packed, seq_len=longest,
                                              recompute=memory.Recompute.NONE, act_bytes=fp32, packed=True)
        out["update"] = max(activations, 2 * memory.largest_shard_bytes(spec, layout, fp32))
    return out


def memory_terms(r: Rehearsal) -> MemoryTerms:
    """The planner's terms of the fullest rank of ``r`` (:mod:`megarl.planner.memory`; the checkpoint, its reads and
    the training copy in ``r.train_dtype``, the HF files' dtype)."""
    from megarl.engine.config import Precision
    from megarl.parallel.layout import ParallelLayout
    from megarl.planner import memory

    spec, tb = r.spec, memory.itemsize(r.train_dtype)
    layout = ParallelLayout.for_world(r.world, tp=r.tp, pp=r.pp, ep=r.ep)
    state = memory.training_state_bytes(spec, layout, Precision(r.train_dtype), False, optimizer_states=0)[0]
    rb, bucket = memory.itemsize(r.rollout_dtype), int(r.bucket_mb * 2**20)
    if r.rollout_backend is RolloutBackend.VLLM:
        transient = memory.reshard_transient_bytes(spec, layout, r.rollout_tp, param_dtype_bytes=tb,
                                                   rollout_dtype_bytes=rb, bucket_bytes=bucket)
    else:  # the embedded engine receives into its own parameters: at most one bucket of outgoing slab copies
        transient = bucket
    # the largest tensor in full shape: the vocabulary's, padded for the rank's TP, or one that TP does not split
    full = max(spec.padded_vocab_size(r.tp) * spec.hidden_size,
               memory.largest_shard_bytes(spec, ParallelLayout(), 1))
    if spec.moe is not None:
        merged = spec.num_layers * spec.moe.num_experts // r.ep * 2 * spec.moe.ffn_hidden_size * spec.hidden_size
    else:
        merged = spec.num_layers * 2 * spec.ffn_hidden_size // r.tp * spec.hidden_size
    return MemoryTerms(params=state.params, grads=state.grads if r.update else 0,
                       load_read=full * tb, load_merged=merged * tb,
                       rollout=memory.rollout_weight_bytes(spec, r.rollout_tp, rb), receive=transient)


def load_transient_bytes(r: Rehearsal) -> int:
    """What megatron-core's checkpoint load holds beside the rank's parameters at its peak on CPU, the larger of:
    the reader's copy of the largest tensor in its full shape (the vocabulary's: at TP2 that is twice the rank's
    shard, at TP1 the shard itself), and the SwiGLU factories' merged ``linear_fc1`` of every layer (and every local
    expert), fresh tensors held in the loaded state until it is copied into the parameters. Measured on the 7B,
    30B-A3B and 70B rehearsals at TP2 and the 7B at TP1 (docs/rehearsal.md §3)."""
    t = memory_terms(r)
    return max(t.load_read, t.load_merged)


def memory_checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per phase: the fullest rank's measured peak beside the prediction, their ratio and whether it is within
    the tolerance (``TOLERANCE_RELATIVE`` of the prediction or ``TOLERANCE_BYTES``, the larger)."""
    out = []
    for phase, want in report["memory_planned"].items():
        got = max(m[phase]["peak"] for m in report["memory"])
        out.append({"phase": phase, "measured": got, "predicted": want, "ratio": got / want if want else None,
                    "within": abs(got - want) <= max(TOLERANCE_RELATIVE * want, TOLERANCE_BYTES)})
    return out


def planned_sync_bytes(r: Rehearsal) -> list[dict[str, int]]:
    """Per rank, the bytes one sync receives from other ranks and copies locally, by the resharding plan."""
    from megarl.parallel.layout import ParallelLayout
    from megarl.planner import memory
    from megarl.resharding.plan import Grouping, make_plan

    layout = ParallelLayout.for_world(r.world, tp=r.tp, pp=r.pp, ep=r.ep)
    grouping = Grouping.CONSECUTIVE if r.rollout_backend is RolloutBackend.VLLM else None
    plan = make_plan(r.spec, layout, r.rollout_tp, grouping=grouping)
    size = memory.itemsize(r.rollout_dtype)
    out = [{"received": 0, "kept": 0} for _ in range(r.world)]
    for s in plan.slabs:
        out[s.dst]["kept" if s.src == s.dst else "received"] += plan.slab_bytes(s, size)
    return out
