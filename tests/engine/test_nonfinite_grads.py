"""A finite loss with a NaN/inf gradient: the step is skipped and counted (world of one).

tests/distributed/test_policy.py covers a NaN loss on TP2xPP2; here the loss stays finite and only
one logit's gradient is poisoned, so only the gradient check (over the DDP grad buffers) can see it.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.checkpoint.convert import convert_hf_to_megatron


class _PoisonGrad(torch.autograd.Function):
    """Identity forward; backward sets one entry of the gradient to ``value``."""

    @staticmethod
    def forward(ctx, x, value):
        ctx.value = value
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        grad[0, 1, 2] = ctx.value
        return grad, None


@pytest.fixture(scope="module")
def engine(tiny_hf, tmp_path_factory):
    from megarl.engine.config import EngineConfig, MicroBatchConfig, OptimConfig, OptimizerName
    from megarl.engine.engine import MegatronEngine
    from megarl.models.spec import load_hf_config, spec_from_hf_config
    from megarl.parallel.init import init_distributed, process_groups
    from megarl.parallel.layout import ParallelLayout

    ckpt = tmp_path_factory.mktemp("nonfinite") / "mc"
    convert_hf_to_megatron(tiny_hf("qwen2_tied"), ckpt)
    layout = ParallelLayout()
    init_distributed(layout)
    config = EngineConfig(optim=OptimConfig(optimizer=OptimizerName.SGD, lr=0.1, clip_grad=0.0,
                                            use_distributed_optimizer=False),
                          micro_batch=MicroBatchConfig(max_tokens=16))  # 2 micro-batches
    spec = spec_from_hf_config(load_hf_config(tiny_hf("qwen2_tied")))
    return MegatronEngine(spec, layout, config, checkpoint_dir=str(ckpt), trainable=True, groups=process_groups())


def _batch():
    from megarl.data.batch import Batch

    ids = torch.randint(5, 300, (4, 6), generator=torch.Generator().manual_seed(2))
    return Batch.from_dict({"input_ids": ids, "attention_mask": torch.ones(4, 6)})


def _loss_fn(poison: float | None):
    def loss_fn(logits, mb):
        if poison is not None:
            logits = _PoisonGrad.apply(logits, poison)
        return logits.float().square().mean() / 2, {}  # two micro-batches: each half of the loss

    return loss_fn


def _params(engine):
    return [p.detach().clone() for c in engine.chunks for p in c.parameters()]


@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
def test_nonfinite_gradient_with_a_finite_loss_skips_the_step(engine, poison):
    before, skipped = _params(engine), engine.stats.skipped_steps
    result = engine.train_step(_batch(), _loss_fn(poison))
    assert math.isfinite(result.loss)
    assert result.step_skipped is True and result.skipped_steps == skipped + 1
    assert math.isnan(result.grad_norm)
    assert all(torch.equal(a, b) for a, b in zip(before, _params(engine), strict=True))

    result = engine.train_step(_batch(), _loss_fn(None))  # a clean step is taken and resets the run
    assert result.step_skipped is False and engine.stats.consecutive_skipped == 0
    assert math.isfinite(result.grad_norm) and result.grad_norm > 0
    assert not all(torch.equal(a, b) for a, b in zip(before, _params(engine), strict=True))


def test_default_precision_builds_fp32_on_cpu(engine):
    """``precision: auto`` (the default, issue #41) resolves where the model is built: float32 on this CPU."""
    from megarl.engine.config import Precision

    assert engine.config.precision is Precision.AUTO and engine.precision is Precision.FP32
    assert {p.dtype for c in engine.chunks for p in c.parameters()} == {torch.float32}
