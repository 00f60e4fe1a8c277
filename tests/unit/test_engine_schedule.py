"""The LR schedule the engine applies, step by step, against the hand formula (world of one)."""

import math

import torch

from megarl.checkpoint.convert import convert_hf_to_megatron


def test_warmup_then_cosine_decay(tiny_hf, tmp_path):
    from megarl.algos.config import AlgorithmConfig
    from megarl.controller.role import WorkerContext
    from megarl.data.batch import Batch
    from megarl.engine.config import EngineConfig, LRDecay, OptimConfig
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.policy import PolicyRole

    convert_hf_to_megatron(tiny_hf("llama_gqa"), tmp_path / "mc")
    layout = ParallelLayout()
    init_distributed(layout)
    ctx = WorkerContext(0, 1, layout, layout.coords(0), "127.0.0.1", "local", 0, "cpu")
    lr, min_lr, warmup, decay = 1e-3, 1e-4, 4, 4
    config = EngineConfig(optim=OptimConfig(lr=lr, min_lr=min_lr, lr_warmup_steps=warmup, lr_decay=LRDecay.COSINE,
                                            lr_decay_steps=decay))
    role = PolicyRole(ctx, checkpoint_dir=str(tmp_path / "mc"), engine=config, algorithm=AlgorithmConfig(),
                      temperature=1.0)
    resp = torch.zeros(2, 6)
    resp[:, 3:] = 1
    batch = Batch.from_dict({"input_ids": torch.randint(5, 300, (2, 6)), "attention_mask": torch.ones(2, 6),
                             "response_mask": resp, "old_log_probs": -5.7 * resp, "advantages": resp})
    seen = [role.update(batch).lr for _ in range(warmup + decay + 1)]
    expected = [lr * k / warmup for k in range(1, warmup + 1)]
    expected += [min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * k / decay)) for k in range(1, decay + 1)]
    expected += [min_lr]
    assert all(abs(a - b) < 1e-12 for a, b in zip(seen, expected, strict=True)), (seen, expected)
