"""megarl and TRL 1.16's ``GRPOTrainer`` do the same work: the ``--replay`` and ``--learning`` modes of grpo_cpu.py.

    .venv/bin/python benchmarks/grpo_cpu.py --replay N [--cases tiny,30m] [--trl-python .venv-trl/bin/python]
    .venv/bin/python benchmarks/grpo_cpu.py --learning SEEDS,STEPS [--val-every 25] [--window 50]

Both modes take their settings from grpo_cpu.py (:func:`grpo_cpu.trl_args`, ``grpo_cpu.TRL_BEHAVIOUR``), with
megarl on its local launcher (one rank, 2 torch threads, like TRL's one process). This module runs on both
sides; in the TRL virtualenv (``grpo_cpu.py --trl-worker SPEC``, spec ``mode``) it imports nothing of megarl.

``--replay N`` (per case): megarl trains N steps with a checkpoint after each and a trainer callback
(:class:`BatchRecorder`, ``megarl.trainer.callbacks``) that saves each step's training batch after the advantages
(token ids, masks, scores, advantages, reference log-probs). Its checkpoints are converted back to HF
(``megarl.checkpoint.convert``). TRL then trains N steps from the same HF model with its sampling replaced by the
recording: the step's prompts go into ``_generate_and_score_completions`` and ``_generate_single_turn``
returns megarl's responses; everything after (rewards, group advantages, reference log-probs, the shuffle into
micro-batches, ``_compute_loss``, backward, clipping, AdamW) is TRL's own. Per step the report compares the
loss, the grad norm, TRL's rewards / advantages / reference log-probs with megarl's, and the weights:
largest absolute difference, relative to the weights and relative to the step's update (worst parameters
named). Equal work means differences of float32 rounding only.

``--learning SEEDS,STEPS``: both sides train the tiny case (addition prompts, the timing benchmark's
settings) for STEPS steps per seed, each seed a fresh process on each side; greedy accuracy on the held-out
prompts every ``--val-every`` steps (megarl's validation; TRL: ``generate`` without sampling in a callback).
The report gives per window of steps the mean reward and entropy, and per validation the greedy accuracy, as
mean [min..max] over seeds for each side, with a two-sided permutation test of the difference of the seed means
(:func:`permutation_p`).
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import logging
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpo_cpu

logger = logging.getLogger("bench.grpo_parity")
REPLAY_FIELDS = ("input_ids", "attention_mask", "response_mask", "prompt_uid", "scores", "advantages",
                 "ref_log_probs")


# ------------------------------------------------------------------------------------ pure helpers


def permutation_p(x: list[float], y: list[float], samples: int = 20000, seed: int = 0) -> float:
    """Two-sided permutation test of ``mean(x) - mean(y)``: the share of relabellings of the pooled values whose
    difference is at least as large in magnitude (exact over every split up to ``samples`` splits, else sampled)."""
    pooled, n = [*x, *y], len(x)
    observed = abs(statistics.fmean(x) - statistics.fmean(y))
    total = sum(pooled)

    def diff(idx) -> float:
        a = sum(pooled[i] for i in idx)
        return abs(a / n - (total - a) / (len(pooled) - n))

    if math.comb(len(pooled), n) <= samples:
        splits = list(itertools.combinations(range(len(pooled)), n))
    else:
        rng = random.Random(seed)
        splits = [rng.sample(range(len(pooled)), n) for _ in range(samples)]
    return sum(diff(s) >= observed - 1e-12 for s in splits) / len(splits)


def spread(values: list[float], digits: int = 3) -> str:
    """``mean [min..max]`` of the per-seed values."""
    return f"{statistics.fmean(values):.{digits}f} [{min(values):.{digits}f}..{max(values):.{digits}f}]"


def weight_diff(ours: dict, theirs: dict, start: dict) -> dict:
    """How far two weight sets (name -> tensor, HF names) are apart: per parameter the largest absolute
    difference, ``|a - b| / |b|`` and ``|a - b| / |b - start|`` (relative to the update since ``start``);
    over all shared parameters the same as one vector."""
    per, d2, b2, u2 = {}, 0.0, 0.0, 0.0
    for name in sorted(ours.keys() & theirs.keys()):
        a, b, s = ours[name].double(), theirs[name].double(), start[name].double()
        d, u = (a - b).norm().item() ** 2, (b - s).norm().item() ** 2
        per[name] = {"max_abs": (a - b).abs().max().item(), "rel": math.sqrt(d) / max(b.norm().item(), 1e-30),
                     "rel_update": math.sqrt(d / u) if u else (0.0 if d == 0 else math.inf)}
        d2, b2, u2 = d2 + d, b2 + b.norm().item() ** 2, u2 + u
    return {"max_abs": max(p["max_abs"] for p in per.values()), "rel": math.sqrt(d2 / b2),
            "rel_update": math.sqrt(d2 / u2) if u2 else math.inf, "params": per}


def replay_rows(batch: dict) -> list[tuple[list[int], list[int], int]]:
    """``(prompt ids, response ids, row index)`` of a recorded megarl batch, rows grouped by prompt (stable):
    TRL's order, where each prompt's ``n`` responses are consecutive."""
    import torch

    order = torch.argsort(batch["prompt_uid"], stable=True).tolist()
    rows = []
    for i in order:
        ids, attn, resp = batch["input_ids"][i], batch["attention_mask"][i], batch["response_mask"][i]
        rows.append((ids[(attn != 0) & (resp == 0)].tolist(), ids[resp != 0].tolist(), i))
    return rows


class BatchRecorder:
    """megarl trainer callback: each step's training batch (``REPLAY_FIELDS``) after the advantages, to
    ``out/batch_<step>.pt``."""

    def __init__(self, out: Path) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)

    def on_stage_end(self, stage: str, step: int, batch) -> None:
        import torch

        if stage == "advantages":
            torch.save({k: batch[k].clone() for k in REPLAY_FIELDS}, self.out / f"batch_{step:04d}.pt")

    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        del step, metrics


# ---------------------------------------------------------------------------------- megarl side


def megarl_worker(spec_path: str) -> None:
    """Project venv, own process: the replay's megarl run (recorded batches, a checkpoint per step), then each
    step's checkpoint converted to HF under ``out/hf/step_<k>``."""
    import torch

    from megarl.checkpoint.convert import convert_megatron_to_hf
    from megarl.config.train import load_config
    from megarl.trainer.trainer import run

    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    torch.set_num_threads(spec["threads"])
    run(load_config(grpo_cpu.EXAMPLE, spec["overrides"]), callbacks=(BatchRecorder(out / "batches"),))
    for k in range(1, spec["steps"] + 1):
        convert_megatron_to_hf(out / "run" / "checkpoints" / f"step_{k:06d}" / "policy", out / "hf" / f"step_{k}")


def _replay_megarl(name: str, case: grpo_cpu.Case, task: Path, out: Path, steps: int) -> Path:
    import shutil

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    local = dataclasses.replace(case, launcher="local", warmup=0, steps=steps)
    overrides = [*grpo_cpu.megarl_overrides(task, local, out / "run"), "trainer.save_every=1",
                 f"trainer.keep_checkpoints={steps + 1}"]
    spec = {"out": str(out), "overrides": overrides, "steps": steps, "threads": os.cpu_count()}
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    _run([sys.executable, str(Path(grpo_cpu.__file__)), "--megarl-worker", str(out / "spec.json")], out / "log.txt")
    return out


def _run(cmd: list[str], log: Path) -> None:
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                        "PYTHONPATH": str(grpo_cpu.ROOT)}
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=grpo_cpu.ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({rc}); see {log}")


# -------------------------------------------------------------------------------------- TRL side


def trl_worker(spec: dict) -> None:
    """TRL venv: the ``replay`` or ``learning`` run the spec describes (no megarl import)."""
    import torch
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(spec["threads"])
    rows = [json.loads(line) for line in Path(spec["train"]).read_text().splitlines() if line.strip()]
    val = [json.loads(line) for line in Path(spec["val"]).read_text().splitlines() if line.strip()]
    # as saved (megarl.data.tokenizer.load_tokenizer): AutoTokenizer would rebuild the character vocabulary as the
    # Qwen2Tokenizer its config.json's model type names, which drops spaces (transformers 5)
    tok = PreTrainedTokenizerFast.from_pretrained(spec["model"])
    out = Path(spec["out"])
    log = (out / "trl_steps.jsonl").open("w")  # noqa: SIM115 (closed after train())
    replay = spec["mode"] == "replay"
    recorded = sorted((out / "batches").glob("batch_*.pt")) if replay else []
    answers = {r["prompt"]: r["answer"] for r in rows + val}

    class ParityTrainer(GRPOTrainer):
        checks: dict  # this step's comparisons with the recording (replay) or its greedy accuracy (learning)
        _rows: list  # replay: this step's recorded (prompt ids, response ids, row) in TRL's order

        def _generate_and_score_completions(self, inputs):
            if not replay:
                return super()._generate_and_score_completions(inputs)
            batch = torch.load(recorded[self.state.global_step])
            self._rows = replay_rows(batch)
            inputs = [{"prompt": tok.decode(p), "answer": answers[tok.decode(p)]} for p, _, _ in self._rows]
            result = super()._generate_and_score_completions(inputs)
            order = [i for _, _, i in self._rows]
            resp = batch["response_mask"][order] != 0
            ref = torch.zeros_like(result["completion_mask"], dtype=torch.float32)
            ref[result["completion_mask"] != 0] = batch["ref_log_probs"][order][resp]
            mask = result["completion_mask"] != 0
            self.checks = {
                "reward_max_abs": (self._rewards - batch["scores"][order]).abs().max().item(),
                "advantage_max_abs": (result["advantages"] - batch["advantages"][order][resp.cumsum(-1) == 1]
                                      ).abs().max().item(),
                "ref_logp_max_abs": (result["ref_per_token_logps"] - ref)[mask].abs().max().item(),
                "micro_batch_tokens": []}
            return result

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            if not replay:
                return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                     has_tool_images)
            if [list(p) for p in prompt_ids] != [p for p, _, _ in self._rows]:
                raise RuntimeError("TRL tokenised the recorded prompts into other ids than megarl's")
            return [c for _, c, _ in self._rows], None

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            self._rewards = per_func.sum(dim=1)  # one function, weight 1
            return per_func

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.checks.setdefault("micro_batch_tokens", []).append(int(inputs["completion_mask"].sum()))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def greedy_accuracy(model) -> float:
        ids = tok([r["prompt"] for r in val], return_tensors="pt", padding=True, padding_side="left")
        with torch.no_grad():
            gen = model.generate(**ids, do_sample=False, max_new_tokens=spec["args"]["max_completion_length"],
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        texts = tok.batch_decode(gen[:, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        return statistics.fmean(grpo_cpu.integer_answer(texts, [r["answer"] for r in val]))

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if replay:
                torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                           out / f"trl_step_{state.global_step}.pt")
            elif spec["val_every"] and state.global_step % spec["val_every"] == 0:
                trainer.checks = {"greedy_accuracy": greedy_accuracy(model)}

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                log.write(json.dumps({"step": state.global_step, **logs, **trainer.checks}) + "\n")
                log.flush()
                trainer.checks = {}

    trainer = ParityTrainer(model=spec["model"], reward_funcs=grpo_cpu.integer_answer,
                            args=GRPOConfig(**spec["args"]), train_dataset=Dataset.from_list(rows),
                            callbacks=[Record()])
    trainer.checks, trainer._rows = {}, []
    if spec.get("ignore_eos"):  # megarl's rollout.stop_at_eos=false (grpo_cpu.trl_args)
        trainer.eos_token_ids = []
    trainer.train()
    log.close()


def _trl_spec(mode: str, task: Path, out: Path, args: dict, case: grpo_cpu.Case, **extra) -> Path:
    spec = {"mode": mode, "model": str(task / "model"), "train": str(task / "train.jsonl"),
            "val": str(task / "val.jsonl"), "out": str(out), "threads": os.cpu_count(),
            "args": args | {"output_dir": str(out / "trl")}, "ignore_eos": not case.stop_at_eos, **extra}
    path = out / f"trl_spec_{mode}.json"
    path.write_text(json.dumps(spec, indent=1))
    return path


# ------------------------------------------------------------------------------------------ replay


def replay(names: list[str], steps: int, work: Path, trl_python: str) -> dict:
    """Both sides of the replay for each case; the per-step comparison (:func:`_compare_replay`)."""
    from megarl.config.train import load_config
    from megarl.testing.addition import make_task

    results = {}
    for name in names:
        case, task = grpo_cpu.CASES[name], work / name / "task"
        make_task(task, **case.model)
        out = work / name / "replay"
        local = dataclasses.replace(case, launcher="local", warmup=0, steps=steps)
        cfg = load_config(grpo_cpu.EXAMPLE, grpo_cpu.megarl_overrides(task, local, out / "run"))
        args = grpo_cpu.trl_args(cfg, local)
        start = time.time()
        _replay_megarl(name, case, task, out, steps)
        megarl_s = time.time() - start
        spec = _trl_spec("replay", task, out, args, case)
        _run([trl_python, str(Path(grpo_cpu.__file__)), "--trl-worker", str(spec)], out / "trl_log.txt")
        results[name] = _compare_replay(task, out, steps) | {
            "trl": args, "overrides": grpo_cpu.megarl_overrides(task, local, Path("<out>")),
            "wall_s": {"megarl (incl. conversion)": megarl_s, "trl": time.time() - start - megarl_s}}
        logger.info("%s replay: %s", name, [round(s["weights"]["rel_update"], 8) for s in results[name]["steps"]])
    return results


def _compare_replay(task: Path, out: Path, steps: int) -> dict:
    import torch
    from safetensors.torch import load_file

    from megarl.metrics.tracking import read_metrics

    ours = {int(m["step"]): m for m in read_metrics(out / "run")}
    theirs = {int(json.loads(line)["step"]): json.loads(line)
              for line in (out / "trl_steps.jsonl").read_text().splitlines()}
    start = load_file(task / "model" / "model.safetensors")
    rows = []
    for k in range(1, steps + 1):
        mine = load_file(out / "hf" / f"step_{k}" / "model.safetensors")
        trl = torch.load(out / f"trl_step_{k}.pt")
        diff = weight_diff(mine, trl, start)
        worst = sorted(diff["params"].items(), key=lambda p: -p[1]["rel_update"])[:3]
        m, t = ours[k], theirs[k]
        rows.append({"step": k, "loss": (m["actor/loss"], t["loss"]), "grad_norm": (m["actor/grad_norm"],
                     t["grad_norm"]), "entropy": (m["actor/entropy"], t["entropy"]),
                     "reward": (m["reward/mean"], t["reward"]), "weights": {k2: v for k2, v in diff.items()
                                                                          if k2 != "params"},
                     "worst": worst, "checks": {c: t[c] for c in ("reward_max_abs", "advantage_max_abs",
                                                                  "ref_logp_max_abs", "micro_batch_tokens")}})
    return {"steps": rows}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def replay_report(results: dict, meta: dict) -> str:
    lines = [f"# GRPO replay: TRL {meta['versions'].get('TRL venv trl', '?')} trains on megarl's rollouts, "
             f"{meta['date']}", "", *_header(meta), "",
             "Method: benchmarks/grpo_parity.py (`--replay`). megarl trains N steps (local launcher, one rank) and "
             "records each step's batch after the advantages and a checkpoint per step (converted to HF). TRL's "
             "`GRPOTrainer` then trains N steps from the same HF model with its sampling replaced by the recorded "
             "prompts and responses; its rewards, advantages, reference log-probs, micro-batches, loss, backward, "
             "clipping and AdamW are its own. *rel*: |w_megarl - w_TRL| / |w_TRL|; *rel to update*: |w_megarl - "
             "w_TRL| / |w_TRL - w_0| (norms over all shared parameters, fp64). Adam moves an element by "
             "lr x m / (sqrt(v) + 1e-8): where an element's gradient is near 1e-8, the rounding of either side "
             "decides its step. The attention's k_proj bias has such elements (it shifts all of a query's "
             "scores alike but for RoPE's rotation, so its gradient is small: in step 1 some of its elements "
             "move by less than the learning rate, the step Adam's first update gives every element whose "
             "gradient is well above 1e-8), so it differs most relative to its update.", ""]
    for name, r in results.items():
        lines += [f"## {name}", "", "| step | loss megarl / TRL (rel diff) | grad norm megarl / TRL (rel diff) | "
                  "entropy megarl / TRL | reward | TRL - megarl: reward, advantage, ref log-prob (max abs) | tokens "
                  "per micro-batch | weights max abs | rel | rel to update | most different (rel to update) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for s in r["steps"]:
            c, w = s["checks"], s["weights"]
            tokens = sorted(set(c["micro_batch_tokens"]))
            worst = ", ".join(f"{n} {v['rel_update']:.1e}" for n, v in s["worst"])
            lines.append(
                f"| {s['step']} | {s['loss'][0]:.7f} / {s['loss'][1]:.7f} ({_rel(*s['loss']):.1e}) | "
                f"{s['grad_norm'][0]:.6f} / {s['grad_norm'][1]:.6f} ({_rel(*s['grad_norm']):.1e}) | "
                f"{s['entropy'][0]:.6f} / {s['entropy'][1]:.6f} | {s['reward'][0]:.4f} / "
                f"{s['reward'][1]:.4f} | {c['reward_max_abs']:.1e}, {c['advantage_max_abs']:.1e}, "
                f"{c['ref_logp_max_abs']:.1e} | {len(c['micro_batch_tokens'])} x {tokens} | {w['max_abs']:.2e} | "
                f"{w['rel']:.2e} | {w['rel_update']:.2e} | {worst} |")
        lines += ["", "Wall time (beside other jobs, not a speed result): "
                  + ", ".join(f"{k} {v:.0f} s" for k, v in r["wall_s"].items()), "",
                  "megarl overrides: `" + " ".join(r["overrides"]).replace(f"{grpo_cpu.ROOT}/", "") + "`", "",
                  f"TRL `GRPOConfig(**...)`: `{json.dumps(r['trl'], sort_keys=True)}`", "", "What still differs:", "",
                  *(f"- {d}" for d in grpo_cpu.remaining_differences(grpo_cpu.CASES[name])), ""]
    lines += ["## Reproduce", "", "```", meta["command"], "```", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- learning


def learning(seeds: int, steps: int, val_every: int, work: Path, trl_python: str) -> dict:
    """Both sides on the tiny case, ``seeds`` seeds x ``steps`` steps, alternating sides; per-step metrics."""
    from megarl.config.train import load_config
    from megarl.testing.addition import make_task

    case, task = grpo_cpu.CASES["tiny"], work / "tiny" / "task"
    make_task(task, **case.model)
    runs: dict[str, dict[int, list[dict]]] = {"megarl": {}, "trl": {}}
    wall: dict[str, list[float]] = {"megarl": [], "trl": []}
    local = dataclasses.replace(case, launcher="local", warmup=0, steps=steps)
    for seed in range(1, seeds + 1):
        for side in ("megarl", "trl"):
            out = work / "tiny" / "learning" / f"{side}-{seed}"
            if out.exists():
                import shutil

                shutil.rmtree(out)
            out.mkdir(parents=True)
            overrides = [*grpo_cpu.megarl_overrides(task, local, out / "run"), f"trainer.seed={seed}",
                         f"trainer.val_every={val_every}"]
            start = time.time()
            if side == "megarl":
                _run([sys.executable, "-m", "megarl.cli.main", "train", str(grpo_cpu.EXAMPLE), *overrides],
                     out / "log.txt")
                from megarl.metrics.tracking import read_metrics

                runs[side][seed] = [{"step": m["step"], "reward": m["reward/mean"], "entropy": m["actor/entropy"],
                                     "greedy": m.get("val/reward/mean")} for m in read_metrics(out / "run")]
            else:
                args = grpo_cpu.trl_args(load_config(grpo_cpu.EXAMPLE, overrides), local)
                spec = _trl_spec("learning", task, out, args, case, val_every=val_every)
                _run([trl_python, str(Path(grpo_cpu.__file__)), "--trl-worker", str(spec)], out / "log.txt")
                runs[side][seed] = [{"step": m["step"], "reward": m["reward"], "entropy": m["entropy"],
                                     "greedy": m.get("greedy_accuracy")}
                                    for m in map(json.loads, (out / "trl_steps.jsonl").read_text().splitlines())]
            wall[side].append(time.time() - start)
            logger.info("learning %s seed %d: %.0f s, last-20 reward %.3f", side, seed, wall[side][-1],
                        statistics.fmean(r["reward"] for r in runs[side][seed][-20:]))
    return {"runs": runs, "wall_s": wall, "steps": steps, "seeds": seeds, "val_every": val_every,
            "overrides": [*grpo_cpu.megarl_overrides(task, local, Path("<out>")), "trainer.seed=SEED",
                          f"trainer.val_every={val_every}"],
            "trl": grpo_cpu.trl_args(load_config(grpo_cpu.EXAMPLE, grpo_cpu.megarl_overrides(task, local, work)),
                                     local)}


def learning_report(res: dict, meta: dict, window: int) -> str:
    runs, steps = res["runs"], res["steps"]
    lines = [f"# GRPO learning: megarl vs TRL {meta['versions'].get('TRL venv trl', '?')} on the tiny addition task, "
             f"{meta['date']}", "", *_header(meta), "",
             f"Method: benchmarks/grpo_parity.py (`--learning`): {res['seeds']} seeds x {steps} steps per side, each "
             "run a fresh process (megarl: local launcher), the timing benchmark's tiny settings (16 prompts x 16 "
             "responses of 1 token, lr 2e-3, ...; below). Cells: mean [min..max] over seeds of each seed's mean over "
             "the window; *p*: two-sided permutation test of the difference of the seed means (exact over all "
             f"{math.comb(2 * res['seeds'], res['seeds'])} relabellings). Greedy accuracy: the {meta['val_rows']} "
             "held-out prompts of val.jsonl, greedy, after the step named.", ""]
    for metric, label in (("reward", "mean reward (sampled, training batch)"), ("entropy", "token entropy")):
        lines += [f"## {label}", "", "| steps | megarl | TRL | difference of means | p |", "|---|---|---|---|---|"]
        for a in range(1, steps + 1, window):
            b = min(a + window - 1, steps)
            per = {side: [statistics.fmean(r[metric] for r in runs[side][s] if a <= r["step"] <= b)
                          for s in sorted(runs[side])] for side in runs}
            lines.append(f"| {a}-{b} | {spread(per['megarl'])} | {spread(per['trl'])} | "
                         f"{statistics.fmean(per['megarl']) - statistics.fmean(per['trl']):+.3f} | "
                         f"{permutation_p(per['megarl'], per['trl']):.2f} |")
        lines.append("")
    lines += ["## greedy accuracy on held-out prompts", "", "| after step | megarl | TRL | difference of means | p |",
              "|---|---|---|---|---|"]
    for k in range(res["val_every"], steps + 1, res["val_every"]):
        per = {side: [next(r["greedy"] for r in runs[side][s] if r["step"] == k) for s in sorted(runs[side])]
               for side in runs}
        lines.append(f"| {k} | {spread(per['megarl'])} | {spread(per['trl'])} | "
                     f"{statistics.fmean(per['megarl']) - statistics.fmean(per['trl']):+.3f} | "
                     f"{permutation_p(per['megarl'], per['trl']):.2f} |")
    lines += ["", "Wall time per run (beside other jobs, not a speed result): " + ", ".join(
        f"{side} {spread(v, 0)} s" for side, v in res["wall_s"].items()), "",
        "megarl overrides: `" + " ".join(res["overrides"]).replace(f"{grpo_cpu.ROOT}/", "") + "`", "",
        f"TRL `GRPOConfig(**...)` (seed = SEED): `{json.dumps(res['trl'], sort_keys=True)}`", "",
        "What still differs:", "", *(f"- {d}" for d in grpo_cpu.remaining_differences(grpo_cpu.CASES["tiny"])),
        "", "## Reproduce", "", "```", meta["command"], "```", ""]
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------- main


def _header(meta: dict) -> list[str]:
    return [f"- megarl commit {meta['commit']}; {meta['machine']}",
            "- " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
            f"- load average (1/5/15 min) at start {meta['load_start']}, at end {meta['load_end']}: other jobs ran "
            "beside these runs; nothing here is a timing result"]


def main(args) -> None:
    if args.megarl_worker:
        return megarl_worker(args.megarl_worker)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from megarl.bench.report import cpu_description

    if not Path(args.trl_python).is_file():
        raise SystemExit(f"{args.trl_python} not found; make the TRL venv (see benchmarks/requirements-trl.txt).")
    work, date = Path(args.work), datetime.date.today().isoformat()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=grpo_cpu.ROOT, capture_output=True,
                            text=True).stdout.strip()
    meta = dict(date=date, commit=commit, versions=grpo_cpu._versions(args.trl_python),
                machine=f"{os.cpu_count()} CPU cores ({platform.machine()}, {cpu_description()}), "
                        f"{grpo_cpu._mem_gib():.0f} GiB RAM, Python {platform.python_version()}",
                load_start=" / ".join(f"{x:.2f}" for x in os.getloadavg()))
    if args.replay:
        results = replay(args.cases.split(","), args.replay, work, args.trl_python)
        meta |= dict(load_end=" / ".join(f"{x:.2f}" for x in os.getloadavg()),
                     command=f".venv/bin/python benchmarks/grpo_cpu.py --replay {args.replay} --cases {args.cases}")
        path = Path(args.results or grpo_cpu.ROOT / "benchmarks" / "results" / f"grpo_cpu-{date}-replay.md")
        path.write_text(replay_report(results, meta))
        (work / f"replay-{date}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    else:
        seeds, steps = map(int, args.learning.split(","))
        res = learning(seeds, steps, args.val_every, work, args.trl_python)
        meta |= dict(load_end=" / ".join(f"{x:.2f}" for x in os.getloadavg()), val_rows=sum(
            1 for _ in (work / "tiny" / "task" / "val.jsonl").open()),
            command=f".venv/bin/python benchmarks/grpo_cpu.py --learning {args.learning} --val-every "
                    f"{args.val_every} --window {args.window}")
        path = Path(args.results or grpo_cpu.ROOT / "benchmarks" / "results" / f"grpo_cpu-{date}-learning.md")
        path.write_text(learning_report(res, meta, args.window))
        (work / f"learning-{date}.json").write_text(json.dumps({"meta": meta, "results": res}, indent=1, default=str))
    print(path.read_text())
