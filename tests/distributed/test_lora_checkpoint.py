"""A LoRA run's checkpoint (adapters only) resumes bit-exactly and exports to HF peft and to merged HF weights.

One spawned gloo world of 2 at TP2: a rank-4 LoRA policy on every target trains 3 SFT updates with Adam, saves a
checkpoint and computes its log-probs, then takes 2 more updates; a fresh policy built from the base checkpoint
loads the saved one and takes the same 2 updates; then, re-initialised at TP1 x DP2, a third loads it too.
References, independent of megarl's adapters:

- the resumed adapters equal the uninterrupted ones bit for bit, and the LR schedule resumed;
- at TP1 the loaded adapters are the TP2 shards gathered (``mapping.tp_gather``: fc1's ``B`` as ``[gate; up]``);
- the checkpoint's weights hold the factors and their Adam moments only (its dist-checkpoint metadata), and its
  megarl_checkpoint.json records the adapter and the base's absolute path;
- the peft export, loaded with ``PeftModel.from_pretrained`` on the HF base, gives megarl's log-probs (1e-5
  relative), which the base model does not (negative control);
- the merged export, loaded with transformers, has peft's ``merge_and_unload()`` weights (1e-6 relative) and the
  same log-probs.

(tests/unit/test_lora_checkpoint_errors.py: the errors where a LoRA checkpoint is given for something else.)
"""

from __future__ import annotations

import json

import pytest
import torch

from megarl.checkpoint.convert import convert_hf_to_megatron
from megarl.testing.dist import run_world

pytestmark = pytest.mark.dist

RANK, ALPHA = 4, 8.0


def _rows():
    g = torch.Generator().manual_seed(3)
    lengths = [9, 6, 12, 7, 5, 10, 11, 8]
    ids = torch.zeros(8, 12, dtype=torch.long)
    attn = (torch.arange(12) < torch.tensor(lengths)[:, None]).float()
    ids[attn.bool()] = torch.randint(5, 300, (int(attn.sum()),), generator=g)
    resp = attn.clone()
    resp[:, :3] = 0
    return ids, attn, resp


def _critic(ctx, rm_base, rm_ckpt, engine, rows):
    """A LoRA reward model (adapters + its whole scalar head train): 2 Bradley-Terry steps, save, 1 more; a fresh
    one loads and takes the same step. Returns the names that came back equal and those that trained."""
    from megarl.algos.offline import BradleyTerryObjective
    from megarl.models.provider import global_named_parameters
    from megarl.roles.critic import CriticRole

    def trained(c):
        return {n: t.detach().clone() for ch in c.engine.chunks for n, t in global_named_parameters(ch)
                if t.requires_grad}

    first = CriticRole(ctx, checkpoint_dir=rm_base, engine=engine, value_clip=None)
    for _ in range(2):
        first.train(rows, BradleyTerryObjective())
    first.save_checkpoint(rm_ckpt, 2, rm_base)
    first.train(rows, BradleyTerryObjective())
    uninterrupted = trained(first)
    del first
    resumed = CriticRole(ctx, checkpoint_dir=rm_base, engine=engine, value_clip=None)
    resumed.load_checkpoint(rm_ckpt)
    resumed.train(rows, BradleyTerryObjective())
    again = trained(resumed)
    return {"trained": sorted(again), "equal": sorted(n for n in again if torch.equal(again[n], uninterrupted[n]))}


def _world(rank, world_size, base, ckpt, rm_base, rm_ckpt):
    from megarl.algos.config import AlgorithmConfig
    from megarl.algos.offline import SFTObjective
    from megarl.controller.role import WorkerContext
    from megarl.data.batch import Batch
    from megarl.engine.config import EngineConfig, LoRAConfig, LRDecay, MicroBatchConfig, OptimConfig
    from megarl.models import adapters
    from megarl.models.provider import global_named_parameters
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.policy import PolicyRole
    from megarl.testing.dist import from_collect_rank

    def context(layout):
        init_distributed(layout)
        return WorkerContext(rank, world_size, layout, layout.coords(rank), "127.0.0.1", "local", 0, "cpu")

    layout = ParallelLayout.for_world(world_size, tp=2)
    optim = OptimConfig(lr=1e-2, min_lr=1e-3, lr_warmup_steps=2, lr_decay=LRDecay.LINEAR, lr_decay_steps=4,
                        weight_decay=0.01)
    engine = EngineConfig(optim=optim, micro_batch=MicroBatchConfig(max_tokens=36, max_size=3),
                          lora=LoRAConfig(rank=RANK, alpha=ALPHA))
    ids, attn, resp = _rows()
    rows = Batch.from_dict({"input_ids": ids, "attention_mask": attn, "response_mask": resp})

    def policy(ctx):
        return PolicyRole(ctx, checkpoint_dir=base, engine=engine, algorithm=AlgorithmConfig(), temperature=1.0)

    def factors(p):
        return {n: t.detach().clone() for c in p.engine.chunks for n, t in global_named_parameters(c)
                if adapters.is_adapter(n)}

    first = policy(context(layout))
    for _ in range(3):
        first.train(rows, SFTObjective())
    first.save_checkpoint(ckpt, 3, base)
    saved = {n: t.tolist() for n, t in factors(first).items()}
    lp = first.compute_log_probs(rows, temperature=1.0)
    lp = from_collect_rank(None if lp is None else lp["log_probs"].tolist(), layout)
    lrs = [first.train(rows, SFTObjective()).lr for _ in range(2)]
    uninterrupted = factors(first)
    del first

    resumed = policy(context(layout))
    step = resumed.load_checkpoint(ckpt)
    resumed_lrs = [resumed.train(rows, SFTObjective()).lr for _ in range(2)]
    again = factors(resumed)
    del resumed

    critic = _critic(context(layout), rm_base, rm_ckpt, engine, rows)

    tp1 = policy(context(ParallelLayout.for_world(world_size, tp=1)))
    tp1.load_checkpoint(ckpt)
    return {"critic": critic, "lp": lp, "step": step, "lrs": lrs, "resumed_lrs": resumed_lrs, "factors": len(again),
            "equal": sorted(n for n in again if torch.equal(again[n], uninterrupted[n])),
            "moved": sum(not torch.equal(t, 0 * t) for n, t in again.items() if n.endswith("lora_B")),
            "saved": saved, "tp1": {n: t.tolist() for n, t in factors(tp1).items()}}


def _log_probs(model, ids, attn):
    with torch.no_grad():
        logits = model(ids, attention_mask=attn.long()).logits.float()
    lp = torch.zeros_like(attn)
    lp[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return lp * attn


def _rel(got, expected):
    got, expected = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    return ((got - expected).norm() / expected.norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def run(tiny_hf, tmp_path_factory):
    from megarl.checkpoint.convert import convert_megatron_to_hf
    from megarl.checkpoint.lora_export import export_peft

    hf = tiny_hf("qwen2_untied")
    root = tmp_path_factory.mktemp("lora_ckpt")
    convert_hf_to_megatron(hf, root / "base")
    convert_hf_to_megatron(tiny_hf("qwen2_rm"), root / "rm")
    world = run_world(_world, 2, str(root / "base"), str(root / "step3"), str(root / "rm"), str(root / "rm_step2"),
                      timeout_s=300)
    export_peft(root / "step3", root / "peft")
    convert_megatron_to_hf(root / "step3", root / "merged")
    return {"hf": hf, "root": root, "world": world}


def test_a_lora_reward_model_resumes_bit_exactly_with_its_head(run):
    for r in run["world"]:
        c = r["critic"]
        assert "output_layer.weight" in c["trained"] and len(c["trained"]) > 1
        assert c["equal"] == c["trained"]


def test_resume_is_bit_exact(run):
    for r in run["world"]:
        assert r["step"] == 3
        assert r["factors"] == 4 * 4 * 2  # 4 layers x (qkv, proj, fc1, fc2) x (A, B) on each TP rank
        assert len(r["equal"]) == r["factors"], "resumed adapters differ from the uninterrupted run's"
        assert r["moved"] == 4 * 4  # every B left 0: the updates were real
        assert r["resumed_lrs"] == r["lrs"] and r["lrs"][0] != r["lrs"][1]  # the LR schedule resumed (decaying)


def test_loads_at_another_tensor_parallel_size(run):
    from megarl.models import adapters, mapping
    from megarl.models.spec import load_hf_config, spec_from_hf_config

    maps = {m.mcore: m for m in mapping.tensor_maps(spec_from_hf_config(load_hf_config(run["hf"])))}
    tp1 = run["world"][0]["tp1"]
    assert len(tp1) == 4 * 4 * 2
    for name, got in tp1.items():
        m = maps[adapters.base_name(name)]
        shards = [torch.tensor(r["saved"][name]) for r in run["world"]]
        split = adapters.split_factor(m, name.rsplit(".", 1)[-1])
        assert torch.equal(torch.tensor(got), mapping.tp_gather(m, shards) if split else shards[0]), name


def test_checkpoint_holds_adapters_only_and_records_its_base(run):
    from megarl.checkpoint import mcore_io
    from megarl.checkpoint.format import LoRAMeta, read_meta
    from megarl.models import adapters
    from megarl.models.spec import load_hf_config, spec_from_hf_config

    ckpt = run["root"] / "step3"
    spec = spec_from_hf_config(load_hf_config(run["hf"]))
    factors = {adapters.factor_key(m, f) for m in adapters.adapted_maps(spec, ["qkv", "proj", "fc1", "fc2"])
               for f in adapters.FACTORS}
    assert len(factors) == 8  # stacked over layers
    keys = set(mcore_io.tensors_metadata(ckpt))
    model = {k for k in keys if not k.startswith("optimizer.")}
    assert model == factors
    optimizer = [k.split(".", 3) for k in keys - model]  # optimizer.state.<exp_avg>.<factor key>
    assert {k[2] for k in optimizer} == {"param", "exp_avg", "exp_avg_sq"}  # Adam's (fp32 main params, moments)
    assert {k[3] for k in optimizer} == factors
    meta = read_meta(ckpt)
    assert meta.lora == LoRAMeta(rank=RANK, alpha=ALPHA, dropout=0.0, targets=["qkv", "proj", "fc1", "fc2"],
                                 base=str(run["root"] / "base"))
    assert json.loads((ckpt / "megarl_checkpoint.json").read_text())["lora"]["base"] == str(run["root"] / "base")


def test_peft_export_gives_megarls_log_probs(run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids, attn, _ = _rows()
    lp = run["world"][0]["lp"]
    base = AutoModelForCausalLM.from_pretrained(run["hf"], dtype=torch.float32)
    assert _rel(_log_probs(base, ids, attn), lp) > 1e-3  # the adapters do change the model
    model = PeftModel.from_pretrained(base, run["root"] / "peft")
    assert _rel(_log_probs(model, ids, attn), lp) < 1e-5


def test_merged_export_is_peft_merged(run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(run["hf"], dtype=torch.float32)
    expected = PeftModel.from_pretrained(base, run["root"] / "peft").merge_and_unload().state_dict()
    merged = AutoModelForCausalLM.from_pretrained(run["root"] / "merged", dtype=torch.float32)
    got = merged.state_dict()
    assert sorted(got) == sorted(expected)
    for name, t in expected.items():
        assert _rel(got[name], t) < 1e-6, name
    ids, attn, _ = _rows()
    assert _rel(_log_probs(merged, ids, attn), run["world"][0]["lp"]) < 1e-5
