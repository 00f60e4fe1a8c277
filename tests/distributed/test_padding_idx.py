"""The pad token's input-embedding row trains as in transformers, at TP1, TP2, TP2 with sequence parallelism and PP2.

transformers builds the input embedding as ``nn.Embedding(vocab, hidden, padding_idx=pad_token_id)``: the lookup
adds nothing to the pad row's gradient; a tied LM head still does (megarl/models/padding_idx.py,
docs/resharding.md §1.7). The rows below hold the pad token (id 0) inside the sequence, where the attention mask is
1 and the loss counts the position, as well as in the right padding. The loss weights the log-softmax of every real
position's logits by fixed random numbers. Reference: transformers' autograd gradient of the embedding weight
(every row), for a tied Qwen2 and an untied Llama. The same models with ``padding_idx=None`` give the pad row
another gradient (so the test can fail), and megarl built with ``BuildOptions(padding_idx=False)`` matches that one.
One spawned 2-process gloo world runs every case.
"""

from __future__ import annotations

import pytest
import torch

from megarl.checkpoint.convert import convert_hf_to_megatron
from megarl.testing.dist import run_world

pytestmark = pytest.mark.dist

PAD = 0  # tiny_config's pad_token_id
VOCAB = 300
MODELS = {"llama": "llama_gqa", "qwen2_tied": "qwen2_tied"}
# (case, model, tp, pp, sequence parallel, megarl's padding_idx)
CASES = [
    (f"{model}_{name}", model, tp, pp, sp, True)
    for model in MODELS
    for name, tp, pp, sp in [("tp1", 1, 1, False), ("tp2", 2, 1, False), ("tp2_sp", 2, 1, True), ("pp2", 1, 2, False)]
] + [("llama_tp2_sp_off", "llama", 2, 1, True, False), ("qwen2_tied_pp2_off", "qwen2_tied", 1, 2, False, False)]


def _batch():
    """3 rows of 12 tokens, 12, 9 and 10 of them real; the pad id at 5 real positions (one a row's first token) and
    in the right padding; loss weights: random over the vocabulary at real positions, 0 elsewhere."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (3, 12), generator=g)
    attn = (torch.arange(12) < torch.tensor([12, 9, 10])[:, None]).long()
    ids[attn == 0] = PAD
    for row, pos in [(0, 3), (0, 8), (1, 0), (1, 5), (2, 4)]:
        ids[row, pos] = PAD
    weights = torch.randn(3, 12, VOCAB, generator=g) * attn[..., None]
    return ids, attn, weights


def _hf_grad(hf_dir, padding_idx: bool) -> torch.Tensor:
    """transformers' gradient of the input embedding (tied: the LM head's too), with its padding_idx or without."""
    from transformers import AutoModelForCausalLM

    ids, attn, weights = _batch()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    embed = model.get_input_embeddings()
    assert embed.padding_idx == PAD  # transformers builds it from config.pad_token_id
    if not padding_idx:
        embed.padding_idx = None
    logits = model(ids, attention_mask=attn).logits
    (torch.log_softmax(logits, -1) * weights).sum().backward()
    return embed.weight.grad.clone()


def _world(rank, world_size, cases, ids, weights):
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megarl.checkpoint import mcore_io
    from megarl.checkpoint.format import read_meta
    from megarl.models.provider import BuildOptions, build_model
    from megarl.models.spec import spec_from_hf_config
    from megarl.parallel.init import destroy_distributed, init_distributed
    from megarl.parallel.layout import ParallelLayout

    ids, weights = torch.tensor(ids), torch.tensor(weights)
    batch, seq = ids.shape
    positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)

    def loss_func(output):
        logits = gather_from_tensor_model_parallel_region(output)[..., :VOCAB]
        return (torch.log_softmax(logits, -1) * weights).sum(), {}

    def forward_step(data_iterator, model):
        return model(next(data_iterator), positions, attention_mask=None), loss_func

    results = {}
    for case, ckpt, tp, pp, sp, padding_idx in cases:
        layout = ParallelLayout.for_world(world_size, tp=tp, pp=pp)
        init_distributed(layout)
        spec = spec_from_hf_config(read_meta(ckpt).hf_config)
        (model,) = build_model(spec, layout, BuildOptions(init_weights=False, sequence_parallel=sp,
                                                          padding_idx=padding_idx))
        mcore_io.load_model([model], ckpt)
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([ids]), model=model,
                                    num_microbatches=1, seq_length=seq, micro_batch_size=batch, forward_only=False)
        grads = {}
        if model.pre_process:
            grads["input"] = model.embedding.word_embeddings.weight.grad.tolist()
        if model.post_process and spec.tie_word_embeddings and not model.pre_process:
            grads["output"] = model.output_layer.weight.grad.tolist()  # the last stage's copy of the tied weight
        results[case] = {"coords": list(layout.coords(rank)), "sequence_parallel": model.config.sequence_parallel,
                         "grads": grads}
        del model
    destroy_distributed()
    return results


@pytest.fixture(scope="module")
def hf_dirs(tiny_hf):
    return {model: tiny_hf(name) for model, name in MODELS.items()}


@pytest.fixture(scope="module")
def references(hf_dirs):
    return {(model, on): _hf_grad(hf_dir, on) for model, hf_dir in hf_dirs.items() for on in (True, False)}


@pytest.fixture(scope="module")
def world(hf_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("padding_idx")
    for model, hf_dir in hf_dirs.items():
        convert_hf_to_megatron(hf_dir, root / model)
    ids, _, weights = _batch()
    cases = [(case, str(root / model), tp, pp, sp, on) for case, model, tp, pp, sp, on in CASES]
    return run_world(_world, 2, cases, ids.tolist(), weights.tolist(), timeout_s=900)


def _megarl_grad(world, case) -> torch.Tensor:
    """The embedding weight's gradient [VOCAB, H]: the vocabulary shards of data-parallel rank 0 in TP order, plus
    (tied, PP2) the last stage's output-layer copy, which megatron-core's embedding group adds in training."""
    total = 0
    for kind in ("input", "output"):
        shards = {r[case]["coords"][0]: torch.tensor(r[case]["grads"][kind]) for r in world
                  if kind in r[case]["grads"] and r[case]["coords"][2] == 0}
        if shards:
            total = total + torch.cat([shards[t] for t in sorted(shards)])[:VOCAB]
    return total


def _relative(value, expected):
    return ((value - expected).norm() / expected.norm()).item()


def test_transformers_trains_the_pad_row_without_its_lookup(references):
    """The reference itself: padding_idx changes the pad row's gradient and no other row."""
    for model in MODELS:
        on, off = references[model, True], references[model, False]
        assert _relative(on[PAD + 1:], off[PAD + 1:]) < 1e-6
        assert _relative(on[PAD], off[PAD]) > 0.1
        if model == "llama":  # untied: the lookup was the row's only gradient
            assert not on[PAD].any() and off[PAD].any()
        else:  # tied: the LM head's gradient of the row stays
            assert on[PAD].any()


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_embedding_gradient_matches_transformers(world, references, case):
    _, model, tp, pp, sp, on = next(c for c in CASES if c[0] == case)
    assert all(r[case]["sequence_parallel"] == sp for r in world)
    grad = _megarl_grad(world, case)
    expected = references[model, on]
    assert _relative(grad, expected) < 1e-5
    if expected[PAD].any():
        assert _relative(grad[PAD], expected[PAD]) < 1e-5
    else:  # untied with padding_idx: exactly no gradient
        assert not grad[PAD].any()
    assert _relative(grad[PAD], references[model, not on][PAD]) > 0.1  # not the other behaviour's pad row
