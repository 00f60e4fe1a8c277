"""SDPAttention (megarl/models/sdpa_attention.py) against megatron-core's own DotProductAttention.

Reference: the same GPTModel built with megatron-core's local core attention (scores materialised,
KV heads repeated, Python softmax), in float64 so the comparison is about the math, not rounding.
GQA (llama_gqa: 4 query heads on 2 KV groups) and tied Qwen2; logits and every parameter gradient.
The models as a whole are checked against transformers in tests/distributed/test_policy.py.
"""

from __future__ import annotations

import pytest
import torch

from megarl.models.sdpa_attention import SDPAttention


def _model(tiny_hf, name, sdpa):
    from megarl.models.provider import BuildOptions, build_model
    from megarl.models.spec import load_hf_config, spec_from_hf_config
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    layout = ParallelLayout()
    init_distributed(layout)
    spec = spec_from_hf_config(load_hf_config(tiny_hf(name)))
    return build_model(spec, layout, BuildOptions(seed=3, dtype=torch.float64, sdpa_attention=sdpa))[0]


def _logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    logits = model(ids, pos, attention_mask=None)
    weights = torch.randn(logits.shape, dtype=logits.dtype, generator=torch.Generator().manual_seed(5))
    (logits * weights).sum().backward()
    return logits, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_tied"])
def test_sdpa_equals_megatron_core_attention(tiny_hf, name):
    ids = torch.randint(0, 300, (3, 9), generator=torch.Generator().manual_seed(1))
    ref = _model(tiny_hf, name, sdpa=False)
    model = _model(tiny_hf, name, sdpa=True)
    model.load_state_dict(ref.state_dict())
    cores = [m for m in model.modules() if isinstance(m, SDPAttention)]
    assert len(cores) == len(model.decoder.layers) and not any(isinstance(m, SDPAttention) for m in ref.modules())
    ref_logits, ref_grads = _logits_and_grads(ref, ids)
    logits, grads = _logits_and_grads(model, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-12, atol=1e-12)
    assert grads.keys() == ref_grads.keys()
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-10, atol=1e-12, msg=n)
