"""Offline objectives inside the Megatron engine (issue #44) against `transformers` autograd, in one spawned gloo
world of 4 at TP2 x DP2 and at PP2 x DP2 (megatron-core re-initialised between the two).

A policy takes four SGD steps in a row: SFT (token-mean NLL of the response tokens), DPO with the sigmoid loss,
DPO with TRL's length-normalised IPO loss and KTO (rows unpaired, with labels and a given KL estimate); the DPO
steps on pairs of rows (chosen, rejected) split over the data-parallel ranks and over several micro-batches (each
pair kept in one); a sequence classifier takes one Bradley-Terry step
(with per-pair margins and the centering term). The reference writes each loss out on transformers' float32
log-probs / scores (never through megarl's objectives), steps SGD by hand, and gives every loss, TRL's metrics and
every weight after the steps, and each step's gradient norm (every tensor-parallel shard counted once: a weight
loaded without megatron-core's initialisation once lacked its split mark and TP2's norm came out 0.9x); each
layout must equal it (1e-5 relative), so the two layouts equal each other too.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from megarl.checkpoint.convert import convert_hf_to_megatron
from megarl.testing.dist import run_world

pytestmark = pytest.mark.dist

LR = 0.1
BETA = 0.2
CENTER = 0.05
KTO_KL = 0.3  # the batch's KL estimate, formed by the driver (Run.kto_kl) and handed in
LABELS = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]  # KTO: desirable rows
WEIGHTS = (1.0, 1.5)  # desirable, undesirable
LAYOUTS = [dict(tp=2), dict(pp=2)]  # x dp 2 in a world of 4


def _rows():
    """4 pairs = 8 right-padded rows (chosen, rejected, ...), prompts of 3-4 tokens, responses of 2-8 tokens."""
    g = torch.Generator().manual_seed(11)
    prompts = [3, 4, 3, 4, 3, 3, 4, 4]
    lengths = [9, 6, 12, 7, 5, 10, 11, 8]
    ids = torch.zeros(8, 12, dtype=torch.long)
    attn = (torch.arange(12) < torch.tensor(lengths)[:, None]).float()
    ids[attn.bool()] = torch.randint(5, 300, (int(attn.sum()),), generator=g)
    for k in range(0, 8, 2):  # a pair shares its prompt
        ids[k + 1, :prompts[k]] = ids[k, :prompts[k]]
    resp = attn.clone()
    for i, p in enumerate(prompts):
        resp[i, :p] = 0
    margins = torch.tensor([0.5, 0.5, -0.2, -0.2, 1.0, 1.0, 0.0, 0.0])
    return ids, attn, resp, margins


def _to_mcore(spec, tensors):
    from megarl.models import mapping

    return {m.mcore: mapping.to_mcore(m, spec, [tensors[n] for n in m.hf], spec.padded_vocab_size(1))
            for m in mapping.tensor_maps(spec)}


def _seq_logps(model, ids, attn, resp):
    logits = model(ids, attention_mask=attn.long()).logits.float()
    lp = torch.zeros_like(attn)
    lp[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return lp * resp


def _grad_norm(model):
    return math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters()))


def _sgd(model):
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
            p.grad = None


def _policy_reference(hf_dir, ref_logps):
    from transformers import AutoModelForCausalLM

    from megarl.models.spec import load_hf_config, spec_from_hf_config

    ids, attn, resp, _ = _rows()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    steps = []
    lp = _seq_logps(model, ids, attn, resp)  # SFT: TRL's sum over label tokens / their number
    loss = -lp.sum() / resp.sum()
    loss.backward()
    steps.append({"loss": loss.item(), "grad_norm": _grad_norm(model)})
    _sgd(model)
    counts = resp.sum(-1)
    for kind in ("sigmoid", "ipo"):
        logps = _seq_logps(model, ids, attn, resp).sum(-1)
        c, r = logps[0::2], logps[1::2]
        rc, rr = ref_logps[0::2], ref_logps[1::2]
        if kind == "sigmoid":
            losses = -F.logsigmoid(BETA * ((c - rc) - (r - rr)))
        else:  # TRL 1.16: each log-ratio over its completion's tokens, then (delta - 1 / (2 beta))^2
            losses = ((c - rc) / counts[0::2] - (r - rr) / counts[1::2] - 1 / (2 * BETA)) ** 2
        loss = losses.mean()
        loss.backward()
        cw, rw = BETA * (c - rc).detach(), BETA * (r - rr).detach()
        steps.append({"loss": loss.item(), "rewards/chosen": cw.mean().item(), "rewards/rejected": rw.mean().item(),
                      "rewards/accuracies": (cw > rw).float().mean().item(), "rewards/margins": (cw - rw).mean().item(),
                      "logps/chosen": c.mean().item(), "logps/rejected": r.mean().item(),
                      "grad_norm": _grad_norm(model)})
        _sgd(model)
    logps = _seq_logps(model, ids, attn, resp).sum(-1)  # KTO, TRL 1.16's formula written out
    ratio, labels = logps - ref_logps, torch.tensor(LABELS).bool()
    terms = torch.where(labels, WEIGHTS[0] * (1 - torch.sigmoid(BETA * (ratio - KTO_KL))),
                        WEIGHTS[1] * (1 - torch.sigmoid(BETA * (KTO_KL - ratio))))
    loss = terms.mean()
    loss.backward()
    rewards = BETA * ratio.detach()
    chosen, rejected = rewards[labels].mean().item(), rewards[~labels].mean().item()
    steps.append({"loss": loss.item(), "kl": KTO_KL, "rewards/chosen": chosen, "rewards/rejected": rejected,
                  "rewards/margins": chosen - rejected, "logps/chosen": logps[labels].mean().item(),
                  "logps/rejected": logps[~labels].mean().item(), "grad_norm": _grad_norm(model)})
    _sgd(model)
    spec = spec_from_hf_config(load_hf_config(hf_dir))
    return steps, _to_mcore(spec, {n: p.detach() for n, p in model.named_parameters()})


def _rm_reference(hf_dir):
    from transformers import AutoModelForSequenceClassification

    from megarl.models.spec import load_hf_config, spec_from_hf_config

    ids, attn, _, margins = _rows()
    rm = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32)
    scores = rm(ids, attention_mask=attn.long()).logits.squeeze(-1)  # at each row's last real token
    c, r = scores[0::2], scores[1::2]
    loss = -F.logsigmoid(c - r - margins[0::2]).mean() + CENTER * ((c + r) ** 2).mean()
    loss.backward()
    s = scores.detach()
    metrics = {"loss": loss.item(), "accuracy": (c > r).float().mean().item(), "margin": (c - r).mean().item(),
               "mean_reward": s.mean().item(), "min_reward": s.min().item(), "max_reward": s.max().item(),
               "grad_norm": _grad_norm(rm)}
    _sgd(rm)
    spec = spec_from_hf_config(load_hf_config(hf_dir))
    return metrics, _to_mcore(spec, {n: p.detach() for n, p in rm.named_parameters()})


def _world(rank, world_size, lm_ckpt, rm_ckpt, ref_logps):
    from megarl.algos.config import AlgorithmConfig
    from megarl.algos.offline import BradleyTerryObjective, DPOObjective, KTOObjective, SFTObjective
    from megarl.algos.preference import DPOLoss
    from megarl.controller.role import WorkerContext
    from megarl.data.batch import Batch
    from megarl.engine.config import EngineConfig, MicroBatchConfig, OptimConfig, OptimizerName
    from megarl.models.provider import global_named_parameters
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.critic import CriticRole
    from megarl.roles.policy import PolicyRole

    ids, attn, resp, margins = _rows()
    engine = EngineConfig(
        optim=OptimConfig(optimizer=OptimizerName.SGD, lr=LR, clip_grad=0.0, use_distributed_optimizer=False),
        micro_batch=MicroBatchConfig(max_tokens=24, max_size=2))  # one pair per micro-batch
    out = []
    for kw in LAYOUTS:
        layout = ParallelLayout.for_world(world_size, **kw)
        init_distributed(layout)
        coords = layout.coords(rank)
        ctx = WorkerContext(rank, world_size, layout, coords, "127.0.0.1", "local", 0, "cpu")
        full = Batch.from_dict({"input_ids": ids, "attention_mask": attn, "response_mask": resp,
                                "ref_logps": torch.tensor(ref_logps), "margin": margins,
                                "label": torch.tensor(LABELS), "kto_kl": torch.full((8,), KTO_KL)})
        shard = full.chunk(layout.dp)[coords.dp]
        policy = PolicyRole(ctx, checkpoint_dir=lm_ckpt, engine=engine, algorithm=AlgorithmConfig(), temperature=1.0)
        steps = []
        for objective in (SFTObjective(), DPOObjective(beta=BETA), DPOObjective(beta=BETA, loss_type=DPOLoss.IPO),
                          KTOObjective(beta=BETA, desirable_weight=WEIGHTS[0], undesirable_weight=WEIGHTS[1])):
            result = policy.train(shard, objective)
            steps.append(result.metrics("") | objective.report(dict(result.terms)))
        lm_params = {n: p.detach().tolist() for c in policy.engine.chunks for n, p in global_named_parameters(c)}
        del policy
        critic = CriticRole(ctx, checkpoint_dir=rm_ckpt, engine=engine, value_clip=None)
        objective = BradleyTerryObjective(center_rewards_coefficient=CENTER)
        result = critic.train(shard, objective)
        rm = result.metrics("") | objective.report(dict(result.terms))
        rm_params = {n: p.detach().tolist() for c in critic.engine.chunks for n, p in global_named_parameters(c)}
        del critic
        out.append({"layout": kw, "tp": coords.tp, "steps": steps, "rm": rm, "lm_params": lm_params,
                    "rm_params": rm_params})
    return out


@pytest.fixture(scope="module")
def setup(tiny_hf, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    lm, rm = tiny_hf("qwen2_untied"), tiny_hf("qwen2_rm")
    root = tmp_path_factory.mktemp("offline_objectives")
    convert_hf_to_megatron(lm, root / "lm")
    convert_hf_to_megatron(rm, root / "rm")
    ids, attn, resp, _ = _rows()
    with torch.no_grad():  # the reference policy: the starting model, shifted per row so that the pairs differ
        start = _seq_logps(AutoModelForCausalLM.from_pretrained(lm, dtype=torch.float32), ids, attn, resp).sum(-1)
    ref_logps = start + torch.tensor([0.3, -0.4, 0.1, 0.6, -0.5, 0.2, 0.0, -0.3])
    references = _policy_reference(lm, ref_logps), _rm_reference(rm)
    maps = _maps(lm), _maps(rm)
    return references, maps, run_world(_world, 4, str(root / "lm"), str(root / "rm"), ref_logps.tolist(),
                                       timeout_s=900)


def _maps(hf_dir):
    from megarl.models import mapping
    from megarl.models.spec import load_hf_config, spec_from_hf_config

    return {m.mcore: m for m in mapping.tensor_maps(spec_from_hf_config(load_hf_config(hf_dir)))}


def _close(got, expected, rel=1e-5, abs_=1e-6):
    return abs(got - expected) <= rel * abs(expected) + abs_


def _check_params(results, key, maps, expected):
    """Every weight after the steps (TP shards gathered, each pipeline stage's own layers, every DP replica)."""
    from megarl.models import mapping

    by_dp: dict[tuple, dict[str, dict[int, torch.Tensor]]] = {}
    for rank, r in enumerate(results):
        replica = by_dp.setdefault((rank // 2,) if r["layout"] == dict(tp=2) else (rank % 2,), {})
        for name, t in r[key].items():
            replica.setdefault(name, {})[r["tp"]] = torch.tensor(t)
    for replica in by_dp.values():
        assert set(replica) == set(expected)
        for name, shards in replica.items():
            values = ([mapping.tp_gather(maps[name], [shards[0], shards[1]])] if len(shards) == 2
                      and maps[name].tp_dim is not None else list(shards.values()))
            ref = expected[name]
            for v in values:
                rel = ((v[: ref.shape[0]] - ref).norm() / ref.norm()).item()
                assert rel < 1e-5, f"{key} {name}: relative error {rel:.2e}"


@pytest.mark.parametrize("layout", range(len(LAYOUTS)), ids=["tp2_dp2", "pp2_dp2"])
def test_sft_dpo_and_kto_steps_equal_transformers(setup, layout):
    ((steps, weights), _), (lm_maps, _), world = setup
    results = [r[layout] for r in world]
    for r in results:
        for i, (got, expected) in enumerate(zip(r["steps"], steps, strict=True)):
            # KTO's implicit rewards are beta times differences of ~50-nat sums: 1e-5 of those sums, not of the
            # difference; its gradient (through sigma of those differences, after three steps) to 1e-4
            scale = BETA * max(abs(v) for k, v in expected.items() if k.startswith("logps/")) if "kl" in expected \
                else 0.0
            for name, value in expected.items():
                tol = 1e-5 * scale if name.startswith("rewards/") else 1e-6
                rel = 1e-4 if name == "grad_norm" and "kl" in expected else 1e-5
                assert _close(got[name], value, rel, max(tol, 1e-6)), (r["layout"], i, name, got[name], value)
        assert math.isfinite(r["steps"][0]["entropy"]) and r["steps"][0]["grad_norm"] > 0
    assert steps[1]["rewards/accuracies"] not in (0.0, 1.0)  # the batch tells right from wrong pairs
    _check_params(results, "lm_params", lm_maps, weights)


@pytest.mark.parametrize("layout", range(len(LAYOUTS)), ids=["tp2_dp2", "pp2_dp2"])
def test_reward_model_step_equals_transformers(setup, layout):
    (_, (metrics, weights)), (_, rm_maps), world = setup
    results = [r[layout] for r in world]
    for r in results:
        for name, value in metrics.items():
            assert _close(r["rm"][name], value), (r["layout"], name, r["rm"][name], value)
    _check_params(results, "rm_params", rm_maps, weights)
