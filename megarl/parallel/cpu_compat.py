"""Run megatron-core on machines without CUDA: the one place that redirects its CUDA-only calls.

megatron-core's pipeline schedules, p2p communication, RoPE and tensor-parallel buffers allocate
on ``"cuda"`` / ``torch.cuda.current_device()`` and call ``torch.cuda.synchronize()`` /
``current_stream()`` even when the model lives on CPU. On a machine without CUDA,
:func:`enable` (idempotent) installs, for this process:

* a ``TorchFunctionMode`` that rewrites any ``device=`` argument naming CUDA to CPU, makes
  ``Tensor.cuda()`` / ``Tensor.to("cuda")`` return CPU tensors, and reports CPU tensors'
  ``Tensor.type()`` as their ``torch.cuda.*`` names (the optimizer asserts on those strings);
* CPU-safe replacements for the few ``torch.cuda`` functions megatron-core calls on its CPU path
  (``current_device``, ``synchronize``, ``current_stream``, ``get_rng_state`` ...);
* local copies for all-gathers over one-rank groups, and no call at all for all-reduces and object
  broadcasts over them (see :func:`_collectives_locally_on_one_rank`).

It does nothing when CUDA is available, so GPU runs are never affected. A process enables it when
it joins a torch.distributed world to run megatron-core (:func:`megarl.parallel.init.init_distributed`:
workers, the local launcher's driver, conversion), never on import: the driver of a Ray run imports
the role classes (and so megatron-core) but never runs megatron-core, and its own tensor math must
not run under the redirection. Every patched call is looked up at call time, so enabling after
megatron-core is imported works. Must not import megatron-core.

The mode stays entered for the process (model construction, conversion, anything that calls megatron-core),
but only megatron-core needs it, and each torch op through it costs ~3 us: a role's methods run
:func:`suspended` (:func:`megarl.controller.role.call_role`; the local launcher's driver its steps too) and
the engine re-enters it, :func:`redirected`, around what calls megatron-core (its pipeline schedule,
optimizer step, checkpoints); inside those, the transformer layers, the loss functions and the backward run
suspended again (:func:`run_unredirected`, :func:`unredirected`, :func:`unredirect_backward`). Of ~1,700
torch calls per step of a small run, ~20 need the mode.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_mode: _CudaToCpuMode | None = None


def _is_cuda(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # megatron passes torch.cuda.current_device() (an int) as a device
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Maps every CUDA device argument to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron's optimizer and grad clipping assert `.type() == "torch.cuda.FloatTensor"`
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if func is torch.Tensor.to:
            args = tuple("cpu" if i > 0 and _is_cuda(a) else a for i, a in enumerate(args))
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for a CUDA stream on CPU: CPU ops are synchronous, so waits are no-ops."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return _NULL_EVENT

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


class _NullEvent:
    """Stands in for a CUDA event: everything it would wait for has already happened on CPU."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def record(self, stream=None) -> None:
        pass


_NULL_STREAM = _NullStream()
_NULL_EVENT = _NullEvent()


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.synchronize = lambda device=None: None
    cuda.current_stream = lambda device=None: _NULL_STREAM
    cuda.default_stream = lambda device=None: _NULL_STREAM
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.Stream = _NullStream  # megatron-core's MoE dispatcher makes a side stream
    cuda.empty_cache = lambda: None
    # RNG: megatron's tracker snapshots "CUDA" RNG states; on CPU the CPU generator plays that role
    # (callers seed it identically on every rank, see parallel.init.seed_everything).
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": None
    cuda.manual_seed = lambda seed: None
    cuda.manual_seed_all = lambda seed: None


_MCORE_GATHER_ALIASES = ("megatron.core.distributed.param_and_grad_buffer", "megatron.core.tensor_parallel.mappings",
                         "megatron.core.transformer.multi_token_prediction")


def _collectives_locally_on_one_rank() -> None:
    """All-gathers over a group of one rank become local copies, all-reduces and object broadcasts over one
    no-ops (synchronous calls; async ones are left alone).

    An all-reduce over one rank is its input, yet gloo takes ~0.2 ms for it: a single-process run's update
    makes four (metric sums, the loss normalizer, the finite-gradient check).

    gloo runs a gather's copy on its own worker thread. Once a copy is large enough for OpenMP, that
    thread starts its own OpenMP team; libgomp then manages more threads than there are cores and, for
    the rest of the process, stops spinning at its barriers: every multi-threaded op sleeps and is woken
    through a futex instead (measured on 2 cores: 1.6 instead of 2 busy cores, 15-25% slower forwards,
    updates and decoding). A single-process run gathers over one-rank groups after every optimizer step
    (megatron-core's distributed optimizer), every rollout and every checkpoint save.
    """
    import copy

    import torch.distributed as dist

    def single(group, async_op: bool) -> bool:
        return not async_op and dist.get_world_size(group) == 1

    gather, gather_into, gather_object = dist.all_gather, dist.all_gather_into_tensor, dist.all_gather_object
    gather_to_dst = dist.gather_object
    reduce, broadcast_objects = dist.all_reduce, dist.broadcast_object_list

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if not single(group, async_op):
            return gather(tensor_list, tensor, group=group, async_op=async_op)
        tensor_list[0].copy_(tensor)
        return None

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        if not single(group, async_op):
            return gather_into(output_tensor, input_tensor, group=group, async_op=async_op)
        if output_tensor.data_ptr() != input_tensor.data_ptr():
            output_tensor.copy_(input_tensor.view_as(output_tensor))
        return None

    def all_gather_object(object_list, obj, group=None):
        if not single(group, False):
            return gather_object(object_list, obj, group=group)
        object_list[0] = copy.deepcopy(obj)  # the collective hands back an unpickled copy
        return None

    def gather_object_(obj, object_gather_list=None, dst=None, group=None, group_dst=None):
        if not single(group, False):
            return gather_to_dst(obj, object_gather_list, dst=dst, group=group, group_dst=group_dst)
        object_gather_list[0] = copy.deepcopy(obj)
        return None

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not single(group, async_op):
            return reduce(tensor, op=op, group=group, async_op=async_op)
        return None

    def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
        if not single(group, False):
            return broadcast_objects(object_list, src=src, group=group, device=device, group_src=group_src)
        return None

    dist.all_gather, dist.all_gather_into_tensor, dist.all_gather_object, dist.gather_object = (
        all_gather, all_gather_into_tensor, all_gather_object, gather_object_)
    dist.all_reduce, dist.broadcast_object_list = all_reduce, broadcast_object_list
    # megatron-core modules imported before enable() bound the original at import time
    for name in _MCORE_GATHER_ALIASES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "dist_all_gather_func", None) is gather_into:
            module.dist_all_gather_func = all_gather_into_tensor


def _grad_norm_in_float64() -> None:
    """megatron-core's gradient norm without apex or Transformer Engine (``local_multi_tensor_l2_norm``) sums each
    tensor's squares in float32: 1.6e-5 low on a 31M model's first SFT step against the float64 norm of the same
    gradients (TRL's, through torch's fused kernels: 4.5e-6), which ``clip_grad`` then scales every update by.
    The same norm with each tensor's sum of squares accumulated in float64."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    if clip_grads.l2_norm_impl is not local_multi_tensor_l2_norm:  # apex's or TE's kernel
        return

    def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        squares = sum(torch.linalg.vector_norm(t, dtype=torch.float64) ** 2 for ts in tensor_lists for t in ts)
        return torch.as_tensor(squares, dtype=torch.float64).sqrt().reshape(1).float(), None

    clip_grads.l2_norm_impl = l2_norm


def cuda_available() -> bool:
    return torch.cuda.is_available()


def enable() -> bool:
    """Install the CPU redirections in this process if CUDA is absent. Returns True if active."""
    global _mode
    if cuda_available():
        return False
    with _lock:
        if _mode is None:
            _patch_torch_cuda()
            _collectives_locally_on_one_rank()
            _grad_norm_in_float64()
            _mode = _CudaToCpuMode()
            _mode.__enter__()  # stays entered for the life of the process
            logger.debug("megatron-core CPU compatibility enabled")
    return True


def is_enabled() -> bool:
    return _mode is not None


def _redirecting() -> bool:
    """True when a redirection mode is the innermost torch-function mode."""
    depth = torch._C._len_torch_function_stack()
    return bool(depth) and isinstance(torch._C._get_function_stack_at(depth - 1), _CudaToCpuMode)


@contextlib.contextmanager
def suspended():
    """Run megarl's own code (a role's methods, loss functions, the rollout engines) without the redirection
    mode: a Python ``TorchFunctionMode`` costs a call per torch op (~3 us; ~20% of a small model's decode
    step). A no-op when the mode is not installed or not the innermost mode (a profiler's is left alone)."""
    if _mode is None or not _redirecting():
        yield
        return
    with torch.overrides._pop_mode_temporarily():
        yield


@contextlib.contextmanager
def redirection():
    """Run megatron-core under the redirection inside a block that :func:`suspended` it (the engine's passes,
    optimizer step and checkpoints, called from a role's method). A no-op when it is already on or the
    mode is not installed (checked on entry: modules apply it at import, before :func:`enable`)."""
    if _mode is None or _redirecting():
        yield
        return
    with _CudaToCpuMode():
        yield


def unredirected(fn):
    """``fn`` run :func:`suspended`: for code that makes no CUDA calls but many torch calls (a loss function)."""
    if _mode is None:
        return fn

    def run(*args, **kwargs):
        with suspended():
            return fn(*args, **kwargs)

    return run


def run_unredirected(module) -> None:
    """Make ``module``'s forward run :func:`suspended` (when the mode is installed): for blocks that make no
    CUDA calls, e.g. megatron-core's transformer layers (the bulk of a forward's torch calls; the pipeline
    schedule, embeddings and RoPE around them still need the redirection). ``None`` is ignored."""
    if module is not None:
        module.forward = unredirected(module.forward)


def redirected(fn):
    """``fn`` run under :func:`redirection` (a decorator usable at import time): megatron-core code that
    allocates on ``torch.cuda.current_device()``, called from code that runs :func:`suspended`."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with redirection():
            return fn(*args, **kwargs)

    run._megarl_redirected = True
    return run


def redirect_moe() -> None:
    """Make megatron-core's MoE layers run on CPU (when the mode is installed; idempotent).

    * The MoE layer's forward and the backward of megatron-core's communication and router autograd
      functions run :func:`redirected`: they allocate on ``torch.cuda.current_device()``, but the
      transformer layers around them and the backward run unredirected (:func:`run_unredirected`,
      :func:`unredirect_backward`).
    * The all-to-all dispatcher keeps its split sizes as tensors unless they are on a GPU
      (``maybe_move_tensor_to_cpu``), and gloo's ``all_to_all_single`` takes only sizes: on CPU they
      become the NumPy arrays a GPU run gets.
    """
    if _mode is None:
        return
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_layer, moe_utils, token_dispatcher

    layer = moe_layer.MoELayer
    if getattr(layer.forward, "_megarl_redirected", False):
        return
    layer.forward = redirected(layer.forward)
    _redirect_autograd_functions((mappings, moe_utils), ("backward",))
    move = moe_utils.maybe_move_tensor_to_cpu

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = to_host


def redirect_sequence_parallel() -> None:
    """Make megatron-core's sequence parallelism run on CPU (when the mode is installed; idempotent).

    Its gathers and reduce-scatters along the sequence (``tensor_parallel.mappings``) and the tensor-parallel
    linears that gather their input themselves (``tensor_parallel.layers``) allocate their outputs and buffers
    on ``torch.cuda.current_device()``, in forward and in backward. Both run inside the transformer layers and
    the backward, which run unredirected (:func:`run_unredirected`, :func:`unredirect_backward`): the forward
    and backward of every autograd function of those two modules run :func:`redirected` instead (a few ops
    each; the rest of a layer stays unredirected)."""
    if _mode is None:
        return
    from megatron.core.tensor_parallel import layers, mappings

    _redirect_autograd_functions((mappings, layers), ("forward", "backward"))


def _redirect_autograd_functions(modules, methods: tuple[str, ...]) -> None:
    """Run the given static methods of every ``torch.autograd.Function`` defined in ``modules``
    :func:`redirected` (each wrapped once)."""
    for module in modules:
        for obj in list(vars(module).values()):
            if not (isinstance(obj, type) and issubclass(obj, torch.autograd.Function)):
                continue
            for method in methods:
                fn = vars(obj).get(method)
                if not isinstance(fn, staticmethod) or getattr(fn.__func__, "_megarl_redirected", False):
                    continue
                setattr(obj, method, staticmethod(redirected(fn.__func__)))


def unredirect_backward() -> None:
    """Run megatron-core's pipeline ``backward_step`` :func:`suspended` (when the mode is installed; idempotent).

    A backward runs under the torch-function modes of its caller, so every op of the autograd functions
    megatron-core's layers implement in Python (their linears' weight and input gradients, the DDP
    gradient hooks) would go through the mode: ~2,000 calls per update of a 2-layer model, 8% of its
    time (71 -> 65 ms). The backward makes no CUDA calls of its own: the communication functions that
    allocate on ``torch.cuda.current_device()`` (expert parallelism's all-to-alls, sequence parallelism's
    gathers and reduce-scatters) run redirected (:func:`redirect_moe`, :func:`redirect_sequence_parallel`)."""
    if _mode is None:
        return
    from megatron.core.pipeline_parallel import schedules

    if not getattr(schedules.backward_step, "_megarl_unredirected", False):
        schedules.backward_step = unredirected(schedules.backward_step)
        schedules.backward_step._megarl_unredirected = True
