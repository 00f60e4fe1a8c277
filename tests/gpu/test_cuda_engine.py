"""The policy worker on a GPU (skipped without one): engine passes, the hybrid weight sync and the
embedded rollout engine on CUDA, in a NCCL world of one.

References: the HF checkpoint's safetensors (weights after a sync, bit-exact), `transformers` on the
same GPU (greedy tokens and log-probs), and the sign of a policy-gradient step (positive advantages
raise the sampled tokens' log-probs). ``check_policy_worker`` also runs on CPU (device "cpu").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

PROMPTS = [[5, 17, 42], [8, 9], [100, 3, 4, 77, 12], [250]]
MAX_NEW = 6


def check_policy_worker(ckpt: str, hf_dir: str, device: str, precision: str) -> dict:
    """Sync, greedy generation, log-probs and one update on ``device``; returns what the asserts need."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megarl.algos.config import AlgorithmConfig
    from megarl.controller.role import WorkerContext
    from megarl.data.batch import Batch
    from megarl.engine.config import EngineConfig, MicroBatchConfig, OptimConfig, Precision
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.policy import PolicyRole
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.config import RolloutConfig

    layout = ParallelLayout()
    init_distributed(layout)
    ctx = WorkerContext(0, 1, layout, layout.coords(0), "127.0.0.1", "local", 0, device)
    engine = EngineConfig(optim=OptimConfig(lr=1e-3, clip_grad=0.0), precision=Precision(precision),
                          micro_batch=MicroBatchConfig(max_tokens=16, max_size=2))  # several micro-batches
    rollout = RolloutConfig(dtype=Precision(precision), bucket_mb=0.05)
    # the update below takes its PPO ratio's denominator from old_log_probs (this function's own forward)
    role = PolicyRole(ctx, checkpoint_dir=ckpt, engine=engine, algorithm=AlgorithmConfig(recompute_old_log_probs=True),
                      temperature=1.0, rollout=rollout)
    res: dict = {}

    role.sync_weights()
    hf = load_file(str(Path(hf_dir) / "model.safetensors"))
    state = role.rollout.rollout.model.state_dict()
    res["weights_exact"] = all(torch.equal(state[n].cpu(), hf[n].to(state[n].dtype)) for n in hf)
    res["weights_device"] = {str(t.device) for t in state.values()}
    res["train_params_offloaded"] = all(p.untyped_storage().nbytes() == 0 for c in role.engine.chunks
                                        for p in c.parameters()) if device.startswith("cuda") else None
    role.to_train()

    width = max(map(len, PROMPTS))
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    for i, p in enumerate(PROMPTS):
        ids[i, : len(p)] = torch.tensor(p)
    prompts = Batch.from_dict({"prompt_ids": ids, "prompt_lengths": torch.tensor([len(p) for p in PROMPTS])})
    role.sync_weights()
    rows = role.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))
    role.to_train()
    res["greedy"] = [row[row != 0].tolist() for row in rows["input_ids"]]  # prompts contain no 0

    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()
    res["expected"] = [ref.generate(torch.tensor([p], device=device), max_new_tokens=MAX_NEW, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0].tolist() for p in PROMPTS]
    batch = rows.select("input_ids", "attention_mask", "response_mask")
    ours = role.compute_log_probs(batch.select("input_ids", "attention_mask"))["log_probs"]
    mask = batch["response_mask"][:, 1:].bool()

    def hf_log_probs(model) -> torch.Tensor:  # of the response tokens, float64, on the host
        with torch.no_grad():
            logits = model(batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)).logits
        lp = torch.log_softmax(logits.double()[:, :-1], -1).gather(-1, batch["input_ids"].to(device)[:, 1:, None])
        return lp[..., 0].cpu()[mask]

    exact = hf_log_probs(ref)
    err = (ours[:, 1:][mask].double() - exact).abs()
    res["log_prob_max_diff"], res["log_prob_mean_diff"] = err.max().item(), err.mean().item()
    # the same checkpoint in transformers at this precision: the rounding error a correct bf16 model has
    same_dtype = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, precision)).to(device).eval()
    res["hf_mean_diff"] = (hf_log_probs(same_dtype) - exact).abs().mean().item()
    res["log_probs_device"] = str(ours.device)

    adv = batch["response_mask"].float()  # +1 on every response token
    train = batch.update(Batch.from_dict({"old_log_probs": ours, "advantages": adv}))
    res["update"] = role.update(train)
    after = role.compute_log_probs(batch.select("input_ids", "attention_mask"))["log_probs"]
    resp = batch["response_mask"].bool()
    res["mean_lp_before"], res["mean_lp_after"] = ours[resp].mean().item(), after[resp].mean().item()
    return res


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_policy_worker_on_cuda(tiny_hf, tmp_path, precision):
    from megarl.checkpoint.convert import convert_hf_to_megatron

    hf = tiny_hf("qwen2_untied")
    convert_hf_to_megatron(hf, tmp_path / "mc")
    r = check_policy_worker(str(tmp_path / "mc"), str(hf), "cuda:0", precision)
    assert r["weights_exact"] and r["weights_device"] == {"cuda:0"}
    assert r["train_params_offloaded"]  # during rollout the training weights left the GPU
    if precision == "float32":  # bf16 greedy decoding may flip near-ties
        assert r["greedy"] == r["expected"]
        assert r["log_prob_max_diff"] < 1e-4
    else:  # against float32 transformers: no further off than transformers itself in bf16
        assert r["log_prob_mean_diff"] < 1.5 * r["hf_mean_diff"] + 1e-3, r
    assert r["log_probs_device"] == "cpu"  # results go back to the host
    assert r["update"].step_skipped is False and r["update"].grad_norm > 0
    assert r["mean_lp_after"] > r["mean_lp_before"]
