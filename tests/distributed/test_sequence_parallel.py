"""Dense models with megatron-core's sequence parallelism (``sequence_parallel: true``) at TP2xPP2, against
`transformers` (no Ray: a spawned 4-process gloo world).

Sequence parallelism splits the activations between the tensor-parallel regions along the sequence; every
micro-batch is padded to a multiple of tp tokens, and the norms' (replicated) gradients are summed over TP.
None of it may change a number: a Qwen3 policy (q/k norms too) gives transformers' log-probs, one PPO update's
gradients and SGD step, and a critic (replicated scalar head, which gathers the sequence) one update's loss and
SGD step, on rows whose lengths are not multiples of 2. MoE models at TP2 (where it is on by default) are
tested in test_moe_training.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megarl.checkpoint.convert import convert_hf_to_megatron
from megarl.testing.dist import run_world

pytestmark = pytest.mark.dist

LR = 0.5
CLIP = 0.2


def _batch():
    """6 right-padded rows of 13, 10, 11, 12, 9 and 11 tokens (response: from token 3 on), the pad id inside 3."""
    g = torch.Generator().manual_seed(7)
    lengths = [13, 10, 11, 12, 9, 11]
    ids = torch.zeros(6, 13, dtype=torch.long)
    attn = (torch.arange(13) < torch.tensor(lengths)[:, None]).float()
    ids[attn.bool()] = torch.randint(5, 300, (int(attn.sum()),), generator=g)
    ids[0, 5] = ids[3, 8] = ids[4, 2] = 0  # the pad token inside rows: its embedding row trains as in transformers
    resp = attn.clone()
    resp[:, :3] = 0
    advantages = torch.randn(6, 13, generator=g) * resp
    noise = torch.randn(6, 13, generator=g) * 0.3 * resp
    returns = torch.randn(6, 13, generator=g) * resp
    return ids, attn, resp, advantages, noise, returns


def _to_mcore(spec, tensors):
    from megarl.models import mapping

    return {m.mcore: mapping.to_mcore(m, spec, [tensors[n] for n in m.hf], spec.padded_vocab_size(1))
            for m in mapping.tensor_maps(spec)}


def _policy_reference(hf_dir):
    """Log-probs, old log-probs (+ noise), PPO loss, gradients and weights (Megatron names), from transformers."""
    from transformers import AutoModelForCausalLM

    from megarl.models.spec import load_hf_config, spec_from_hf_config
    from megarl.testing.reference import hf_ppo_backward

    ids, attn, resp, adv, noise, _ = _batch()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    lp, old, loss = hf_ppo_backward(model, ids, attn, resp, adv, noise, CLIP)
    spec = spec_from_hf_config(load_hf_config(hf_dir))
    params = dict(model.named_parameters())
    return dict(log_probs=lp, old=old, loss=loss,
                grads=_to_mcore(spec, {n: p.grad for n, p in params.items()}),
                weights=_to_mcore(spec, {n: p.detach() for n, p in params.items()}))


def _critic_reference(hf_dir):
    """Values, old values (+ noise), clipped value loss and SGD-updated weights, from the HF sequence classifier."""
    from transformers import AutoModelForSequenceClassification

    from megarl.models.spec import load_hf_config, spec_from_hf_config

    ids, attn, resp, _, noise, returns = _batch()
    rm = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32)
    per_position = rm.score(rm.model(ids, attention_mask=attn.long()).last_hidden_state).squeeze(-1)
    values = torch.zeros_like(attn)
    values[:, 1:] = per_position[:, :-1]  # token-aligned: the value of the state before token i
    values = values * attn
    old = (values.detach() + noise) * resp
    clipped = old + (values - old).clamp(-0.2, 0.2)
    loss = 0.5 * (torch.maximum((values - returns) ** 2, (clipped - returns) ** 2) * resp).sum() / resp.sum()
    loss.backward()
    spec = spec_from_hf_config(load_hf_config(hf_dir))
    updated = _to_mcore(spec, {n: p.detach() - LR * p.grad for n, p in rm.named_parameters()})
    return dict(values=values.detach(), old=old, loss=loss.item(), updated=updated)


def _world(rank, world_size, lm_ckpt, rm_ckpt, old_log_probs, old_values):
    from megarl.algos.config import AlgorithmConfig
    from megarl.controller.role import WorkerContext
    from megarl.data.batch import Batch
    from megarl.engine.config import EngineConfig, MicroBatchConfig, OptimConfig, OptimizerName
    from megarl.models.provider import global_named_parameters
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.critic import CriticRole
    from megarl.roles.policy import PolicyRole

    layout = ParallelLayout(tp=2, pp=2)
    init_distributed(layout)
    ctx = WorkerContext(rank, world_size, layout, layout.coords(rank), "127.0.0.1", "local", 0, "cpu")
    engine = EngineConfig(
        optim=OptimConfig(optimizer=OptimizerName.SGD, lr=LR, clip_grad=0.0, use_distributed_optimizer=False),
        # updates: {13, 12, 11}, {11, 10, 9} -> widths 13 and 11, padded to 14 and 12
        micro_batch=MicroBatchConfig(max_tokens=40, max_size=3), sequence_parallel=True)
    ids, attn, resp, adv, _, returns = _batch()

    def named(role):
        return [(n, p) for c in role.engine.chunks for n, p in global_named_parameters(c)]

    policy = PolicyRole(ctx, checkpoint_dir=lm_ckpt, engine=engine,
                        algorithm=AlgorithmConfig(recompute_old_log_probs=True), temperature=1.0)
    lp = policy.compute_log_probs(Batch.from_dict({"input_ids": ids, "attention_mask": attn, "response_mask": resp}))
    update = policy.update(Batch.from_dict({"input_ids": ids, "attention_mask": attn, "response_mask": resp,
                                            "old_log_probs": torch.tensor(old_log_probs), "advantages": adv}))
    out = {"coords": list(layout.coords(rank)), "sequence_parallel": policy.engine.sequence_parallel,
           "log_probs": None if lp is None else lp["log_probs"].tolist(), "pg_loss": update.terms["pg_loss"],
           "grads": {n: p.main_grad.tolist() for n, p in named(policy)},
           "params": {n: p.detach().tolist() for n, p in named(policy)}}
    del policy
    critic = CriticRole(ctx, checkpoint_dir=rm_ckpt, engine=engine, value_clip=0.2)
    values = critic.compute_values(Batch.from_dict({"input_ids": ids, "attention_mask": attn}))
    result = critic.update(Batch.from_dict({"input_ids": ids, "attention_mask": attn, "response_mask": resp,
                                            "returns": returns, "old_values": torch.tensor(old_values)}))
    out["critic"] = {"values": None if values is None else values["values"].tolist(),
                     "vf_loss": result.terms["vf_loss"],
                     "params": {n: p.detach().tolist() for n, p in named(critic)}}
    return out


@pytest.fixture(scope="module")
def models(tiny_hf):
    return tiny_hf("qwen3"), tiny_hf("llama_rm")


@pytest.fixture(scope="module")
def references(models):
    return _policy_reference(models[0]), _critic_reference(models[1])


@pytest.fixture(scope="module")
def world(models, references, tmp_path_factory):
    root = tmp_path_factory.mktemp("sequence_parallel")
    convert_hf_to_megatron(models[0], root / "lm")
    convert_hf_to_megatron(models[1], root / "rm")
    policy, critic = references
    return run_world(_world, 4, str(root / "lm"), str(root / "rm"), policy["old"].tolist(), critic["old"].tolist(),
                     timeout_s=900)


def _relative(value, expected):
    return ((value - expected).norm() / expected.norm().clamp(min=1e-12)).item()


def _full_tensors(world, maps, key, sub=None):
    """{name: [full tensor]} gathered over the TP ranks (each pipeline stage reports its own layers); replicated
    tensors (norms, the scalar head): {name: [TP rank 0's, TP rank 1's]}, each to be checked."""
    from megarl.models import mapping

    shards: dict[str, dict[int, torch.Tensor]] = {}
    for r in world:
        for name, t in (r[sub] if sub else r)[key].items():
            shards.setdefault(name, {})[r["coords"][0]] = torch.tensor(t)
    out = {}
    for name, by_tp in shards.items():
        assert sorted(by_tp) == [0, 1], name
        shards_in_order = [by_tp[0], by_tp[1]]
        out[name] = shards_in_order if maps[name].tp_dim is None else [mapping.tp_gather(maps[name], shards_in_order)]
    return out


@pytest.fixture(scope="module")
def maps(models):
    from megarl.models import mapping
    from megarl.models.spec import load_hf_config, spec_from_hf_config

    return [{m.mcore: m for m in mapping.tensor_maps(spec_from_hf_config(load_hf_config(hf)))} for hf in models]


def test_policy_log_probs_match_transformers(world, references):
    assert all(r["sequence_parallel"] for r in world)
    ref = references[0]["log_probs"]
    reported = [r["log_probs"] for r in world if r["log_probs"] is not None]
    assert len(reported) == 1  # dp 1: TP rank 0 of the last stage
    err = ((torch.tensor(reported[0]) - ref).abs() / ref.abs().clamp(min=1.0)).max().item()
    assert err < 1e-5


def test_policy_update_gradients_and_sgd_step_match_transformers(world, references, maps):
    ref = references[0]
    for r in world:
        assert r["pg_loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-5)
    for key in ("grads", "params"):
        full = _full_tensors(world, maps[0], key)
        assert set(full) == set(ref["grads"])
        for name, values in full.items():
            expected = ref["grads"][name] if key == "grads" else ref["weights"][name] - LR * ref["grads"][name]
            for value in values:
                rel = _relative(value[: expected.shape[0]], expected)  # vocabulary padding
                assert rel < 1e-5, f"{key} {name}: relative error {rel:.2e}"


def test_critic_values_and_update_match_transformers(world, references, maps):
    ref = references[1]
    reported = [r["critic"]["values"] for r in world if r["critic"]["values"] is not None]
    assert len(reported) == 1
    err = ((torch.tensor(reported[0]) - ref["values"]).abs() / ref["values"].abs().clamp(min=1.0)).max().item()
    assert err < 1e-5
    for r in world:
        assert r["critic"]["vf_loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-5)
    full = _full_tensors(world, maps[1], "params", "critic")
    assert set(full) == set(ref["updated"])
    for name, values in full.items():
        for value in values:
            rel = _relative(value[: ref["updated"][name].shape[0]], ref["updated"][name])
            assert rel < 1e-5, f"{name}: relative error {rel:.2e}"


def test_dataclass_default_is_moe_only():
    from megarl.engine.config import EngineConfig

    default = EngineConfig()
    assert default.sequence_parallel is None
    assert default.uses_sequence_parallel(moe=True, tp=2) and not default.uses_sequence_parallel(moe=False, tp=2)
    assert not default.uses_sequence_parallel(moe=True, tp=1)
    forced = dataclasses.replace(default, sequence_parallel=True)
    assert forced.uses_sequence_parallel(moe=False, tp=2) and not forced.uses_sequence_parallel(moe=False, tp=1)
    assert not dataclasses.replace(default, sequence_parallel=False).uses_sequence_parallel(moe=True, tp=2)
