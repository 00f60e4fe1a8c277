"""Batch-major logits (megarl/engine/output_layer.py) in a world of one.

Reference: the same GPTModel without the hooks, i.e. megatron-core's own [s, b, V] GEMM and
transpose copy. Tied embeddings, so the output weight is passed in at forward. TP2 and PP through
the engine are checked against transformers in tests/distributed/test_policy.py and
tests/engine/test_output_layer_tp.py.
"""

from __future__ import annotations

import torch

from megarl.engine.output_layer import make_logits_batch_major


def _model(tiny_hf, name):
    from megarl.models.provider import BuildOptions, build_model
    from megarl.models.spec import load_hf_config, spec_from_hf_config
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    layout = ParallelLayout()
    init_distributed(layout)
    spec = spec_from_hf_config(load_hf_config(tiny_hf(name)))
    return build_model(spec, layout, BuildOptions(seed=3))[0]


def _logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    logits = model(ids, pos, attention_mask=None)
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5))
    (logits * weights).sum().backward()
    return logits, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_logits_and_gradients_equal_megatrons_and_the_transpose_copies_nothing(tiny_hf):
    model = _model(tiny_hf, "qwen2_tied")
    assert model.output_layer.weight is None  # tied: the embedding's weight is passed in at forward
    ids = torch.randint(0, 300, (3, 7), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_grads = _logits_and_grads(model, ids)

    assert make_logits_batch_major(model)
    assert make_logits_batch_major(model)  # a second install is a no-op, not a transpose back
    gemm = {}
    model.output_layer.register_forward_hook(lambda m, args, out: gemm.update(ptr=out[0].data_ptr()))
    logits, grads = _logits_and_grads(model, ids)

    assert logits.shape == ref_logits.shape == (3, 7, model.vocab_size)
    assert logits.is_contiguous() and logits.data_ptr() == gemm["ptr"]  # Megatron's .contiguous() was a no-op
    torch.testing.assert_close(logits, ref_logits, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        # the weight gradient sums over tokens in another order: fp32 rounding, not exact
        rel = (g - ref_grads[name]).norm() / ref_grads[name].norm()
        assert rel < 1e-6, f"{name}: relative error {rel:.2e}"


def test_scalar_heads_are_left_alone(tiny_hf):
    model = _model(tiny_hf, "llama_rm")
    assert not make_logits_batch_major(model)
    assert not model.output_layer._forward_pre_hooks and not model.output_layer._forward_hooks
