"""Rehearse a GPU recipe on this machine at its true widths, its layers cut (issue #47).

A recipe's model (its ``config.json``, or a planner preset where the recipe's ``model.path`` is not here) keeps its
hidden size, FFN, heads and KV heads, vocabulary, rope and experts; only ``num_hidden_layers`` is cut. Random HF
weights are written shard by shard, and the rehearsal runs, in order, each in its own process so that no two
copies of the model are resident together:

1. ``reference``: transformers in float32: greedy continuations of the probe prompts, the log-prob of every token of
   them (what the float32 rollout engine must reproduce);
2. ``convert``: HF -> Megatron at the rehearsal layout and back; the round trip compared tensor by tensor (bit-exact);
3. a world of ``world`` gloo ranks at a layout derived from the recipe's (:func:`derive_layout`): the policy role
   (megatron-core, the recipe's precision on CPU: float32) computes the log-probs of the reference's sequences,
   syncs its weights into the recipe's rollout engine (resharding; bytes per rank against the plan's
   :func:`megarl.resharding.plan.make_plan`), generates greedily, and with ``update`` takes one SGD step.

Each phase's peak memory per rank is reported beside the planner's prediction of the same phase
(:mod:`megarl.bench.rehearse_memory`). ``device`` picks where the reference and the world run and whose memory is
measured, through one probe class per device (``rehearse_memory.MEMORY_PROBES``): ``cpu``, gloo ranks and the
host's resident set; ``cuda``, NCCL ranks (rank r on GPU r) and the CUDA allocator's bytes, the reference in float32
on the GPU with TF32 off. Torch and CUDA are imported lazily.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import json
import multiprocessing
import random
import resource
import time
from pathlib import Path
from typing import Any

from megarl.bench.rehearse_memory import (
    GIB,
    fits,
    memory_checks,
    memory_probe,
    planned_sync_bytes,
    predicted_phase_bytes,
    world_bytes,
)
from megarl.config.train import TrainConfig
from megarl.errors import ConfigError
from megarl.models.spec import ModelSpec, spec_from_hf_config
from megarl.rollout.config import RolloutBackend

LOGIT_STD = 4.0  # of the random model's logits (write_random_hf's vocab_std = LOGIT_STD / sqrt(hidden))


@dataclasses.dataclass(frozen=True)
class Rehearsal:
    """What one rehearsal runs: the cut model, the layout, the rollout engine, the probes."""

    name: str
    hf_config: dict[str, Any]  # the recipe model's config.json, num_hidden_layers cut
    world: int
    tp: int
    pp: int
    ep: int
    rollout_backend: RolloutBackend
    rollout_tp: int
    rollout_dtype: str  # float32 or bfloat16 (the recipe's rollout.engine.dtype)
    update: bool  # one SGD step (the policy then holds gradients: twice its weights)
    rollout: bool  # the sync and generate phases (off where the rollout engine's copy does not fit this machine)
    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    bucket_mb: float = 64.0
    seed: int = 0
    device: str = "cpu"  # a key of MEMORY_PROBES: "cuda" runs the reference and the world on GPUs (NCCL)
    # the training copy: float32, or bfloat16 (the recipes' on a GPU; half the bytes, so the 70B's sync fits 24 GB).
    # bfloat16 writes the HF weights in bfloat16: the float32 replica then holds exactly the weights transformers'
    # float32 reference upcasts, and greedy tokens stay comparable; the training forward's log-probs are bfloat16's
    train_dtype: str = "float32"

    @property
    def spec(self) -> ModelSpec:
        return spec_from_hf_config(self.hf_config)


def from_recipe(config: str | Path, *, layers: int, world: int = 2, preset: str | None = None,
                hf_config: str | Path | None = None, tp: int | None = None, ep: int | None = None,
                update: bool = False, rollout: bool | None = None, max_new_tokens: int = 8, seed: int = 0,
                device: str = "cpu", train_dtype: str = "float32") -> Rehearsal:
    """The rehearsal of a recipe (its YAML): the model of its ``model.path`` (or ``preset`` / ``hf_config`` where
    that is not on this machine) with ``layers`` layers, at :func:`derive_layout` on ``world`` ranks (``tp``, ``ep``:
    other sizes than the derived ones), the
    embedded rollout engine in float32 (exact greedy tokens against transformers; the recipe's vLLM runs where a
    GPU is), four probe prompts of random token ids. ``rollout`` None: the sync and generation phases run where
    the planner's bytes of the whole world fit this machine's available memory (:func:`fits`). ``device``: ``cpu``
    or ``cuda`` (``rehearse_memory.MEMORY_PROBES``; ``cuda`` needs a GPU per rank)."""
    from megarl.checkpoint.format import hf_files
    from megarl.config.train import load_config
    from megarl.models.spec import load_hf_config
    from megarl.planner.presets import PRESETS

    memory_probe(device).require(world)  # before anything is read or written
    if train_dtype not in LOG_PROB_TOLERANCE:
        raise ConfigError(f"unknown training dtype {train_dtype!r}; known: {sorted(LOG_PROB_TOLERANCE)}.")
    if update and train_dtype != "float32":
        raise ConfigError("--update rehearses an SGD step of a float32 training copy; with --train-dtype "
                          f"{train_dtype} leave --update out (the bfloat16 copy is for the sync and generation).")
    cfg = load_config(config, [])
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}.")
        model = PRESETS[preset]
    elif hf_config is not None:
        model = json.loads(Path(hf_config).read_text())
    elif (hf_files(cfg.model.path) / "config.json").is_file():
        model = load_hf_config(hf_files(cfg.model.path))
    else:
        raise ConfigError(f"the recipe's model.path {cfg.model.path} has no config.json on this machine: name the "
                          f"model with --preset (one of {sorted(PRESETS)}) or --hf-config path/to/config.json.")
    cut = cut_layers(model, layers)
    spec = spec_from_hf_config(cut)
    derived = derive_layout(cfg, spec, world)
    tp, pp, ep = tp or derived[0], derived[1], ep or derived[2]
    vocab = int(cut["vocab_size"])
    gen = random.Random(seed)
    prompts = tuple(tuple(gen.randrange(5, vocab) for _ in range(n)) for n in (5, 9, 3, 7))
    name = Path(config).parent.name if Path(config).name == "config.yaml" else Path(config).stem
    r = Rehearsal(name, cut, world, tp, pp, ep, RolloutBackend.EMBEDDED, 1, "float32", update, True, prompts,
                  max_new_tokens, cfg.rollout.engine.bucket_mb, seed, device, train_dtype)
    return dataclasses.replace(r, rollout=fits(r) if rollout is None else rollout)


def cut_layers(hf_config: dict[str, Any], layers: int) -> dict[str, Any]:
    """``hf_config`` with ``layers`` decoder layers and everything else as published (per-layer lists cut too)."""
    full = int(hf_config["num_hidden_layers"])
    if not 1 <= layers <= full:
        raise ConfigError(f"a rehearsal keeps 1..{full} layers of this model, asked for {layers}.")
    out = copy.deepcopy(hf_config)
    out["num_hidden_layers"] = layers
    if isinstance(out.get("layer_types"), list):
        out["layer_types"] = out["layer_types"][:layers]
    if isinstance(out.get("mlp_only_layers"), list):
        out["mlp_only_layers"] = [i for i in out["mlp_only_layers"] if i < layers]
    if "max_window_layers" in out:
        out["max_window_layers"] = min(int(out["max_window_layers"]), layers)
    return out


def _divisor_at_most(n: int, cap: int, *also: int) -> int:
    """The largest d <= cap dividing n and every one of ``also``."""
    return max(d for d in range(1, cap + 1) if n % d == 0 and all(a % d == 0 for a in also))


def derive_layout(cfg: TrainConfig, spec: ModelSpec, world: int, pool: str = "main") -> tuple[int, int, int, int]:
    """(tp, pp, ep, rollout tp) of a rehearsal on ``world`` ranks from the recipe's pool: its TP where ``world``
    allows (else the largest that divides ``world``, the heads and the KV heads), PP 1 (the layers are cut), its
    EP likewise within the ranks, and its rollout TP within the TP (the embedded engine: 1)."""
    p = cfg.cluster.pools[pool]
    tp = _divisor_at_most(world, min(p.tp, world), spec.num_attention_heads, spec.num_query_groups)
    ep = 1
    if spec.moe is not None:
        ep = _divisor_at_most(world, min(p.ep, world), spec.moe.num_experts)
    engine = cfg.rollout.engine
    rollout_tp = 1 if engine.backend is RolloutBackend.EMBEDDED else _divisor_at_most(tp, min(engine.tp, tp))
    return tp, 1, ep, rollout_tp


# ------------------------------------------------------------------------------------------------ phases

def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _exact_float32() -> None:
    """float32 matrix products in float32 on a GPU (no TF32, whose 10-bit mantissa would move the log-probs by
    ~1e-3 and flip greedy near-ties); nothing changes on a CPU."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _write_and_reference(r: Rehearsal, hf_dir: str, out: str) -> dict[str, Any]:
    """(its own process) random weights, then transformers' greedy continuations and log-probs on ``r.device``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from megarl.testing.tiny import write_random_hf

    torch.set_num_threads(2)
    _exact_float32()
    device = torch.device(r.device)
    start = time.perf_counter()
    config = AutoConfig.for_model(**r.hf_config)
    # logits of standard deviation ~4 over the vocabulary, as a trained model's: the tests' tiny models' 0.5 would
    # give 45 at hidden 8192, whose float32 rounding alone exceeds the log-prob tolerance
    params, nbytes = write_random_hf(hf_dir, config, seed=r.seed, vocab_std=LOGIT_STD / config.hidden_size ** 0.5,
                                     dtype=getattr(torch, r.train_dtype))
    written = time.perf_counter() - start
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()
    res: dict[str, Any] = {"parameters": params, "hf_bytes": nbytes, "write_s": written}

    def greedy() -> list[list[int]]:
        return [model.generate(torch.tensor([p], device=device), max_new_tokens=r.max_new_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0].tolist() for p in r.prompts]

    with torch.no_grad():
        res["greedy_float32"] = greedy()
        log_probs = []
        for seq in res["greedy_float32"]:
            logits = model(torch.tensor([seq], device=device)).logits[0, :-1].double()
            targets = torch.tensor(seq[1:], device=device)[:, None]
            log_probs.append(torch.log_softmax(logits, -1).gather(-1, targets)[:, 0].tolist())
        res["log_probs"] = log_probs
    res["reference_s"] = time.perf_counter() - start - written
    res["peak_rss"] = _peak_rss()
    Path(out).write_text(json.dumps(res))
    return {k: v for k, v in res.items() if not k.startswith(("greedy", "log_probs"))}


def _convert(r: Rehearsal, hf_dir: str, mc_dir: str, back_dir: str) -> dict[str, Any]:
    """(its own process) HF -> Megatron at the layout and back; the round trip compared tensor by tensor."""
    import torch
    from safetensors import safe_open

    from megarl.checkpoint.convert import convert_hf_to_megatron, convert_megatron_to_hf

    start = time.perf_counter()
    convert_hf_to_megatron(hf_dir, mc_dir, tp=r.tp, pp=r.pp, ep=r.ep)
    forward = time.perf_counter() - start
    convert_megatron_to_hf(mc_dir, back_dir)
    backward = time.perf_counter() - start - forward

    def tensors(d: str) -> dict[str, str]:
        index = Path(d) / "model.safetensors.index.json"
        if index.exists():
            return {n: str(Path(d) / f) for n, f in json.loads(index.read_text())["weight_map"].items()}
        with safe_open(str(Path(d) / "model.safetensors"), "pt") as f:
            return {n: str(Path(d) / "model.safetensors") for n in f.keys()}  # noqa: SIM118 (not a dict)

    a, b = tensors(hf_dir), tensors(back_dir)
    unequal = sorted(set(a) ^ set(b))
    for name in sorted(set(a) & set(b)):
        with safe_open(a[name], "pt") as fa, safe_open(b[name], "pt") as fb:
            x, y = fa.get_tensor(name), fb.get_tensor(name)
            if x.dtype != y.dtype or not torch.equal(x, y):
                unequal.append(name)
    return {"to_megatron_s": forward, "to_hf_s": backward, "tensors": len(a), "round_trip_unequal": unequal,
            "peak_rss": _peak_rss()}


def _rank(rank: int, world: int, r: Rehearsal, mc_dir: str, reference: str) -> dict[str, Any]:
    """One rank of the rehearsal world (see the module doc, step 3)."""
    import torch

    from megarl.algos.config import AlgorithmConfig
    from megarl.controller.role import WorkerContext
    from megarl.data.batch import Batch, prompt_batch
    from megarl.engine.config import EngineConfig, MicroBatchConfig, OptimConfig, OptimizerName, Precision
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.policy import PolicyRole
    from megarl.rollout.base import SamplingParams
    from megarl.rollout.config import RolloutConfig
    from megarl.testing.dist import from_collect_rank

    layout = ParallelLayout.for_world(world, tp=r.tp, pp=r.pp, ep=r.ep)
    init_distributed(layout)  # NCCL on the rank's GPU where CUDA is, else gloo
    _exact_float32()
    mem = memory_probe(r.device)()
    ctx = WorkerContext(rank, world, layout, layout.coords(rank), "127.0.0.1", "local", 0, mem.device)
    ref = json.loads(Path(reference).read_text())
    seqs = ref["greedy_float32"]
    width = max(len(s) for s in seqs)
    engine = EngineConfig(optim=OptimConfig(optimizer=OptimizerName.SGD, lr=1e-3, clip_grad=0.0,
                                            use_distributed_optimizer=False),
                          micro_batch=MicroBatchConfig(max_tokens=len(seqs) * width, max_size=len(seqs)),
                          precision=Precision(r.train_dtype))
    rollout = RolloutConfig(backend=r.rollout_backend, tp=r.rollout_tp, dtype=Precision(r.rollout_dtype),
                            bucket_mb=r.bucket_mb)
    out: dict[str, Any] = {}
    with mem("load"):
        role = PolicyRole(ctx, checkpoint_dir=mc_dir, engine=engine, algorithm=AlgorithmConfig(
            recompute_old_log_probs=True), temperature=1.0, rollout=rollout, trainable=r.update)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    response = torch.zeros_like(ids)
    for i, (s, p) in enumerate(zip(seqs, r.prompts, strict=True)):
        response[i, len(p):len(s)] = 1
    rows = Batch.from_dict({"input_ids": ids, "attention_mask": attention, "response_mask": response})
    with mem("log-probs"):
        lp = role.compute_log_probs(rows.select("input_ids", "attention_mask"))
    lp = from_collect_rank(None if lp is None else lp["log_probs"], layout)
    expected = torch.tensor([row + [0.0] * (width - 1 - len(row)) for row in ref["log_probs"]], dtype=torch.float64)
    mask = attention[:, 1:].bool()
    out["log_prob_max_diff"] = float((lp[:, 1:].double() - expected)[mask].abs().max())
    if r.rollout:
        with mem("sync"):
            sync = role.sync_weights()
        t = sync.transfer
        out["sync"] = {"received": t.bytes_received, "kept": t.bytes_kept, "sent": t.bytes_sent,
                       "seconds": sync.seconds}
        with mem("generate"):
            greedy = role.generate(prompt_batch([list(p) for p in r.prompts]),
                                   SamplingParams(temperature=0.0, max_new_tokens=r.max_new_tokens))
        role.to_train()
        if greedy is not None:
            out["greedy"] = [row[: int(n)].tolist() for row, n in zip(greedy["input_ids"],
                                                                       greedy["attention_mask"].sum(-1), strict=True)]
    if r.update:
        g = torch.Generator().manual_seed(0)
        train = rows.update(Batch.from_dict({"old_log_probs": lp.float(),
                                             "advantages": torch.randn(ids.shape, generator=g) * response}))
        with mem("update"):
            out["update"] = dataclasses.asdict(role.update(train))
    out["memory"] = mem.phases
    out["stage"] = layout.coords(rank).pp
    return out


def rehearse(r: Rehearsal, workdir: str | Path, *, timeout_s: float = 3600) -> dict[str, Any]:
    """Run the rehearsal in ``workdir`` (it holds the HF model, the checkpoints and the reference) and return its
    report (:func:`megarl.bench.report` style dict: measured beside planned)."""
    from megarl.testing.dist import run_world

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    hf, mc, back, ref = (str(workdir / n) for n in ("hf", "mc", "hf_round_trip", "reference.json"))
    report: dict[str, Any] = {"name": r.name, "device": r.device, "layers": r.hf_config["num_hidden_layers"],
                              "world": r.world,
                              "tp": r.tp, "pp": r.pp, "ep": r.ep, "rollout": r.rollout_backend.value,
                              "rollout_tp": r.rollout_tp, "rollout_dtype": r.rollout_dtype,
                              "train_dtype": r.train_dtype}
    context = multiprocessing.get_context("forkserver")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        report["reference"] = pool.submit(_write_and_reference, r, hf, ref).result()
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        report["convert"] = pool.submit(_convert, r, hf, mc, back).result()
    start = time.perf_counter()
    ranks = run_world(_rank, r.world, r, mc, ref, timeout_s=timeout_s, cuda=memory_probe(r.device).cuda)
    report["world_s"] = time.perf_counter() - start
    reference = json.loads(Path(ref).read_text())
    expected_greedy = reference["greedy_float32"]  # the rehearsal's rollout engine runs in float32
    report["log_prob_max_diff"] = max(x["log_prob_max_diff"] for x in ranks)
    report["greedy_expected"] = expected_greedy
    if r.rollout:
        answered = [x["greedy"] for x in ranks if "greedy" in x]
        report["greedy_equal"] = bool(answered) and all(g == expected_greedy for g in answered)
        report["greedy"] = answered[0] if answered else None
        report["sync"] = [x["sync"] for x in ranks]
        report["sync_planned"] = planned_sync_bytes(r)
    else:
        need = world_bytes(dataclasses.replace(r, rollout=True))
        report["rollout_skipped"] = (f"the world with its rollout engines needs {need / GIB:.1f} GiB by the planner's "
                                     "terms, over 90 % of this machine's available memory")
    seqs = reference["greedy_float32"]
    report["memory_planned"] = predicted_phase_bytes(r, sum(map(len, seqs)), max(map(len, seqs)), len(seqs))
    report["memory"] = [x["memory"] for x in ranks]
    report["memory_checks"] = memory_checks(report)
    report["update"] = [x.get("update") for x in ranks]
    return report


# bfloat16's unit roundoff (2^-8) of the largest logits (std 4: ~18 over a 152k vocabulary) is ~0.07; the 7B cut to
# 1 layer measured 6.9e-2 at TP1. A wrong weight mapping moves log-probs by units
BF16_LOG_PROB_TOLERANCE = 0.25

# the training forward's log-probs against transformers' float32 forward (float64 softmax) at true widths, by the
# training copy's dtype: float32's; bfloat16's (8-bit mantissa) bounds only a wrong weight mapping (errors of O(1))
LOG_PROB_TOLERANCE = {"float32": 1e-4, "bfloat16": BF16_LOG_PROB_TOLERANCE}


def failures(report: dict[str, Any]) -> list[str]:
    """What the rehearsal found wrong, one line each (empty: every check held)."""
    out = []
    if report["convert"]["round_trip_unequal"]:
        out.append(f"HF -> Megatron -> HF changed {report['convert']['round_trip_unequal'][:3]}")
    tolerance = LOG_PROB_TOLERANCE[report["train_dtype"]]
    if not report["log_prob_max_diff"] <= tolerance:
        out.append(f"log-probs differ from transformers' by {report['log_prob_max_diff']:.2e} (> {tolerance})")
    if "greedy_equal" in report:
        if not report["greedy_equal"]:
            out.append("greedy tokens differ from transformers.generate")
        moved = [{"received": x["received"], "kept": x["kept"]} for x in report["sync"]]
        if moved != report["sync_planned"]:
            out.append(f"sync bytes per rank {moved} differ from the plan's {report['sync_planned']}")
    out += [f"{c['phase']}: measured {c['measured'] / GIB:.3f} GiB, predicted {c['predicted'] / GIB:.3f} GiB"
            for c in report["memory_checks"] if not c["within"]]
    return out


def markdown(report: dict[str, Any]) -> str:
    """The report as a markdown section: the checks, then memory per phase beside the prediction."""
    c, ref, probe = report["convert"], report["reference"], memory_probe(report["device"])
    trip = "bit-exact" if not c["round_trip_unequal"] else "DIFFERS: " + ", ".join(c["round_trip_unequal"][:3])
    lines = [f"### {report['name']}: {report['layers']} layer(s), {ref['parameters'] / 1e9:.2f} B parameters",
             "",
             f"World of {report['world']} {probe.backend} ranks: TP{report['tp']} PP{report['pp']} EP{report['ep']}, "
             f"training copy {report['train_dtype']}; "
             f"rollout {report['rollout']} TP{report['rollout_tp']} {report['rollout_dtype']}.",
             "",
             "| check | result |", "|---|---|",
             f"| round trip HF -> Megatron -> HF ({c['tensors']} tensors) | "
             f"{trip} |",
             f"| log-probs vs transformers (max abs, {sum(map(len, report['greedy_expected']))} tokens) | "
             f"{report['log_prob_max_diff']:.2e} |"]
    if "greedy_equal" in report:
        moved = sum(x["received"] for x in report["sync"])
        planned = sum(x["received"] for x in report["sync_planned"])
        lines += [f"| greedy tokens vs transformers.generate | {'equal' if report['greedy_equal'] else 'DIFFER'} |",
                  f"| sync bytes received (all ranks) vs plan | {moved / 1e9:.3f} GB vs {planned / 1e9:.3f} GB |",
                  f"| sync seconds (slowest rank) | {max(x['seconds'] for x in report['sync']):.1f} |"]
    else:
        lines.append(f"| sync, generation | not run: {report['rollout_skipped']} |")
    lines += [f"| times: write / reference / to Megatron / to HF / world (s) | {ref['write_s']:.0f} / "
              f"{ref['reference_s']:.0f} / {c['to_megatron_s']:.0f} / {c['to_hf_s']:.0f} / {report['world_s']:.0f} |",
              "", f"| phase | measured peak (GiB {probe.measures}, fullest rank) | predicted (GiB) | ratio | within "
                  "tolerance |",
              "|---|---|---|---|---|"]
    for m in report["memory_checks"]:
        ratio = f"{m['ratio']:.3f}" if m["ratio"] is not None else "-"
        lines.append(f"| {m['phase']} | {m['measured'] / GIB:.3f} | {m['predicted'] / GIB:.3f} | {ratio} | "
                     f"{'yes' if m['within'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def run(config: str | Path, workdir: str | Path, *, keep: bool = False, **options: Any) -> dict[str, Any]:
    """``megarl rehearse``: :func:`from_recipe` with ``options``, :func:`rehearse` in ``workdir``, the report written
    there (``rehearsal.json``, ``rehearsal.md``); the model files (GBs) removed unless ``keep``."""
    import shutil

    r = from_recipe(config, **options)
    workdir = Path(workdir)
    report = rehearse(r, workdir)
    report["failures"] = failures(report)
    (workdir / "rehearsal.json").write_text(json.dumps(report, indent=1) + "\n")
    (workdir / "rehearsal.md").write_text(markdown(report))
    if not keep:
        for name in ("hf", "mc", "hf_round_trip"):
            shutil.rmtree(workdir / name, ignore_errors=True)
    return report
