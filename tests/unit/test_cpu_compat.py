"""The CPU compatibility layer redirects exactly the CUDA calls megatron-core makes."""

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
