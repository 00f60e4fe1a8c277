"""megarl/models/local_layers.py against megatron-core's own local-spec modules.

Reference: the same GPTModel built with megatron-core's local core attention (scores materialised,
KV heads repeated, Python softmax) and its unfused SwiGLU MLP, in float64 so the comparison is about
the math, not rounding. GQA (llama_gqa: 4 query heads on 2 KV groups) and tied Qwen2; logits and
every parameter gradient. The models as a whole are checked against transformers in
tests/distributed/test_policy.py.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megarl.models.local_layers import (
    NativeColumnParallelLinear,
    NativeRowParallelLinear,
    SDPAttention,
    SwiGLUMLP,
)


def _model(tiny_hf, name, local_layers, dtype=torch.float64):
    from megarl.models.provider import BuildOptions, build_model
    from megarl.models.spec import load_hf_config, spec_from_hf_config
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    layout = ParallelLayout()
    init_distributed(layout)
    spec = spec_from_hf_config(load_hf_config(tiny_hf(name)))
    return build_model(spec, layout, BuildOptions(seed=3, dtype=dtype, local_layers=local_layers))[0]


def _logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    logits = model(ids, pos, attention_mask=None)
    weights = torch.randn(logits.shape, dtype=logits.dtype, generator=torch.Generator().manual_seed(5))
    (logits * weights).sum().backward()
    return logits, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_tied"])
def test_local_layers_equal_megatron_core_modules(tiny_hf, name):
    ids = torch.randint(0, 300, (3, 9), generator=torch.Generator().manual_seed(1))
    ref = _model(tiny_hf, name, local_layers=False)
    model = _model(tiny_hf, name, local_layers=True)
    model.load_state_dict(ref.state_dict())
    for cls, per_layer in ((SDPAttention, 1), (SwiGLUMLP, 1), (NativeColumnParallelLinear, 2),
                           (NativeRowParallelLinear, 2)):
        assert sum(isinstance(m, cls) for m in model.modules()) == per_layer * len(model.decoder.layers)
        assert not any(isinstance(m, cls) for m in ref.modules())
    ref_logits, ref_grads = _logits_and_grads(ref, ids)
    logits, grads = _logits_and_grads(model, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-12, atol=1e-12)
    assert grads.keys() == ref_grads.keys()
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-10, atol=1e-12, msg=n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_mlp_is_bit_identical_and_keeps_only_the_fc1_output(tiny_hf, dtype):
    """Same kernels on the same inputs as megatron-core's MLP, so equal to the last bit (output, input
    gradient, weight gradients) in fp32 and bf16; autograd keeps the fc1 output and no product."""
    ref = _model(tiny_hf, "llama_gqa", local_layers=False, dtype=dtype).decoder.layers[0].mlp
    mlp = _model(tiny_hf, "llama_gqa", local_layers=True, dtype=dtype).decoder.layers[0].mlp
    assert isinstance(mlp, SwiGLUMLP) and not isinstance(ref, SwiGLUMLP)
    mlp.load_state_dict(ref.state_dict())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, ref.config.hidden_size, generator=gen).to(dtype)  # [s, b, h]
    grad = torch.randn(5, 3, ref.config.hidden_size, generator=gen).to(dtype)

    saved: list[torch.Tensor] = []
    backward_ops: list[str] = []

    class OpLog(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            backward_ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    def run(module):
        """(output, input grad, weight grads, bytes of the non-parameter storages autograd saved)"""
        saved.clear()
        module.zero_grad(set_to_none=True)
        inp = x.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out, bias = module(inp)
        assert bias is None
        weights = {p.untyped_storage().data_ptr() for p in module.parameters()}  # a weight's views too
        saved_bytes = sum(t.untyped_storage().nbytes() for t in {id(t): t for t in saved}.values()
                          if t.untyped_storage().data_ptr() not in weights)
        backward_ops.clear()
        with OpLog():
            out.backward(grad)
        return out, inp.grad, {n: p.grad for n, p in module.named_parameters()}, saved_bytes

    ref_out, ref_x_grad, ref_w_grads, ref_saved = run(ref)
    out, x_grad, w_grads, new_saved = run(mlp)
    assert torch.equal(out, ref_out) and torch.equal(x_grad, ref_x_grad)
    assert w_grads.keys() == ref_w_grads.keys() and all(torch.equal(w_grads[n], ref_w_grads[n]) for n in w_grads)
    element = torch.tensor([], dtype=dtype).element_size()
    fc1_out = 5 * 3 * 2 * ref.config.ffn_hidden_size * element
    hidden = 5 * 3 * ref.config.hidden_size * element
    # megatron-core: fc1's input, the fc1 output (held by the gate view), silu(gate), up + 0, the product
    assert ref_saved == hidden + fc1_out + 3 * fc1_out // 2
    # megarl: fc1's input, the fc1 output; the product's storage was freed (it is recomputed)
    assert new_saved == hidden + fc1_out
    # ... in backward once, with silu(gate), which SwiGLU's backward then reuses: one silu, not two
    assert backward_ops.count("silu.default") == 1 and backward_ops.count("silu_backward.grad_input") == 1


def _keep(saved: list, t: torch.Tensor) -> torch.Tensor:
    saved.append(t)
    return t


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
def test_lean_rms_norm_equals_torch_and_saves_only_its_input(dtype, tol):
    """LeanRMSNorm against torch.nn.RMSNorm (autograd through torch's composite): output bit-identical,
    input and weight gradients within rounding; q/k-norm shape (heads on the second-to-last dimension)."""
    from megarl.models.local_layers import LeanRMSNorm

    g = torch.Generator().manual_seed(7)
    for shape in ((5, 3, 64), (4, 2, 3, 16)):
        x = (torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 0.5).to(dtype)
        weight = torch.randn(shape[-1], generator=g, dtype=torch.float64).to(dtype)
        grad = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
        outs = []
        for cls in (torch.nn.RMSNorm, LeanRMSNorm):
            norm = cls(shape[-1], eps=1e-6, dtype=dtype)
            norm.weight.data.copy_(weight)
            xi = x.clone().requires_grad_()
            saved: list[torch.Tensor] = []
            with torch.autograd.graph.saved_tensors_hooks(functools.partial(_keep, saved), lambda t: t):
                y = norm(xi)
            y.backward(grad)
            big = {t.untyped_storage().data_ptr() for t in saved if t.numel() == x.numel()}
            outs.append((y.detach(), xi.grad, norm.weight.grad, len(big)))
        (y0, gx0, gw0, big0), (y1, gx1, gw1, big1) = outs
        assert torch.equal(y1, y0)
        torch.testing.assert_close(gx1, gx0, rtol=tol, atol=tol)
        torch.testing.assert_close(gw1, gw0, rtol=tol, atol=tol * shape[0])
        assert (big0, big1) == (2, 1)  # torch keeps the input and the normalised input; lean: the input
