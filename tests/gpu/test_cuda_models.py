"""CUDA paths (skipped without a GPU): NCCL world of one, bf16 model, Transformer Engine spec.

These run on the occasional GPU machine, never in CI. They compare against `transformers` on the
same device, like the CPU tests.
"""

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _megatron_logits(ckpt, ids, *, use_te, dtype):
    from megarl.checkpoint import mcore_io
    from megarl.checkpoint.format import read_meta
    from megarl.models.forward import forward_logits
    from megarl.models.provider import BuildOptions, build_model
    from megarl.models.spec import spec_from_hf_config
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    init_distributed(ParallelLayout())
    spec = spec_from_hf_config(read_meta(ckpt).hf_config)
    chunks = build_model(spec, ParallelLayout(), BuildOptions(dtype=dtype, init_weights=False, use_te=use_te))
    assert next(chunks[0].parameters()).device.type == "cuda"
    mcore_io.load_model(chunks, ckpt)
    return forward_logits(chunks, ids, spec.vocab_size).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "use_te",
    [False, pytest.param(True, marks=pytest.mark.skipif(
        importlib.util.find_spec("transformer_engine") is None, reason="Transformer Engine is not installed"))],
)
def test_cuda_logits_match_transformers(tiny_hf, tmp_path, dtype, use_te):
    from transformers import AutoModelForCausalLM

    from megarl.checkpoint.convert import convert_hf_to_megatron
    from megarl.parallel.init import default_backend

    assert default_backend() == "nccl"
    src = tiny_hf("llama_gqa")
    convert_hf_to_megatron(src, tmp_path / "mc", dtype=str(dtype).removeprefix("torch."))
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
    ours = _megatron_logits(tmp_path / "mc", ids, use_te=use_te, dtype=dtype)
    with torch.no_grad():
        exact = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).cuda().eval()(ids).logits
        theirs = AutoModelForCausalLM.from_pretrained(src, dtype=dtype).cuda().eval()(ids).logits.float()
    if dtype == torch.float32:
        assert (ours - exact).abs().max().item() < 1e-3
    else:  # bf16 rounding: no further from float32 than transformers' own bf16 forward (mean |error|)
        assert (ours - exact).abs().mean().item() < 1.5 * (theirs - exact).abs().mean().item() + 1e-3
