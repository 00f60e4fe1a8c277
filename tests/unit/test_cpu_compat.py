"""The CPU compatibility layer redirects exactly the CUDA calls megatron-core makes."""

import math

import pytest
import torch

from megarl.parallel import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is inactive when CUDA is present")


def test_cuda_device_arguments_land_on_cpu():
    assert cpu_compat.enable() is True and cpu_compat.enable() is True  # idempotent
    assert cpu_compat.is_enabled()
    assert torch.zeros(3, device="cuda").device.type == "cpu"
    assert torch.empty(2, device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.ones(2, device=torch.cuda.current_device()).device.type == "cpu"
    x = torch.arange(3.0)
    assert x.cuda().device.type == "cpu" and x.to("cuda").device.type == "cpu"
    assert torch.equal(x.to("cuda", torch.float64), torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64))
    assert x.to(torch.float16).dtype == torch.float16  # non-device .to() calls are untouched
    torch.cuda.synchronize()
    torch.cuda.current_stream().synchronize()
    with torch.cuda.stream(torch.cuda.current_stream()):
        pass


def test_megatron_causal_mask_helper_runs_on_cpu():
    cpu_compat.enable()
    from megatron.core.transformer.utils import get_default_causal_mask

    mask = get_default_causal_mask(4)
    expected = torch.tensor([[j > i for j in range(4)] for i in range(4)])
    assert mask.device.type == "cpu" and torch.equal(mask, expected)


def test_tensor_type_reports_cuda_names_for_megatron_optimizer_checks():
    cpu_compat.enable()
    assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.zeros(1).type(torch.float64).dtype == torch.float64  # conversions untouched


def test_suspended_removes_the_mode_and_restores_it():
    cpu_compat.enable()
    assert torch.zeros(1, device="cuda").device.type == "cpu"  # redirected
    # without the mode, a CPU-only torch cannot allocate on CUDA
    with cpu_compat.suspended(), pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")
    assert torch.zeros(1, device="cuda").device.type == "cpu"


def _mode_on_top() -> bool:
    n = torch._C._len_torch_function_stack()
    return n > 0 and torch._C._get_function_stack_at(n - 1) is cpu_compat._mode


def test_unredirected_functions_and_megatron_backward_run_without_the_mode():
    """Loss functions and megatron-core's backward step make no CUDA calls: they run without the per-op
    mode (each op through it costs ~4 us). The mode is back on top afterwards."""
    cpu_compat.enable()
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.transformer_config import TransformerConfig

    seen = {}
    assert cpu_compat.unredirected(lambda: _mode_on_top())() is False and _mode_on_top()

    class Probe(torch.autograd.Function):  # records whether the mode is on top while backward runs
        @staticmethod
        def forward(ctx, x):
            seen["forward"] = _mode_on_top()
            return x * 2.0

        @staticmethod
        def backward(ctx, grad):
            seen["backward"] = _mode_on_top()
            return grad * 2.0

    cpu_compat.unredirect_backward()
    cpu_compat.unredirect_backward()  # idempotent: wrapped once
    x = torch.tensor([1.0, -3.0], requires_grad=True)
    out = Probe.apply(x).sum()
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    schedules.backward_step(None, out, None, None, config)
    assert seen == {"forward": True, "backward": False}
    assert torch.equal(x.grad, torch.tensor([2.0, 2.0]))  # d(sum 2x)/dx, by hand
    assert _mode_on_top()


def _redirecting() -> bool:
    n = torch._C._len_torch_function_stack()
    return n > 0 and isinstance(torch._C._get_function_stack_at(n - 1), cpu_compat._CudaToCpuMode)


def test_role_methods_run_unredirected_and_the_engine_redirects_again():
    """A role's method (call_role) runs without the mode: a CUDA allocation fails there, as in any CPU-only
    torch; a function decorated :func:`redirected` (at import time, before enable: the check is at call
    time) gets it back inside, once, and the mode is on top again after the call."""
    from megarl.controller.role import Role, call_role

    @cpu_compat.redirected
    def allocate():
        return torch.zeros(2, device="cuda"), _redirecting(), torch._C._len_torch_function_stack()

    cpu_compat.enable()
    depth = torch._C._len_torch_function_stack()

    class Probe(Role):
        def method(self):
            with pytest.raises((RuntimeError, AssertionError)):
                torch.zeros(1, device="cuda")
            return _redirecting(), allocate()

    redirecting, (tensor, inside, inside_depth) = call_role({"probe": Probe(None)}, "probe", Probe.method)
    assert redirecting is False and inside is True and tensor.device.type == "cpu"
    assert inside_depth == depth  # one mode popped by the role call, one pushed by the engine
    assert allocate()[2] == depth  # already redirecting: nothing pushed
    assert _redirecting() and torch._C._len_torch_function_stack() == depth


_GATHER_WORLD = r"""
import json, os, sys
import torch
import torch.distributed as dist
torch.set_num_threads(2)
if sys.argv[1] == "layer":
    from megarl.parallel import cpu_compat
    import megarl.parallel.mcore_compat  # imports megatron-core, which binds its gather function at import
    cpu_compat.enable()
    from megatron.core.distributed import param_and_grad_buffer
    bound = param_and_grad_buffer.dist_all_gather_func is dist.all_gather_into_tensor
else:
    bound = None
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
group = dist.new_group([0])
threads = lambda: len(os.listdir("/proc/self/task"))
x = torch.arange(1 << 20, dtype=torch.float32)  # far above OpenMP's grain: a copy of it goes parallel
x.clone()  # this thread's own OpenMP team exists from here on
before = threads()
out = torch.empty_like(x)
dist.all_gather_into_tensor(out, x, group=group)
listed = [torch.empty_like(x)]
dist.all_gather(listed, x * 2, group=group)
objects, gathered = [None], [None]
dist.all_gather_object(objects, {"a": [1, 2]}, group=group)
dist.gather_object({"b": 3}, gathered, dst=0, group=group)
print(json.dumps({"new_threads": threads() - before, "bound": bound,
                  "into": bool(torch.equal(out, x)), "list": bool(torch.equal(listed[0], x * 2)),
                  "object": objects[0], "gathered": gathered[0]}))
"""


def _gather_world(mode: str) -> dict:
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _GATHER_WORLD, mode], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="counts threads through Linux /proc")
def test_one_rank_gathers_are_local_copies_and_start_no_openmp_team():
    """gloo copies a gather's result on its own worker thread; a large copy makes that thread start an OpenMP
    team (one more OS thread), after which libgomp stops spinning process-wide. With the layer, gathers over a
    one-rank group return the same values and start no thread; megatron-core's import-time alias is rebound."""
    plain = _gather_world("plain")
    assert plain["into"] and plain["list"]
    assert plain["new_threads"] >= 1  # the effect being prevented: gloo's worker thread gained an OpenMP team
    fixed = _gather_world("layer")
    assert fixed == {"new_threads": 0, "bound": True, "into": True, "list": True, "object": {"a": [1, 2]},
                     "gathered": {"b": 3}}


def test_gradient_norm_accumulates_in_float64():
    """megatron-core's CPU gradient norm (no apex, no TE) summed float32 squares: 1e-5 low on 5M values of 1e-3.
    With the compatibility layer it equals the float64 norm of the same tensors (and megatron's own does not)."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    cpu_compat.enable()
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(1000, 1000, generator=g) * 1e-3 for _ in range(5)]
    exact = math.sqrt(sum(float((t.double() ** 2).sum()) for t in grads))
    norm, _ = clip_grads.l2_norm_impl(0, None, [grads], False)
    assert abs(norm.item() - exact) / exact < 1e-7
    float32, _ = local_multi_tensor_l2_norm(0, None, [grads], False)
    assert abs(float32.item() - exact) / exact > 1e-6  # what it replaced
