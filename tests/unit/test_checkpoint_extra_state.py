"""A converted checkpoint loads into a model whose modules have extra state the checkpoint lacks, as Transformer
Engine's do (FP8 metadata under ``<module>._extra_state``); any other missing tensor is still an error.

megarl's converter builds without TE, so its checkpoints lack the extra state of TE's norms; a role on a machine
with TE builds them. TE does not run here: :mod:`megarl.testing.extra_state` gives megatron-core modules the same
``get_extra_state``/``set_extra_state`` pair. References: the checkpoint's keys as megatron-core reads them and the
HF model's tensors. Runs in the test process as a world of one (the conversion tools' own mode).
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata
from safetensors.torch import load_file

from megarl.checkpoint import mcore_io
from megarl.checkpoint.convert import convert_hf_to_megatron
from megarl.errors import CheckpointError
from megarl.testing.extra_state import add_extra_state

FRESH = torch.tensor([7, 1, 9], dtype=torch.uint8)  # what a freshly built TE module's extra state stands for


def _model(hf_dir):
    from megarl.models.provider import BuildOptions, build_model
    from megarl.models.spec import load_hf_config, spec_from_hf_config
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    init_distributed(ParallelLayout())
    spec = spec_from_hf_config(load_hf_config(hf_dir))
    return build_model(spec, ParallelLayout(), BuildOptions(use_te=False))[0]


@pytest.fixture(scope="module")
def converted(tiny_hf, tmp_path_factory):
    out = tmp_path_factory.mktemp("extra_state") / "mc"
    convert_hf_to_megatron(tiny_hf("llama_gqa"), out)
    return tiny_hf("llama_gqa"), out


def test_extra_state_the_checkpoint_lacks_keeps_its_fresh_value(converted):
    src, ckpt = converted
    model = _model(src)
    with_extra = [model.decoder.final_layernorm, *(layer.self_attention for layer in model.decoder.layers)]
    for module in with_extra:  # TE's final norm (one object) and a module in every layer (stacked over layers)
        add_extra_state(module, FRESH.clone())
    requested = {sh.key for sh in nested_values(model.sharded_state_dict())}
    in_checkpoint = {sh.key for sh in load_sharded_metadata(str(ckpt / "weights")).values()}
    assert requested - in_checkpoint == {"decoder.final_layernorm._extra_state",
                                         "decoder.layers.self_attention._extra_state"}

    mcore_io.load_model([model], ckpt)

    hf = load_file(src / "model.safetensors")
    assert torch.equal(model.decoder.final_layernorm.weight, hf["model.norm.weight"])
    for i, layer in enumerate(model.decoder.layers):
        assert torch.equal(layer.self_attention.linear_proj.weight, hf[f"model.layers.{i}.self_attn.o_proj.weight"])
    assert torch.equal(model.embedding.word_embeddings.weight[:300], hf["model.embed_tokens.weight"])
    for module in with_extra:
        assert module.extra_state_loads == 0 and torch.equal(module.extra_state, FRESH)


def test_a_missing_tensor_is_still_an_error_that_names_it(converted):
    src, ckpt = converted
    model = _model(src)
    add_extra_state(model.decoder.final_layernorm, FRESH.clone())
    model.decoder.final_layernorm.register_parameter("bias", torch.nn.Parameter(torch.zeros(64)))
    with pytest.raises(CheckpointError, match=r"lacks 1 of the tensors this model has \(first: "
                                              r"\['decoder.final_layernorm.bias'\]\); it was written for another"):
        mcore_io.load_model([model], ckpt)
