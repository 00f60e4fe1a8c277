"""A policy's whole cycle on one GPU (skipped without one), as `make gpu-check` runs it (tools/gpu_check.py):
every collective of a dense and an MoE cycle on the compute device, a checkpoint resumed bit-exactly, vLLM's
sleep/wake/sync/generate twice, and a colocated policy whose vLLM starts at the planner's utilization.

NCCL world of one in the test process (megarl.parallel.init), as tests/gpu/test_cuda_engine.py. References: the
device every collective's tensors live on (NCCL takes CUDA tensors only: a CPU tensor is the bug of issue #41),
the same step replayed from the checkpoint (bit-exact), transformers' greedy tokens and the training engine's
log-probs of vLLM's samples, and vLLM's own start-up check (v1/worker/utils.py request_memory).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections import Counter

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM's CUDA wheel is not installed")

PROMPTS = [[5, 17, 42], [8, 9], [100, 3, 4, 77, 12], [250]]
MAX_NEW = 6
DEVICE = "cuda:0"  # the compute device (a CPU run of these functions sets "cpu")
# the collectives megarl and megatron-core call through torch.distributed's module attributes
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
               "all_to_all_single", "reduce", "all_gather_object")


@contextlib.contextmanager
def record_collectives(seen: Counter):
    """Count (collective, device type) of every tensor passed to a torch.distributed collective (calls go through)."""
    import torch.distributed as dist

    saved = {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(name, fn):
        def call(*args, **kwargs):
            for a in list(args) + list(kwargs.values()):
                for t in a if isinstance(a, (list, tuple)) else [a]:
                    if torch.is_tensor(t):
                        seen[(name, t.device.type)] += 1
            return fn(*args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield seen
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _policy(ckpt: str, precision: str = "bfloat16", rollout=None, lr: float = 1e-3):
    from megarl.algos.config import AlgorithmConfig
    from megarl.controller.role import WorkerContext
    from megarl.engine.config import EngineConfig, MicroBatchConfig, OptimConfig, Precision
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.policy import PolicyRole

    layout = ParallelLayout()
    init_distributed(layout)
    ctx = WorkerContext(0, 1, layout, layout.coords(0), "127.0.0.1", "local", 0, DEVICE)
    engine = EngineConfig(optim=OptimConfig(lr=lr, clip_grad=0.0), precision=Precision(precision),
                          micro_batch=MicroBatchConfig(max_tokens=16, max_size=2))
    return PolicyRole(ctx, checkpoint_dir=ckpt, engine=engine, algorithm=AlgorithmConfig(recompute_old_log_probs=True),
                      temperature=1.0, rollout=rollout)


def _prompts():
    from megarl.data.batch import Batch

    ids = torch.zeros(len(PROMPTS), max(map(len, PROMPTS)), dtype=torch.long)
    for i, p in enumerate(PROMPTS):
        ids[i, : len(p)] = torch.tensor(p)
    return Batch.from_dict({"prompt_ids": ids, "prompt_lengths": torch.tensor([len(p) for p in PROMPTS])})


def _cycle(role, temperature: float = 1.0):
    """sync -> generate -> to_train -> log-probs -> one update on positive advantages; the rows and the result."""
    from megarl.data.batch import Batch
    from megarl.rollout.base import SamplingParams

    sync = role.sync_weights()
    rows = role.generate(_prompts(), SamplingParams(temperature=temperature, max_new_tokens=MAX_NEW))
    role.to_train()
    batch = rows.select("input_ids", "attention_mask", "response_mask")
    lp = role.compute_log_probs(batch.select("input_ids", "attention_mask"))["log_probs"]
    train = batch.update(Batch.from_dict({"old_log_probs": lp, "advantages": batch["response_mask"].float()}))
    return sync, rows, lp, role.update(train)


@pytest.mark.parametrize("model", ["qwen2_untied", "qwen3_moe"])
def test_cycle_collectives_on_the_compute_device(tiny_hf, tmp_path, model):
    """A dense and an MoE policy (router statistics included) through sync, sampling, log-probs and an update:
    every tensor handed to a collective is on CUDA."""
    from megarl.checkpoint.convert import convert_hf_to_megatron
    from megarl.rollout.config import RolloutConfig

    convert_hf_to_megatron(tiny_hf(model), tmp_path / "mc")
    seen: Counter = Counter()
    with record_collectives(seen):
        role = _policy(str(tmp_path / "mc"), rollout=RolloutConfig(bucket_mb=0.05))
        _, _, _, result = _cycle(role)
    assert not result.step_skipped and result.grad_norm > 0
    off = {k: n for k, n in seen.items() if k[1] != "cuda"}
    assert seen and not off, f"collectives on another device than the compute device: {off} (all: {dict(seen)})"


def test_checkpoint_resume_is_bit_exact(tiny_hf, tmp_path):
    """Step 1, save, step 2 -> weights A; a fresh policy loads the checkpoint and repeats step 2 -> weights B == A."""
    from megarl.checkpoint.convert import convert_hf_to_megatron
    from megarl.data.batch import Batch

    torch.use_deterministic_algorithms(True, warn_only=True)  # the embedding's backward accumulates atomically
    convert_hf_to_megatron(tiny_hf("qwen2_untied"), tmp_path / "mc")
    ckpt = str(tmp_path / "mc")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 250, (4, 12), generator=g)
    mask = torch.ones_like(ids)
    resp = torch.zeros_like(ids)
    resp[:, 6:] = 1
    base = Batch.from_dict({"input_ids": ids, "attention_mask": mask, "response_mask": resp})

    def step(role, adv_sign: float):
        lp = role.compute_log_probs(base.select("input_ids", "attention_mask"))["log_probs"]
        adv = adv_sign * torch.randn(ids.shape, generator=torch.Generator().manual_seed(1)) * resp
        return role.update(base.update(Batch.from_dict({"old_log_probs": lp, "advantages": adv})))

    def weights(role):
        return {n: p.detach().float().cpu().clone() for c in role.engine.chunks for n, p in c.named_parameters()}

    first = _policy(ckpt)
    step(first, 1.0)
    first.save_checkpoint(str(tmp_path / "step1"), step=1, source_dir=ckpt)
    step(first, -1.0)
    a = weights(first)
    second = _policy(ckpt)
    assert second.load_checkpoint(str(tmp_path / "step1")) == 1
    step(second, -1.0)
    b = weights(second)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), [n for n in a if not torch.equal(a[n],
                                                                                                                b[n])]


@needs_vllm
def test_vllm_sleep_wake_sync_generate_twice(tiny_hf, tmp_path):
    """vLLM's CUDA engine in the policy's process: two cycles of sleep, wake, weight sync and sampling. Its sleep
    frees memory, and after an update its log-probs of its own samples equal the training engine's (fp32)."""
    from megarl.checkpoint.convert import convert_hf_to_megatron
    from megarl.engine.config import Precision
    from megarl.rollout.config import RolloutBackend, RolloutConfig

    convert_hf_to_megatron(tiny_hf("qwen2_vllm"), tmp_path / "mc")
    rollout = RolloutConfig(backend=RolloutBackend.VLLM, dtype=Precision.FP32, bucket_mb=0.05,
                            gpu_memory_utilization=0.2, max_model_len=64)
    role = _policy(str(tmp_path / "mc"), precision="float32", rollout=rollout, lr=1e-2)
    diffs = []
    for _ in range(2):
        sync, rows, lp, result = _cycle(role)
        assert sync.sleep_frees_memory and not result.step_skipped
        resp = rows["response_mask"].bool()
        diffs.append((rows["rollout_log_probs"][resp] - lp[resp]).abs().mean().item())
    assert max(diffs) < 1e-3, diffs  # the second cycle samples with the updated weights
    role.close()


@needs_vllm
def test_colocated_vllm_starts_at_the_planned_utilization(tiny_hf, tmp_path):
    """A colocated policy at a realistic memory ratio: the GPU is filled to the share a 7B policy + reference at
    TP2 leave free on 80 GB (the planner's build phase without vLLM), then vLLM starts at the planner's
    utilization of that workload scaled to this GPU: its start-up check passes (v1/worker/utils.py)."""
    from megarl.checkpoint.convert import convert_hf_to_megatron
    from megarl.engine.config import Precision
    from megarl.parallel.layout import ParallelLayout
    from megarl.planner import Cluster, Phase, Role, Workload, plan_layout, preset_spec
    from megarl.rollout.config import RolloutBackend, RolloutConfig

    plan = plan_layout(preset_spec("qwen2.5-7b"), Cluster(1, 8, 80), Workload(roles=(Role.POLICY, Role.REFERENCE)),
                       ParallelLayout.for_world(8, tp=2), 2)
    build = next(p for p in plan.peaks if p.phase is Phase.BUILD)
    others = sum(v for (owner, _), v in build.terms.items() if owner not in ("rollout", "reserved")) / plan.capacity
    free, total = torch.cuda.mem_get_info()
    ballast = torch.empty(int(others * total), dtype=torch.uint8, device="cuda")  # the training state's share
    convert_hf_to_megatron(tiny_hf("qwen2_vllm"), tmp_path / "mc")
    rollout = RolloutConfig(backend=RolloutBackend.VLLM, dtype=Precision.BF16, bucket_mb=0.05,
                            gpu_memory_utilization=plan.gpu_memory_utilization, max_model_len=64)
    role = _policy(str(tmp_path / "mc"), rollout=rollout)
    sync, rows, _, _ = _cycle(role)
    assert sync.sleep_frees_memory and rows["response_mask"].sum() > 0
    role.close()
    del ballast
