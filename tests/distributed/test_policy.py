"""PolicyRole on megatron-core (no Ray: a spawned 4-process gloo world, then a world of one here).

References are independent: `transformers` forward + torch.log_softmax for log-probs, and autograd of
the clipped PPO objective written out in plain torch on the HF model for loss and gradients.
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


def _batch_tensors():
    """6 right-padded rows with mixed prompt / response lengths."""
    g = torch.Generator().manual_seed(11)
    prompts, responses = [3, 8, 5, 2, 6, 4], [9, 2, 6, 10, 4, 7]
    s = max(p + r for p, r in zip(prompts, responses, strict=True))
    ids = torch.zeros(6, s, dtype=torch.long)
    attn, resp = torch.zeros(6, s), torch.zeros(6, s)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, : p + r] = torch.randint(5, 300, (p + r,), generator=g)
        attn[i, : p + r] = 1
        resp[i, p : p + r] = 1
    advantages = torch.randn(6, s, generator=g) * resp
    noise = torch.randn(6, s, generator=g) * 0.3 * resp
    return ids, attn, resp, advantages, noise


def _hf_reference(hf_dir):
    """Token log-probs, PPO loss and gradients (Megatron layout) from the HF model, in fp32."""
    from transformers import AutoModelForCausalLM

    from megarl.models import mapping
    from megarl.models.spec import load_hf_config, spec_from_hf_config
    from megarl.testing.reference import hf_ppo_backward

    ids, attn, resp, adv, noise = _batch_tensors()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    lp, old, loss = hf_ppo_backward(model, ids, attn, resp, adv, noise, CLIP)
    spec = spec_from_hf_config(load_hf_config(hf_dir))
    params = dict(model.named_parameters())
    grads, weights = {}, {}
    for m in mapping.tensor_maps(spec):
        padded = spec.padded_vocab_size(1)
        grads[m.mcore] = mapping.to_mcore(m, spec, [params[n].grad for n in m.hf], padded)
        weights[m.mcore] = mapping.to_mcore(m, spec, [params[n].detach() for n in m.hf], padded)
    return lp, old, loss, grads, weights


def _world(rank, world_size, ckpt, old_log_probs):
    from megarl.algos.config import AlgorithmConfig
    from megarl.controller.role import WorkerContext
    from megarl.data.batch import Batch
    from megarl.engine.config import EngineConfig, MicroBatchConfig, OptimConfig, OptimizerName
    from megarl.models.provider import global_named_parameters
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.policy import PolicyRole, ReferenceRole

    ids, attn, resp, adv, _ = _batch_tensors()
    engine = EngineConfig(
        # momentum: its first step equals plain SGD (buffer = grad) and gives the optimizer a state to offload
        optim=OptimConfig(optimizer=OptimizerName.SGD, lr=LR, sgd_momentum=0.9, clip_grad=0.0,
                          use_distributed_optimizer=False),
        micro_batch=MicroBatchConfig(max_tokens=40, max_size=4),  # several micro-batches of different lengths
    )
    out = {}
    for name, (tp, pp) in {"tp2pp2": (2, 2), "tp1pp2dp2": (1, 2), "tp1pp1dp4": (1, 1), "ref_tp2pp2": (2, 2)}.items():
        layout = ParallelLayout.for_world(world_size, tp=tp, pp=pp)
        init_distributed(layout)
        coords = layout.coords(rank)
        ctx = WorkerContext(rank, world_size, layout, coords, "127.0.0.1", "local", 0, "cpu")
        if name.startswith("ref"):  # forward-only passes micro-batched on their own: one row each
            role = ReferenceRole(ctx, checkpoint_dir=ckpt, engine=dataclasses.replace(
                engine, forward_micro_batch=MicroBatchConfig(max_tokens=1000, max_size=1)), temperature=1.0)
        else:  # the PPO ratio against the given old_log_probs
            role = PolicyRole(ctx, checkpoint_dir=ckpt, engine=engine,
                              algorithm=AlgorithmConfig(recompute_old_log_probs=True), temperature=1.0)
        full = Batch.from_dict({"input_ids": ids, "attention_mask": attn, "response_mask": resp})
        calls: list[int] = []
        hook = role.engine.chunks[0].register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        lp = role.compute_log_probs(full)  # every DP rank gets the whole batch here
        hook.remove()
        res = {"coords": list(coords), "log_probs": lp["log_probs"].tolist() if lp is not None else None,
               "forward_micro_batches": len(calls)}
        if name in ("tp2pp2", "tp1pp2dp2"):
            old = torch.tensor(old_log_probs)  # the reference log-probs + noise, as a rollout would give
            train = Batch.from_dict({"input_ids": ids, "attention_mask": attn, "response_mask": resp,
                                     "old_log_probs": old, "advantages": adv})
            rows = train.chunk(layout.dp)[coords.dp]  # DP2: each rank half the rows (half the micro-batches)
            res["update"] = dataclasses.asdict(role.update(rows))  # results travel as JSON
            if coords.dp == 0:
                named = [(n, p) for c in role.engine.chunks for n, p in global_named_parameters(c)]
                res["grads"] = {n: p.main_grad.tolist() for n, p in named}
                res["params"] = {n: p.detach().tolist() for n, p in named}
            if name == "tp2pp2":
                res["offload"] = _offload_roundtrip(role)
                res["nonfinite"] = _nonfinite_steps(role, rows)
        out[name] = res
    return out


def _offload_roundtrip(role):
    """Snapshot parameters, gradients and optimizer state; offload (storages freed); reload; compare."""
    engine = role.engine
    groups = {"params": engine._params(), "grads": engine._grads(), "optimizer": engine._optimizer_tensors()}
    before = {k: [t.detach().clone() for t in ts] for k, ts in groups.items()}
    freed = engine.offload()
    emptied = all(t.untyped_storage().nbytes() == 0 for ts in groups.values() for t in ts)
    engine.reload()
    identical = {k: all(torch.equal(a, b) for a, b in zip(before[k], ts, strict=True)) for k, ts in groups.items()}
    return {"freed": freed, "emptied": emptied, "identical": identical,
            "counts": {k: len(v) for k, v in groups.items()}}


def _nonfinite_steps(role, batch):
    """NaN advantages: each step is skipped (parameters untouched) and counted; the 3rd in a row aborts."""
    from megarl.data.batch import Batch
    from megarl.engine.engine import NonFiniteError

    bad = batch.update(Batch.from_dict({"advantages": batch["advantages"] * float("nan")}))
    before = [p.detach().clone() for c in role.engine.chunks for p in c.parameters()]
    skipped = [role.update(bad).skipped_steps for _ in range(2)]
    unchanged = all(torch.equal(a, p) for a, p in zip(before, (p for c in role.engine.chunks for p in c.parameters()),
                                                       strict=True))
    try:
        role.update(bad)
        error = ""
    except NonFiniteError as e:
        error = str(e)
    return {"skipped": skipped, "unchanged": unchanged, "error": error}


@pytest.fixture(scope="module")
def hf_and_ckpt(tiny_hf, tmp_path_factory):
    hf = tiny_hf("llama_gqa")
    ckpt = tmp_path_factory.mktemp("policy") / "mc"
    convert_hf_to_megatron(hf, ckpt, tp=2, pp=2)
    return hf, ckpt


@pytest.fixture(scope="module")
def world(hf_and_ckpt):
    _, ckpt = hf_and_ckpt
    old = _hf_reference(hf_and_ckpt[0])[1]
    return run_world(_world, 4, str(ckpt), old.tolist(), timeout_s=900)


@pytest.fixture(scope="module")
def reference(hf_and_ckpt):
    return _hf_reference(hf_and_ckpt[0])


@pytest.mark.parametrize("layout", ["tp2pp2", "tp1pp2dp2", "tp1pp1dp4", "ref_tp2pp2"])
def test_log_probs_match_transformers(world, reference, layout):
    ref_lp = reference[0]
    reported = [r[layout]["log_probs"] for r in world if r[layout]["log_probs"] is not None]
    assert reported
    for lp in reported:
        # 1e-5 relative to the entry's size: this random tiny model's log-probs reach -23, where fp32 spacing is 2e-6
        err = ((torch.tensor(lp) - ref_lp).abs() / ref_lp.abs().clamp(min=1.0)).max().item()
        assert err < 1e-5


def test_forward_passes_use_their_own_micro_batches(world):
    # rows of 12, 10, 11, 12, 10, 11 tokens. Policy: the default forward batching, micro_batch's 40-token
    # budget (with 4 x its 4 rows), longest first: {12, 12, 11} (3 x 12 = 36 <= 40), then {11, 10, 10}.
    # Reference: forward_micro_batch of one row each: 6.
    for r in world:
        assert {name: res["forward_micro_batches"] for name, res in r.items()} == {
            "tp2pp2": 2, "tp1pp2dp2": 2, "tp1pp1dp4": 2, "ref_tp2pp2": 6}


def _gather(world, layout, key):
    """Full Megatron tensors from the TP shards reported by DP rank 0 of every stage."""
    from megarl.models import mapping
    from megarl.models.spec import load_hf_config, spec_from_hf_config

    shards: dict[str, dict[int, torch.Tensor]] = {}
    for r in world:
        res = r[layout]
        if key in res:
            for name, t in res[key].items():
                shards.setdefault(name, {})[res["coords"][0]] = torch.tensor(t)
    return shards, mapping, spec_from_hf_config, load_hf_config


@pytest.mark.parametrize("layout", ["tp2pp2", "tp1pp2dp2"])
def test_ppo_update_loss_gradients_and_sgd_step_match_reference(world, reference, hf_and_ckpt, layout):
    from megarl.engine.results import StepResult
    from megarl.models import mapping
    from megarl.models.spec import load_hf_config, spec_from_hf_config

    _, _, ref_loss, ref_grads, ref_weights = reference
    spec = spec_from_hf_config(load_hf_config(hf_and_ckpt[0]))
    maps = {m.mcore: m for m in mapping.tensor_maps(spec)}
    for r in world:
        result = StepResult(**r[layout]["update"])
        assert abs(result.terms["pg_loss"] - ref_loss) < 1e-5 * max(1.0, abs(ref_loss))
    for key, ref in (("grads", ref_grads), ("params", None)):
        shards, *_ = _gather(world, layout, key)
        assert set(shards) == set(maps)
        for name, by_tp in shards.items():
            full = mapping.tp_gather(maps[name], [by_tp[t] for t in sorted(by_tp)])
            full = full[: ref_grads[name].shape[0]] if full.shape[0] > ref_grads[name].shape[0] else full
            expected = ref[name] if key == "grads" else ref_weights[name] - LR * ref_grads[name]
            rel = (full - expected).norm() / expected.norm().clamp(min=1e-12)
            assert rel < 1e-5, f"{layout} {key} {name}: relative error {rel:.2e}"


def test_nonfinite_steps_are_skipped_counted_and_abort(world):
    for r in world:
        res = r["tp2pp2"]["nonfinite"]
        assert res["skipped"] == [1.0, 2.0] and res["unchanged"]
        assert "3 optimizer steps in a row had a NaN/inf" in res["error"]


def test_offload_reload_is_bit_identical_and_frees_storage(world):
    for r in world:
        res = r["tp2pp2"]["offload"]
        assert res["emptied"]
        assert res["identical"] == {"params": True, "grads": True, "optimizer": True}
        assert res["counts"]["grads"] == res["counts"]["params"] > 0
        assert res["freed"]["params"] > 0 and res["freed"]["grads"] > 0
        assert res["freed"]["optimizer"] > 0  # the momentum buffers


def test_tp1pp1dp1_update_in_a_world_of_one_matches_reference(hf_and_ckpt, reference):
    """The same update as a single process (TP1xPP1xDP1, all micro-batches on one rank)."""
    from megarl.algos.config import AlgorithmConfig
    from megarl.controller.role import WorkerContext
    from megarl.data.batch import Batch
    from megarl.engine.config import EngineConfig, MicroBatchConfig, OptimConfig, OptimizerName
    from megarl.models import mapping
    from megarl.models.provider import global_named_parameters
    from megarl.models.spec import load_hf_config, spec_from_hf_config
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.policy import PolicyRole

    _, old, ref_loss, ref_grads, ref_weights = reference
    ids, attn, resp, adv, _ = _batch_tensors()
    layout = ParallelLayout()
    init_distributed(layout)
    ctx = WorkerContext(0, 1, layout, layout.coords(0), "127.0.0.1", "local", 0, "cpu")
    engine = EngineConfig(optim=OptimConfig(optimizer=OptimizerName.SGD, lr=LR, clip_grad=0.0,
                                            use_distributed_optimizer=False),
                          micro_batch=MicroBatchConfig(max_tokens=40, max_size=4))
    role = PolicyRole(ctx, checkpoint_dir=str(hf_and_ckpt[1]), engine=engine,
                      algorithm=AlgorithmConfig(recompute_old_log_probs=True), temperature=1.0)
    result = role.update(Batch.from_dict({"input_ids": ids, "attention_mask": attn, "response_mask": resp,
                                          "old_log_probs": old, "advantages": adv}))
    assert abs(result.terms["pg_loss"] - ref_loss) < 1e-5 * max(1.0, abs(ref_loss))
    spec = spec_from_hf_config(load_hf_config(hf_and_ckpt[0]))
    maps = {m.mcore: m for m in mapping.tensor_maps(spec)}
    for name, p in global_named_parameters(role.engine.chunks[0]):
        rows = ref_grads[name].shape[0]
        grad, param = p.main_grad[:rows], p.detach()[:rows]
        assert maps[name] and (grad - ref_grads[name]).norm() / ref_grads[name].norm() < 1e-5, name
        expected = ref_weights[name] - LR * ref_grads[name]
        assert (param - expected).norm() / expected.norm() < 1e-5, name
