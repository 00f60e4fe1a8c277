"""megarl/models/local_layers.py against megatron-core's own local-spec modules.

Reference: the same GPTModel built with megatron-core's local core attention (scores materialised,
KV heads repeated, Python softmax) and its unfused SwiGLU MLP, in float64 so the comparison is about
the math, not rounding. GQA (llama_gqa: 4 query heads on 2 KV groups) and tied Qwen2; logits and
every parameter gradient. The models as a whole are checked against transformers in
tests/distributed/test_policy.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megarl.models.local_layers import SDPAttention, SwiGLU, SwiGLUMLP


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
    for cls in (SDPAttention, SwiGLUMLP):
        assert sum(isinstance(m, cls) for m in model.modules()) == len(model.decoder.layers)
        assert not any(isinstance(m, cls) for m in ref.modules())
    ref_logits, ref_grads = _logits_and_grads(ref, ids)
    logits, grads = _logits_and_grads(model, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-12, atol=1e-12)
    assert grads.keys() == ref_grads.keys()
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-10, atol=1e-12, msg=n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_is_bit_identical_to_autograd_and_saves_only_its_input(dtype):
    """Same kernels as autograd on megatron-core's expression, so equal to the last bit in fp32 and
    bf16; a [s, b, 2f] input with a strided view like the fc1 output's chunks."""
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(7, 3, 2 * 20, generator=gen).to(dtype)
    grad = torch.randn(7, 3, 20, generator=gen).to(dtype)

    y_ref = y.clone().requires_grad_()
    gate, up = torch.chunk(y_ref, 2, dim=-1)
    out_ref = F.silu(gate) * (up + 0.0)  # megatron-core's glu with glu_linear_offset 0
    out_ref.backward(grad)

    saved = []

    def pack(t):
        saved.append(t)
        return t

    y_new = y.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = SwiGLU.apply(y_new)
    out.backward(grad)
    assert torch.equal(out, out_ref)
    assert torch.equal(y_new.grad, y_ref.grad)
    # float64 reference of the derivative: d/dg silu(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g)))
    g64, u64 = y.double().chunk(2, dim=-1)
    s = torch.sigmoid(g64)
    expected = torch.cat((grad.double() * u64 * s * (1 + g64 * (1 - s)), grad.double() * g64 * s), dim=-1)
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(y_new.grad.double(), expected, rtol=tol, atol=tol)
    assert [t.untyped_storage().data_ptr() for t in saved] == [y_new.untyped_storage().data_ptr()]
