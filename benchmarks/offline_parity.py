"""The offline trainers against TRL 1.16 on the same work (issue #44): megarl's ``trainer.program: sft | dpo | kto |
reward_model`` and TRL's ``SFTTrainer``, ``DPOTrainer``, ``KTOTrainer`` and ``RewardTrainer`` from the same weights,
on the same examples in the same order, with the same optimizer; every step's loss, grad norm, learning rate and
objective metrics compared, and the weights after the last step, tensor by tensor.

    .venv/bin/python benchmarks/offline_parity.py
        [--cases sft,reward_model,dpo_sigmoid,dpo_ipo,dpo_hinge,dpo_robust,kto]
        [--layouts tp1,tp2,pp2] [--big-cases sft,dpo_sigmoid] [--big-layouts tp1] [--steps 10] [--batch 8]
        [--trl-python .venv-trl/bin/python] [--work outputs/offline_parity] [--results FILE]

The TRL side is benchmarks/offline_trl.py (its docstring lists what it pins and what TRL does by default), run in the
TRL virtualenv through this file's ``--trl-timed SPEC`` entry, which adds only step timestamps (``CallbackHandler``'s
``on_step_begin`` / ``on_step_end``) and imports nothing of megarl.

Models and data (built offline, :mod:`megarl.testing.addition`): ``tiny`` (``make_model()``: Qwen2, hidden 64,
2 layers, tied embeddings) for every case, ``30m`` (hidden 512, 8 layers, MLP 2048, ~31.5 M parameters) for
``--big-cases``; ``make_offline_datasets``: ``sft.jsonl`` (prompt/completion) and ``pairs.jsonl``
(prompt/chosen/rejected), 256 rows each. Cases:

- ``sft``: prompt/completion, the loss on the completion (the sum and EOS);
- ``reward_model``: Bradley-Terry on the pairs. TRL's ``RewardTrainer`` puts a fresh random ``score`` head on the
  causal LM; offline_trl.py's ``save_initial`` keeps that model (a ``Qwen2ForSequenceClassification``), and
  megarl's ``model.path`` is that directory, so both start from the same weights, head included;
- ``dpo_sigmoid``, ``dpo_ipo``, ``dpo_hinge``, ``dpo_robust`` (``label_smoothing`` 0.1): beta 0.1, the reference
  the frozen starting model, computed on the fly on both sides;
- ``kto``: beta 0.1, desirable and undesirable weight 1, the reference as DPO's. Unpaired rows from pairs: TRL's
  KTOTrainer unpairs a preference dataset per chunk of 1000 pairs, every chosen (desirable) then every rejected,
  and megarl's ``load_examples`` does the same, so with ``data.shuffle=false`` megarl trains the unpaired rows in
  that order. TRL is given the unpaired file (written by TRL's own ``unpair_preference_dataset``; offline_trl.py
  orders rows before TRL would unpair) and the same index lists; ``prepare_kto`` checks megarl's unpaired rows
  (token ids, label) against it row by row. The file is the first ``steps * batch / 2 + batch / 2`` pairs (44 by
  default), not all 256: with all of them the first 256 unpaired rows, every step of a short run, are desirable;
  with 44, steps 1-5 are desirable, step 6 half and half, steps 7-10 undesirable. KL estimate: TRL rotates the
  completions by one within each ``per_device_train_batch_size`` chunk of its prepared dataset, megarl within each
  step's batch: the same pairs here, where the steps are consecutive chunks in order (no accumulation).

Settings, both sides: ``--steps`` optimizer steps of ``--batch`` examples (pairs), no gradient accumulation; the
examples in file order (megarl ``data.shuffle=false`` takes rows ``0..B-1``, ``B..2B-1``, ...; TRL is given these
index lists); AdamW lr 1e-3, betas (0.9, 0.999), eps 1e-8, **weight decay 0** (TRL exempts bias and norm
parameters from decay, megarl's optimizer does not: only 0 is the same on both), constant LR without warm-up, clip
the total grad norm to 1.0 (both log the norm before clipping), fp32, ``max_length`` 16 (every row is 6 tokens:
``a+b=``, the digit, EOS; nothing is cut), seed 1. megarl layouts: ``tp1`` on the local launcher (one rank in the
driver process, no Ray), ``tp2`` and ``pp2`` on 2 Ray worker processes (megarl's own private Ray cluster).

Compared, per step: every metric both log under the same name (megarl's ``lr`` is TRL's ``learning_rate``), as
``|a - b| / max(|a|, |b|)`` (0 when both are 0); per metric the largest over the steps. Weights after the last
step: megarl's checkpoint converted to HF (``megarl.checkpoint.convert.convert_megatron_to_hf``) against TRL's
``final/model.safetensors``, in fp64: per tensor ``|a - b| / |b|`` (Frobenius norms), ``max|a - b| / max|b|`` and
``|a - b| / |b - w0|`` (relative to the update since the start ``w0``). Two more comparisons set the scale:
megarl TP2 and PP2 against TP1 (the same program, another split), and TRL against itself with the step's batch in
2 micro-batches (``gradient_accumulation_steps=2``, the same loss by construction for these cases: every micro-batch
holds equally many pairs / SFT divides by the whole step's tokens): the difference rounding alone makes. KTO's
control is TRL with each step's rows rotated by half a batch instead (TRL forms the KL estimate per micro-batch,
so 2 micro-batches would be other work; a cyclic rotation keeps every row and every mismatched KL pair).
Metrics that some steps lack (KTO's ``rewards/chosen`` when a batch has no desirable row) are compared on the steps
where both sides log them.

Speed and memory (megarl TP1 and TRL, the same runs): median step time over steps 2..N (megarl's
``timing/step_s``; TRL from ``on_step_begin`` to ``on_step_end``) and the peak RSS sum of the run's process tree,
sampled every 50 ms as benchmarks/grpo_cpu.py does (``TreeSampler``), over the whole run and over the steps.
One side runs at a time. Writes benchmarks/results/offline_parity-<date>.md and ``<work>/offline_parity.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("bench.offline_parity")

TOLERANCE = 1e-5
MAX_LENGTH = 16
OPTIM = dict(lr=1e-3, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, weight_decay=0.0, clip_grad=1.0)
SEED = 1
MODELS = {"tiny": {}, "30m": dict(hidden_size=512, num_layers=8, intermediate_size=2048, max_position_embeddings=128)}
LAYOUTS = {"tp1": dict(launcher="local", devices=1, tp=1, pp=1), "tp2": dict(launcher="ray", devices=2, tp=2, pp=1),
           "pp2": dict(launcher="ray", devices=2, tp=1, pp=2)}
# megarl's metrics that are bookkeeping, not the objective's (not compared)
BOOKKEEPING = ("batch/", "data/", "memory/", "run/", "timing/", "throughput/", "skipped_steps", "step_skipped", "step",
               "time")


@dataclasses.dataclass(frozen=True)
class Case:
    program: str  # megarl trainer.program
    trainer: str  # offline_trl.py's trainer
    data: str  # file under the task directory
    role: str  # megarl's trained role: its optim section and checkpoint subdirectory
    dpo: dict = dataclasses.field(default_factory=dict)  # beta, loss_type, label_smoothing
    kto: dict = dataclasses.field(default_factory=dict)  # beta, desirable_weight, undesirable_weight
    # the TRL-against-TRL rounding control: "ga2" each step in 2 micro-batches; "rotate" each step's rows rotated by
    # half a batch (KTO: its KL estimate is per micro-batch, so GA2 is other work; a rotation keeps every KL pair)
    control: str = "ga2"


def _dpo(loss_type: str, label_smoothing: float = 0.0) -> dict:
    return dict(beta=0.1, loss_type=loss_type, label_smoothing=label_smoothing)


CASES = {
    "sft": Case("sft", "sft", "sft.jsonl", "policy"),
    "reward_model": Case("reward_model", "reward", "pairs.jsonl", "critic"),
    "dpo_sigmoid": Case("dpo", "dpo", "pairs.jsonl", "policy", _dpo("sigmoid")),
    "dpo_ipo": Case("dpo", "dpo", "pairs.jsonl", "policy", _dpo("ipo")),
    "dpo_hinge": Case("dpo", "dpo", "pairs.jsonl", "policy", _dpo("hinge")),
    "dpo_robust": Case("dpo", "dpo", "pairs.jsonl", "policy", _dpo("robust", 0.1)),
    "kto": Case("kto", "kto", "pairs.jsonl", "policy",
                kto=dict(beta=0.1, desirable_weight=1.0, undesirable_weight=1.0), control="rotate"),
}
CONTROLS = {"ga2": "TRL GA2", "rotate": "TRL rows rotated"}


# ------------------------------------------------------------------------------------ TRL side (TRL venv)


def trl_timed(spec_path: str) -> None:
    """offline_trl.py's run with each step's wall-clock start and end (``steps_at.json`` beside ``steps.json``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import offline_trl
    from transformers.trainer_callback import CallbackHandler

    stamps: list[list[float]] = []
    begin, end = CallbackHandler.on_step_begin, CallbackHandler.on_step_end

    def on_step_begin(self, args, state, control):
        stamps.append([time.time(), math.nan])
        return begin(self, args, state, control)

    def on_step_end(self, args, state, control):
        stamps[-1][1] = time.time()
        return end(self, args, state, control)

    CallbackHandler.on_step_begin, CallbackHandler.on_step_end = on_step_begin, on_step_end
    offline_trl.main([spec_path])
    out = Path(json.loads(Path(spec_path).read_text())["output_dir"])
    (out / "steps_at.json").write_text(json.dumps(stamps))


# ------------------------------------------------------------------------------------ pure helpers


def rel(a: float, b: float) -> float:
    """``|a - b| / max(|a|, |b|)``; 0 when both are 0."""
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale else 0.0


def compare_metrics(ours: list[dict], theirs: list[dict], rename: dict[str, str]) -> dict:
    """Per shared metric: the largest relative difference over the steps, its step and both values there; plus the
    names only one side logs. ``rename``: our name -> theirs."""
    if len(ours) != len(theirs):
        raise SystemExit(f"{len(ours)} steps against {len(theirs)}")
    def numeric(x) -> bool:
        return isinstance(x, int | float) and not isinstance(x, bool) and not math.isnan(x)

    # a metric some steps lack (KTO's rewards/chosen when the batch has no desirable row): compared on the steps
    # where both sides log it; a step where only one side does is listed under "one_sided"
    ours_keys = list(dict.fromkeys(k for o in ours for k in o))
    names = [k for k in ours_keys if not k.startswith(BOOKKEEPING)
             and any(numeric(o.get(k)) and numeric(t.get(rename.get(k, k)))
                     for o, t in zip(ours, theirs, strict=True))]
    out = {}
    for k in names:
        diffs = [(rel(o[k], t[rename.get(k, k)]), i + 1, o[k], t[rename.get(k, k)]) for i, (o, t) in
                 enumerate(zip(ours, theirs, strict=True))
                 if numeric(o.get(k)) and numeric(t.get(rename.get(k, k)))]
        worst = max(diffs)
        scale = max(max(abs(d[2]), abs(d[3])) for d in diffs)
        out[k] = {"rel": worst[0], "step": worst[1], "ours": worst[2], "theirs": worst[3],
                  "per_step": [d[0] for d in diffs], "steps": [d[1] for d in diffs],
                  "one_sided": [i + 1 for i, (o, t) in enumerate(zip(ours, theirs, strict=True))
                                if numeric(o.get(k)) != numeric(t.get(rename.get(k, k)))],
                  "abs_over_scale": max(abs(d[2] - d[3]) for d in diffs) / scale if scale else 0.0}
    theirs_named = {rename.get(k, k) for k in ours_keys}
    theirs_keys = list(dict.fromkeys(k for t in theirs for k in t))
    return {"metrics": out,
            "only_ours": sorted(k for k in ours_keys if not k.startswith(BOOKKEEPING) and k not in names
                                and k != "rows"),
            "only_theirs": sorted(k for k in theirs_keys if k not in theirs_named
                                  and k not in ("step", "rows", "compute_loss", "epoch"))}


def weight_diff(ours: dict, theirs: dict, start: dict) -> dict:
    """Two weight sets (HF names -> tensors) in fp64: per tensor ``|a - b| / |b|``, ``max|a - b| / max|b|`` and
    ``|a - b| / |b - start|``; the same over all tensors as one vector; the names only one side has."""
    per, d2, b2, u2 = {}, 0.0, 0.0, 0.0
    for name in sorted(ours.keys() & theirs.keys()):
        a, b, s = ours[name].double(), theirs[name].double(), start[name].double()
        d, bn, u = (a - b).norm().item(), b.norm().item(), (b - s).norm().item()
        top = b.abs().max().item()
        per[name] = {"rel": d / bn if bn else (0.0 if d == 0 else math.inf),
                     "max_rel": (a - b).abs().max().item() / top if top else 0.0,
                     "rel_update": d / u if u else (0.0 if d == 0 else math.inf)}
        d2, b2, u2 = d2 + d * d, b2 + bn * bn, u2 + u * u
    return {"rel": math.sqrt(d2 / b2), "rel_update": math.sqrt(d2 / u2) if u2 else math.inf, "params": per,
            "only_ours": sorted(ours.keys() - theirs.keys()), "only_theirs": sorted(theirs.keys() - ours.keys())}


def worst(diff: dict, key: str) -> tuple[str, float]:
    name = max(diff["params"], key=lambda n: diff["params"][n][key])
    return name, diff["params"][name][key]


# ------------------------------------------------------------------------------------ runs


def build_task(model: str, work: Path) -> Path:
    from transformers import PreTrainedTokenizerFast

    from megarl.testing.addition import make_model, make_offline_datasets

    task = work / f"task-{model}"
    if not (task / "model" / "config.json").is_file():
        make_model(task / "model", **MODELS[model])
    make_offline_datasets(task)
    tok = PreTrainedTokenizerFast.from_pretrained(str(task / "model"))
    longest = 0
    for name, cols in (("sft.jsonl", ("completion",)), ("pairs.jsonl", ("chosen", "rejected"))):
        for line in (task / name).read_text().splitlines():
            row = json.loads(line)
            for c in cols:
                longest = max(longest, len(tok(row["prompt"] + row[c] + tok.eos_token)["input_ids"]))
    if longest > MAX_LENGTH:
        raise SystemExit(f"rows of {longest} tokens exceed max_length {MAX_LENGTH}")
    return task


def run_measured(cmd: list[str], log: Path, env: dict[str, str]) -> tuple[float, object]:
    """Run ``cmd`` with this run's marker in its environment and the RSS of its process tree sampled."""
    import grpo_cpu

    token = uuid.uuid4().hex
    env = env | {grpo_cpu.MARKER: token}
    sampler = grpo_cpu.TreeSampler(token)
    start = time.time()
    sampler.start()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        sampler.root = proc.pid
        try:
            proc.wait()
        except BaseException:
            proc.terminate()
            proc.wait(60)
            raise
    sampler.stop()
    if proc.returncode:
        raise SystemExit(f"{cmd[:3]} failed ({proc.returncode}); see {log}")
    return time.time() - start, sampler


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return env | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                  "PYTHONPATH": str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")}


def run_trl(case: Case, task: Path, out: Path, steps: list[list[int]], trl_python: str, accum: int = 1,
            data: Path | None = None) -> dict:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    o = OPTIM
    spec = dict(trainer=case.trainer, model=str(task / "model"), data=str(data or task / case.data), steps=steps,
                output_dir=str(out), threads=2, gradient_accumulation_steps=accum, learning_rate=o["lr"],
                adam_beta1=o["adam_beta1"], adam_beta2=o["adam_beta2"], adam_epsilon=o["adam_eps"],
                weight_decay=o["weight_decay"], max_grad_norm=o["clip_grad"], seed=SEED, max_length=MAX_LENGTH,
                **case.dpo, **case.kto, save_initial=case.trainer == "reward")
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    wall, sampler = run_measured([trl_python, str(Path(__file__).resolve()), "--trl-timed", str(out / "spec.json")],
                                 out / "log.txt", base_env())
    record = json.loads((out / "steps.json").read_text())
    stamps = json.loads((out / "steps_at.json").read_text())
    return dict(side="trl", steps=record["steps"], versions=record["versions"], wall_s=wall,
                step_s=[e - b for b, e in stamps], **_memory(sampler, stamps[0][0], stamps[-1][1]))


def _memory(sampler, t0: float, t1: float) -> dict:
    peak, procs = sampler.peak()
    return dict(peak_rss=peak, steps_rss=sampler.peak(t0, t1)[0], peak_priv=sampler.peak_private(),
                processes=sampler.max_processes(), peak_procs=procs[:4])


def megarl_config(case: Case, model_path: Path, task: Path, out: Path, layout: str, steps: int, batch: int) -> dict:
    lay = LAYOUTS[layout]
    o = OPTIM
    return {
        "model": {"path": str(model_path)},
        "data": {"train": str(task / case.data), "batch_size": batch, "shuffle": False},
        "cluster": {"launcher": lay["launcher"],
                    "pools": {"main": {"devices_per_node": lay["devices"], "nodes": 1, "tp": lay["tp"],
                                       "pp": lay["pp"]}}},
        case.role: {"optim": {"optimizer": "adam", **o, "lr_warmup_steps": 0, "lr_decay": "constant"},
                    "precision": "float32"},
        "offline": {"max_length": MAX_LENGTH, **({"dpo": case.dpo} if case.dpo else {}),
                    **({"kto": case.kto} if case.kto else {})},
        "trainer": {"program": case.program, "total_steps": steps, "output_dir": str(out), "save_every": 0,
                    "tensorboard": False, "seed": SEED, "resume": False},
    }


def run_megarl(case: Case, model_path: Path, task: Path, out: Path, layout: str, steps: int, batch: int,
               data: Path | None = None) -> dict:
    import yaml

    from megarl.metrics.tracking import read_metrics

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cfg = out.parent / f"{out.name}.yaml"
    config = megarl_config(case, model_path, task, out, layout, steps, batch)
    if data:
        config["data"]["train"] = str(data)
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    wall, sampler = run_measured([sys.executable, "-m", "megarl.cli.main", "train", str(cfg)], out.parent /
                                 f"{out.name}.log", base_env())
    records = read_metrics(out)
    if len(records) != steps:
        raise SystemExit(f"megarl logged {len(records)} steps in {out}, {steps} asked for")
    t0 = records[0]["time"] - records[0]["timing/step_s"]
    return dict(side=f"megarl {layout}", steps=records, wall_s=wall, step_s=[m["timing/step_s"] for m in records],
                resolved=yaml.safe_load((out / "config.yaml").read_text()), **_memory(sampler, t0, records[-1]["time"]))


def to_hf(checkpoint: Path, out: Path) -> Path:
    from megarl.checkpoint import cpu_only

    cpu_only.hide_cuda()
    from megarl.checkpoint.convert import convert_megatron_to_hf

    if out.exists():
        shutil.rmtree(out)
    convert_megatron_to_hf(checkpoint, out)
    return out


def load_weights(directory: Path) -> dict:
    from safetensors.torch import load_file

    weights = {}
    for f in sorted(directory.glob("*.safetensors")):
        weights |= load_file(str(f))
    return weights


def check_resolved(resolved: dict, role: str) -> list[str]:
    """The resolved config's optimizer, precision and data settings against what the TRL spec says (problems)."""
    o = resolved[role]["optim"]
    want = {**OPTIM, "optimizer": "adam", "lr_warmup_steps": 0, "lr_decay": "constant"}
    bad = [f"{role}.optim.{k}={o[k]!r} (want {v!r})" for k, v in want.items() if o[k] != v]
    if resolved[role]["precision"] != "float32":
        bad.append(f"{role}.precision={resolved[role]['precision']}")
    if resolved["data"]["shuffle"]:
        bad.append("data.shuffle=true")
    return bad


UNPAIR = """import json, sys
from datasets import Dataset
from trl.data_utils import unpair_preference_dataset
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
with open(sys.argv[2], "w") as f:
    for row in unpair_preference_dataset(Dataset.from_list(rows)):
        f.write(json.dumps(row) + "\\n")
"""


def prepare_kto(task: Path, base: Path, n_rows: int, batch: int, trl_python: str) -> tuple[Path, Path, dict]:
    """KTO's data on both sides. megarl reads a preference file and unpairs it as TRL's KTOTrainer does (per chunk of
    1000 pairs every chosen, then every rejected; megarl.data.examples._unpair), and with ``data.shuffle=false``
    trains the unpaired rows in that order. offline_trl.py takes an unpaired file (TRL would unpair a paired one
    *after* offline_trl.py has ordered its rows): TRL 1.16's own ``unpair_preference_dataset`` (TRL venv) writes it
    from the same preference file, and the steps' index lists point into it. The preference file is the first
    ``n_rows / 2 + batch / 2`` pairs of pairs.jsonl, so that the run's unpaired rows hold desirable-only steps, one
    step half desirable and half undesirable, and undesirable-only steps (all of pairs.jsonl would give 256
    desirable rows first: every step of a 10-step run desirable). Checked here: megarl's ``load_examples`` gives
    the same rows (token ids of prompt and completion, label) in the same order as TRL's unpaired file."""
    from transformers import PreTrainedTokenizerFast

    from megarl.data.examples import ExampleKind, load_examples

    n_pairs = n_rows // 2 + batch // 2
    lines = (task / "pairs.jsonl").read_text().splitlines()
    if n_pairs > len(lines):
        raise SystemExit(f"kto: {n_pairs} pairs needed, pairs.jsonl has {len(lines)}")
    base.mkdir(parents=True, exist_ok=True)
    pairs, unpaired = base / f"pairs-{n_pairs}.jsonl", base / f"unpaired-{n_pairs}.jsonl"
    pairs.write_text("\n".join(lines[:n_pairs]) + "\n")
    subprocess.run([trl_python, "-c", UNPAIR, str(pairs), str(unpaired)], check=True, env=base_env())
    rows = [json.loads(line) for line in unpaired.read_text().splitlines()]
    tok = PreTrainedTokenizerFast.from_pretrained(str(task / "model"))
    ours = load_examples(pairs, ExampleKind.UNPAIRED, tok, max_length=MAX_LENGTH)
    if len(ours) != len(rows):
        raise SystemExit(f"kto: megarl unpairs {len(ours)} rows, TRL {len(rows)}")
    for i, (e, r) in enumerate(zip(ours, rows, strict=True)):
        ids = tok(r["prompt"] + r["completion"] + tok.eos_token)["input_ids"]
        if e.label != r["label"] or e.prompt_ids + e.completions[0] != ids or len(e.completions) != 1:
            raise SystemExit(f"kto: unpaired row {i} differs: megarl {e}, TRL {r} ({ids})")
    labels = [r["label"] for r in rows[:n_rows]]
    info = {"pairs": n_pairs, "unpaired_rows": len(rows),
            "per_step_desirable": [sum(labels[k:k + batch]) for k in range(0, n_rows, batch)]}
    return pairs, unpaired, info


def run_case(name: str, model: str, layouts: list[str], task: Path, work: Path, n_steps: int, batch: int,
             trl_python: str) -> dict:
    case = CASES[name]
    steps = [list(range(batch * k, batch * (k + 1))) for k in range(n_steps)]
    base = work / model / name
    ours_data = trl_data = None
    extra = {}
    if case.trainer == "kto":
        ours_data, trl_data, extra["kto_data"] = prepare_kto(task, base, n_steps * batch, batch, trl_python)
    logger.info("%s %s: TRL", model, name)
    trl = run_trl(case, task, base / "trl", steps, trl_python, data=trl_data)
    if case.control == "ga2":
        logger.info("%s %s: TRL, 2 micro-batches (control)", model, name)
        trl_ga2 = run_trl(case, task, base / "trl-ga2", steps, trl_python, accum=2, data=trl_data)
    else:
        logger.info("%s %s: TRL, each step's rows rotated by half a batch (control)", model, name)
        rotated = [s[batch // 2:] + s[:batch // 2] for s in steps]
        trl_ga2 = run_trl(case, task, base / "trl-ga2", rotated, trl_python, data=trl_data)
    start_dir = base / "trl" / "initial" if case.trainer == "reward" else task / "model"
    start = load_weights(start_dir)
    trl_w = load_weights(base / "trl" / "final")
    rename = {"lr": "learning_rate"}
    result = {"case": name, "model": model, "dpo": case.dpo or case.kto, "control": CONTROLS[case.control],
              **extra, "trl": trl, "trl_ga2": trl_ga2,
              "trl_ga2_vs_trl": {"metrics": compare_metrics(trl_ga2["steps"], trl["steps"], {})["metrics"],
                                 "weights": weight_diff(load_weights(base / "trl-ga2" / "final"), trl_w, start)},
              "megarl": {}}
    if case.trainer == "reward":
        init_trl_again = load_weights(base / "trl-ga2" / "initial")
        result["initial_heads_equal"] = all(bool((init_trl_again[k] == start[k]).all()) for k in start)
    weights = {}
    for layout in layouts:
        logger.info("%s %s: megarl %s", model, name, layout)
        out = base / f"megarl-{layout}"
        r = run_megarl(case, start_dir, task, out, layout, n_steps, batch, data=ours_data)
        r["config_problems"] = check_resolved(r.pop("resolved"), case.role)
        ckpt = out / "checkpoints" / f"step_{n_steps:06d}" / case.role
        weights[layout] = load_weights(to_hf(ckpt, base / f"megarl-{layout}-hf"))
        r["vs_trl"] = {**compare_metrics(r["steps"], trl["steps"], rename),
                       "weights": weight_diff(weights[layout], trl_w, start)}
        if layout != "tp1" and "tp1" in weights:
            r["vs_tp1"] = {"metrics": compare_metrics(r["steps"], result["megarl"]["tp1"]["steps"], {})["metrics"],
                           "weights": weight_diff(weights[layout], weights["tp1"], start)}
        result["megarl"][layout] = r
    return result


# ------------------------------------------------------------------------------------ report


def _e(x: float) -> str:
    return f"{x:.1e}"


def _mark(x: float) -> str:
    return f"**{x:.1e}**" if x > TOLERANCE else f"{x:.1e}"


def _w(d: dict) -> str:
    name, value = worst(d, "rel")
    mname, mvalue = worst(d, "max_rel")
    return (f"{_mark(d['rel'])} (to update {_e(d['rel_update'])}); worst {name} {_mark(value)}; "
            f"max-abs worst {mname} {_mark(mvalue)}")


def report(results: list[dict], meta: dict) -> str:
    lines = [f"# Offline trainers against TRL {meta['versions'].get('TRL venv trl', '?')}: SFT, reward model, DPO, "
             f"KTO, {meta['date']}", "",
             f"- megarl commit {meta['commit']}; {meta['machine']}",
             "- " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
             f"- load average (1/5/15 min) at start {meta['load_start']}, at end {meta['load_end']}",
             f"- command: `{meta['command']}`; {meta['wall_min']:.1f} min", "",
             "## Method", "",
             "benchmarks/offline_parity.py (its docstring has the details). Each case: TRL 1.16 (benchmarks/"
             "offline_trl.py) and megarl (`trainer.program`) from the same HF weights, on the same rows in the same "
             f"order ({meta['steps']} steps x {meta['batch']} examples or pairs, rows "
             f"0..{meta['steps'] * meta['batch'] - 1} "
             "in file order), AdamW lr 1e-3 (0.9, 0.999) eps 1e-8, weight decay 0 (TRL exempts bias and norm "
             "parameters from decay and megarl's optimizer does not, so only 0 compares), constant LR, no warm-up, "
             "clip 1.0 (both grad norms before clipping), fp32, max_length 16 (no row is cut). megarl TP1 on the "
             "local launcher (one process, no Ray); TP2 and PP2 on 2 Ray worker processes. Reward model: both start "
             "from TRL's own initial sequence classifier (its random `score` head, `save_initial`).", "",
             "Differences: metric `|a - b| / max(|a|, |b|)` per step, the largest over the steps (*abs/scale*: the "
             "largest `|a - b|` over the largest `|value|` of the run, for metrics that pass near 0); weights after "
             "the last step in fp64, `|a - b| / |b|` (Frobenius) over all tensors and for the worst tensor, "
             "*to update* `|a - b| / |b - w0|`, *max-abs* `max|a - b| / max|b|` per tensor. Bold: above "
             f"{TOLERANCE:g}. **Control**: TRL against itself with each step in 2 micro-batches "
             "(`gradient_accumulation_steps=2`, the same loss for these cases): what reordered fp32 rounding alone "
             "makes of the same work. KTO's control instead rotates each step's rows by half a batch (TRL forms "
             "KTO's KL estimate per micro-batch, so GA2 would be other work; a rotation keeps every mismatched KL "
             "pair and every row, in another order). KTO's data: the first pairs of pairs.jsonl unpaired as TRL's "
             "KTOTrainer unpairs them (all chosen, then all rejected), TRL given that unpaired file and megarl the "
             "preference file (it unpairs it the same way; checked row by row before the runs).", ""]
    lines += ["## Summary", "",
              "| model | case | metrics megarl TP1 vs TRL: worst (metric, step) | weights megarl TP1 vs TRL | "
              "control TRL vs TRL (GA2; KTO: rows rotated): metrics / weights | TP2 vs TP1: metrics / weights | "
              "PP2 vs TP1: metrics / weights |", "|---|---|---|---|---|---|---|"]
    for r in results:
        cells = []
        tp1 = r["megarl"].get("tp1")
        if tp1:
            k, m = max(tp1["vs_trl"]["metrics"].items(), key=lambda kv: kv[1]["rel"])
            cells += [f"{_mark(m['rel'])} ({k}, step {m['step']})", _w(tp1["vs_trl"]["weights"])]
        else:
            cells += ["-", "-"]
        c = r["trl_ga2_vs_trl"]
        k, m = max(c["metrics"].items(), key=lambda kv: kv[1]["rel"])
        cells.append(f"{_mark(m['rel'])} ({k}) / {_mark(c['weights']['rel'])}, worst {worst(c['weights'], 'rel')[0]} "
                     f"{_mark(worst(c['weights'], 'rel')[1])}")
        for lay in ("tp2", "pp2"):
            x = r["megarl"].get(lay, {}).get("vs_tp1")
            if x:
                k, m = max(x["metrics"].items(), key=lambda kv: kv[1]["rel"])
                cells.append(f"{_mark(m['rel'])} ({k}) / {_mark(x['weights']['rel'])}, worst "
                             f"{worst(x['weights'], 'rel')[0]} {_mark(worst(x['weights'], 'rel')[1])}")
            else:
                cells.append("-")
        lines.append(f"| {r['model']} | {r['case']} | " + " | ".join(cells) + " |")
    lines += ["", "## Speed and memory (megarl TP1 local launcher vs TRL, the parity runs themselves)", "",
              "Step time: median over steps 2..N, s [min-max]. Peak RSS: sum over the run's process tree, GB (whole "
              "run incl. start-up, model load / HF -> Megatron conversion and final save; *steps*: during the steps). "
              "*private*: anonymous RSS summed + the largest shared RSS.", "",
              "| model | case | side | step s | megarl / TRL | peak RSS | steps RSS | peak private | wall s |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        tp1 = r["megarl"].get("tp1")
        trl_med = statistics.median(r["trl"]["step_s"][1:])
        for side in ([tp1] if tp1 else []) + [r["trl"]]:
            s = side["step_s"][1:]
            ratio = f"{statistics.median(s) / trl_med:.2f}x" if side is tp1 else ""
            lines.append(f"| {r['model']} | {r['case']} | {side['side']} | {statistics.median(s):.4f} "
                         f"[{min(s):.4f}-{max(s):.4f}] | {ratio} | {side['peak_rss'] / 1e9:.2f} | "
                         f"{side['steps_rss'] / 1e9:.2f} | {side['peak_priv'] / 1e9:.2f} | {side['wall_s']:.1f} |")
    lines += ["", "## Per case", ""]
    for r in results:
        lines += [f"### {r['model']} {r['case']}" + (f" ({r['dpo']})" if r["dpo"] else ""), ""]
        ctl = r.get("control", "TRL GA2")
        if "kto_data" in r:
            k = r["kto_data"]
            lines += [f"Data: the first {k['pairs']} pairs of pairs.jsonl, unpaired into {k['unpaired_rows']} rows; "
                      f"desirable rows per step: {k['per_step_desirable']} (of {meta['batch']}).", ""]
        if "initial_heads_equal" in r:
            lines.append(f"TRL's initial model identical in both TRL runs (seeded head): {r['initial_heads_equal']}.")
            lines.append("")
        tp1 = r["megarl"].get("tp1")
        if tp1:
            v = tp1["vs_trl"]
            lines += [f"| metric | megarl TP1 vs TRL: max rel (step: megarl / TRL) | abs/scale | control {ctl} vs TRL |"
                      + "".join(f" {lay.upper()} vs TP1 |" for lay in r["megarl"] if lay != "tp1"),
                      "|---|---|---|---|" + "---|" * (len(r["megarl"]) - 1)]
            for k, m in v["metrics"].items():
                ctrl = r["trl_ga2_vs_trl"]["metrics"].get({"lr": "learning_rate"}.get(k, k))
                few = (f", steps {m['steps'][0]}-{m['steps'][-1]}" if len(m.get("steps", [])) < meta["steps"]
                       else "") + (f", one side only at {m['one_sided']}" if m.get("one_sided") else "")
                row = (f"| {k}{few} | {_mark(m['rel'])} ({m['step']}: {m['ours']:.8g} / {m['theirs']:.8g}) | "
                       f"{_e(m['abs_over_scale'])} | {_e(ctrl['rel']) if ctrl else '-'} |")
                for lay, x in r["megarl"].items():
                    if lay != "tp1":
                        mm = x.get("vs_tp1", {}).get("metrics", {}).get(k)
                        row += f" {_mark(mm['rel']) if mm else '-'} |"
                lines.append(row)
            checks = tp1["config_problems"] or "resolved config as asked"
            lines += ["", f"Not compared: TRL only {v['only_theirs'] or 'none'}; megarl only "
                          f"{v['only_ours'] or 'none'}. Config checks: {checks}.",
                      "", "loss rel diff per step (megarl TP1 vs TRL): "
                      + " ".join(_e(x) for x in v["metrics"]["loss"]["per_step"]),
                      "", "grad_norm rel diff per step: "
                      + " ".join(_e(x) for x in v["metrics"]["grad_norm"]["per_step"]),
                      "", "Weights after the last step, the 5 tensors most apart (rel | max-abs | to update), megarl "
                      "TP1 vs TRL, and the control:", "",
                      f"| tensor | megarl TP1 vs TRL | control {ctl} vs TRL |", "|---|---|---|"]
            p, cp = v["weights"]["params"], r["trl_ga2_vs_trl"]["weights"]["params"]
            for n in sorted(p, key=lambda n: -p[n]["rel"])[:5]:
                lines.append(f"| {n} | {_mark(p[n]['rel'])} / {_e(p[n]['max_rel'])} / {_e(p[n]['rel_update'])} | "
                             f"{_e(cp[n]['rel'])} / {_e(cp[n]['max_rel'])} / {_e(cp[n]['rel_update'])} |")
            if v["weights"]["only_ours"] or v["weights"]["only_theirs"]:
                lines.append(f"\nTensors on one side only: megarl {v['weights']['only_ours']}, "
                             f"TRL {v['weights']['only_theirs']}")
        lines.append("")
    lines += ["## Findings", "", meta.get("findings", "(see the tables)"), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trl-timed", help=argparse.SUPPRESS)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--layouts", default="tp1,tp2,pp2")
    p.add_argument("--big-cases", default="sft,dpo_sigmoid", help="cases on the 30m model ('' for none)")
    p.add_argument("--big-layouts", default="tp1")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"))
    p.add_argument("--work", default=str(ROOT / "outputs" / "offline_parity"))
    p.add_argument("--results")
    p.add_argument("--findings", help="a Markdown file whose text goes under 'Findings'")
    p.add_argument("--from-json", help="rewrite the report from a previous run's offline_parity.json")
    args = p.parse_args(argv)
    if args.trl_timed:
        return trl_timed(args.trl_timed)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    date = datetime.date.today().isoformat()
    path = Path(args.results or ROOT / "benchmarks" / "results" / f"offline_parity-{date}.md")
    work = Path(args.work)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        meta, results = saved["meta"], saved["results"]
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import grpo_cpu

        from megarl.bench.report import cpu_description

        if not Path(args.trl_python).is_file():
            raise SystemExit(f"{args.trl_python} not found; make the TRL venv (benchmarks/requirements-trl.txt).")
        t0 = time.time()
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        meta = dict(date=date, commit=commit, versions=grpo_cpu._versions(args.trl_python),
                    machine=f"{os.cpu_count()} CPU cores ({platform.machine()}, {cpu_description()}), "
                            f"{grpo_cpu._mem_gib():.0f} GiB RAM, Python {platform.python_version()}",
                    load_start=" / ".join(f"{x:.2f}" for x in os.getloadavg()), steps=args.steps, batch=args.batch,
                    command=".venv/bin/python benchmarks/offline_parity.py " + " ".join(argv or sys.argv[1:]))
        plan = [("tiny", c, args.layouts.split(",")) for c in args.cases.split(",") if c]
        plan += [("30m", c, args.big_layouts.split(",")) for c in args.big_cases.split(",") if c]
        results = []
        work.mkdir(parents=True, exist_ok=True)
        for model, case, layouts in plan:
            task = build_task(model, work)
            results.append(run_case(case, model, layouts, task, work, args.steps, args.batch, args.trl_python))
            (work / "offline_parity.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1,
                                                                 default=str))
        meta |= dict(load_end=" / ".join(f"{x:.2f}" for x in os.getloadavg()), wall_min=(time.time() - t0) / 60)
        (work / "offline_parity.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1,
                                                             default=str))
    if args.findings:
        meta["findings"] = Path(args.findings).read_text().strip()
    path.write_text(report(results, meta))
    logger.info("wrote %s", path)


if __name__ == "__main__":
    main()
