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
    from megarl.models.forward import forward_logits
    from megarl.models.provider import BuildOptions, build_model
    from megarl.models.spec import spec_from_hf_config
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    init_distributed(ParallelLayout())
    spec = spec_from_hf_config(mcore_io.read_meta(ckpt).hf_config)
    chunks = build_model(spec, ParallelLayout(), BuildOptions(dtype=dtype, init_weights=False, use_te=use_te))
    assert next(chunks[0].parameters()).device.type == "cuda"
    mcore_io.load_model(chunks, ckpt)
    return forward_logits(chunks, ids, spec.vocab_size).float()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-3), (torch.bfloat16, 0.15)])
@pytest.mark.parametrize(
    "use_te",
    [False, pytest.param(True, marks=pytest.mark.skipif(
        importlib.util.find_spec("transformer_engine") is None, reason="Transformer Engine is not installed"))],
)
def test_cuda_logits_match_transformers(tiny_hf, tmp_path, dtype, tol, use_te):
    from transformers import AutoModelForCausalLM

    from megarl.checkpoint.convert import convert_hf_to_megatron
    from megarl.parallel.init import default_backend

    assert default_backend() == "nccl"
    src = tiny_hf("llama_gqa")
    convert_hf_to_megatron(src, tmp_path / "mc", dtype=str(dtype).removeprefix("torch."))
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
    ours = _megatron_logits(tmp_path / "mc", ids, use_te=use_te, dtype=dtype)
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=dtype).cuda().eval()
    with torch.no_grad():
        theirs = ref(ids).logits.float()
    assert (ours - theirs).abs().max().item() < tol
