"""LoRA against full fine-tuning on CPU (issue #45): the same GRPO update of the 31.5 M model, with rank-8 adapters
on qkv, proj, fc1 and fc2 over a frozen base, and with every weight trained.

    .venv/bin/python benchmarks/lora.py [--rank 8] [--rows 64] [--rounds 3] [--repeats 3] [--wait-load 1.5]
        [--results FILE]

Each variant runs in a fresh process (a gloo world of one, 2 threads), the two alternating over ``--rounds``: a
policy (Adam, fp32, the distributed optimizer of one rank) and what gives its GRPO step the reference log-probs,
a frozen reference model beside a fully trained policy, the policy's own base (adapters off) beside a LoRA one.
Every repeat (after one warm-up) times the reference log-prob pass and one policy update (clipped policy loss plus
k3 KL at 0.001, one micro-batch) over the same batch: ``--rows`` rows (groups of 16) of 8 prompt and 64 response
tokens. Reported: trained parameters; the policy's parameter, gradient and optimizer bytes as
``MegatronEngine.state_bytes`` counts them (torch's CPU AdamW step counters apart) beside the planner's; the
process's peak RSS (the kernel's VmHWM); the step times, wall and the update's CPU time (min / median over
rounds x repeats; the machines are shared: it first waits for a low load); one pass over the
weights a sync would stream (``MegatronEngine.weights``: merged on access with LoRA); and the bytes of a weight sync
into a TP1 rollout engine in bf16: merged (the whole model, as a full sync) against the adapter alone in peft's
layout, from the factor shapes (``megarl.planner.lora``) and checked against the tensors ``adapters.to_peft`` makes
of the trained factors. Writes benchmarks/results/lora-<date>.md.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import logging
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

logger = logging.getLogger("bench.lora")
SHAPE = dict(hidden_size=512, num_layers=8, intermediate_size=2048, max_position_embeddings=128)  # grpo_cpu's 30m
PROMPT, RESPONSE, GROUP = 8, 64, 16
TARGETS = ("qkv", "proj", "fc1", "fc2")
VARIANTS = ("full", "lora")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
FIXED_MMAP = 128 * 1024


def _rss_kib(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (the peak) of this process, KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def make_batch(rows: int, vocab: int):
    """``rows`` rows of PROMPT + RESPONSE random tokens; GRPO advantages: each group's rewards normalised."""
    from megarl.data.batch import Batch

    g = torch.Generator().manual_seed(0)
    seq = PROMPT + RESPONSE
    resp = torch.zeros(rows, seq)
    resp[:, PROMPT:] = 1
    rewards = torch.randint(0, 2, (rows // GROUP, GROUP), generator=g).float()
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).reshape(rows, 1)
    return Batch.from_dict({"input_ids": torch.randint(3, vocab, (rows, seq), generator=g),
                            "attention_mask": torch.ones(rows, seq), "response_mask": resp, "advantages": adv * resp})


def variant_world(rank: int, world: int, ckpt: str, variant: str, args: dict, fixed_malloc: bool = False) -> dict:
    """One run of ``variant``; ``fixed_malloc``: glibc's mmap threshold fixed at 128 KiB (no dynamic raise), so every
    tensor above it is mapped on allocation and unmapped when freed and the RSS follows the live tensors."""
    if fixed_malloc:
        libc = ctypes.CDLL("libc.so.6")
        if not (libc.mallopt(M_MMAP_THRESHOLD, FIXED_MMAP) and libc.mallopt(M_TRIM_THRESHOLD, FIXED_MMAP)):
            raise RuntimeError("mallopt refused the fixed mmap threshold")
    torch.set_num_threads(args["threads"])
    from megarl.algos.config import AlgorithmConfig
    from megarl.controller.role import WorkerContext
    from megarl.data.batch import Batch
    from megarl.engine.config import EngineConfig, LoRAConfig, MicroBatchConfig, OptimConfig
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.roles.policy import PolicyRole, ReferenceRole

    start_kib = _rss_kib("VmRSS")
    layout = ParallelLayout()
    init_distributed(layout)
    ctx = WorkerContext(0, 1, layout, layout.coords(0), "127.0.0.1", "local", os.getpid(), "cpu")
    lora = LoRAConfig(rank=args["rank"], targets=list(TARGETS)) if variant == "lora" else None
    batching = MicroBatchConfig(max_tokens=args["rows"] * (PROMPT + RESPONSE), max_size=args["rows"])
    engine = EngineConfig(optim=OptimConfig(lr=1e-5), micro_batch=batching, lora=lora)
    policy = PolicyRole(ctx, checkpoint_dir=ckpt, engine=engine, algorithm=AlgorithmConfig(kl_loss_coef=0.001),
                        temperature=1.0)
    reference = (None if lora else
                 ReferenceRole(ctx, checkpoint_dir=ckpt, engine=EngineConfig(micro_batch=batching), temperature=1.0))
    batch = make_batch(args["rows"], policy.spec.vocab_size)
    built_kib = _rss_kib("VmRSS")
    times: dict[str, list[float]] = {"reference": [], "update": [], "update_cpu": [], "load": []}
    for i in range(args["repeats"] + 1):  # 0: warm-up
        t0 = time.perf_counter()
        ref = reference.compute_log_probs(batch) if reference else policy.compute_log_probs(batch, adapters=False)
        t1, c1 = time.perf_counter(), time.process_time()
        step = batch.update(Batch.from_dict({"ref_log_probs": ref["log_probs"]}))
        policy.update(step)
        t2, c2 = time.perf_counter(), time.process_time()
        if i:
            times["reference"].append(t1 - t0)
            times["update"].append(t2 - t1)
            times["update_cpu"].append(c2 - c1)  # all threads: less sensitive than wall time to other load
            times["load"].append(os.getloadavg()[0])
    eng = policy.engine
    state = eng.state_bytes()
    steps = sum(s["step"].nbytes for s in eng.optimizer.optimizer.state.values())
    trained = sum(p.numel() for c in eng.chunks for p in c.parameters() if p.requires_grad)
    t = time.perf_counter()
    streamed = sum(w.nbytes for w in eng.weights().values())  # the merged weights with LoRA, one at a time
    weights_s = time.perf_counter() - t
    return {"times": times, "state": state, "steps": steps, "trained": trained, "weights_s": weights_s,
            "streamed": streamed, "peft_numel": _peft_numel(eng) if lora else None,
            "rss_kib": {"start": start_kib, "built": built_kib, "peak": _rss_kib("VmHWM"), "end": _rss_kib("VmRSS")}}


def _peft_numel(engine) -> int:
    """Elements of the peft tensors ``adapters.to_peft`` makes of this (TP1) engine's trained factors."""
    from megarl.models import adapters
    from megarl.models.provider import global_named_parameters

    params = {n: p.detach() for c in engine.chunks for n, p in global_named_parameters(c)}
    return sum(t.numel() for m in adapters.adapted_maps(engine.spec, TARGETS)
               for _, t in adapters.to_peft(m, engine.spec, params[adapters.factor_name(m.mcore, adapters.LORA_A)],
                                            params[adapters.factor_name(m.mcore, adapters.LORA_B)]))


def planned(spec, rank: int) -> dict:
    """The planner's fp32 TP1 state of both variants and the two syncs' bytes into a TP1 rollout engine in bf16."""
    from megarl.engine.config import LoRAConfig, Precision
    from megarl.parallel.layout import ParallelLayout
    from megarl.planner import lora as planner_lora
    from megarl.planner import memory

    lora = LoRAConfig(rank=rank, targets=list(TARGETS))
    (full,) = memory.training_state_bytes(spec, ParallelLayout(), Precision.FP32, True)
    (adapted,) = planner_lora.lora_state_bytes(spec, ParallelLayout(), Precision.FP32, True, lora)
    return {"full": full, "lora": adapted, "adapters": planner_lora.adapter_parameters(spec, lora),
            "peft": planner_lora.peft_parameters(spec, lora), "merged_bf16": memory.rollout_weight_bytes(spec, 1, 2),
            "peft_bf16": planner_lora.peft_bytes(spec, lora, 2)}


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def _times(xs: list[float]) -> str:
    return f"{min(xs):.2f} / {statistics.median(xs):.2f}"


def _above(runs: list[dict], key: str) -> int:
    """The most KiB of RSS (``key``: built, peak, end) any of ``runs`` had above its own start."""
    return max(r["rss_kib"][key] - r["rss_kib"]["start"] for r in runs)


def _state(run: dict, key: str) -> int:
    """``state_bytes()[key]`` of a run, the optimizer's without torch's per-tensor step counters."""
    return run["state"][key] - (run["steps"] if key == "optimizer" else 0)


def render(info: dict, spec, args, runs: dict[str, list[dict]], mem: dict[str, dict], plan: dict) -> str:
    full, lora = runs["full"], runs["lora"]
    f0, l0 = full[0], lora[0]

    def col(fn) -> tuple[str, str]:
        return fn(full), fn(lora)

    def joined(key: str):
        return lambda rs: [x for r in rs for x in r["times"][key]]

    step = [[a + b for a, b in zip(r["times"]["reference"], r["times"]["update"], strict=True)] for r in full + lora]
    steps = {"full": [x for s in step[:len(full)] for x in s], "lora": [x for s in step[len(full):] for x in s]}
    rows = [
        ("trained parameters", f"{f0['trained'] / 1e6:.3f} M", f"{l0['trained'] / 1e6:.3f} M",
         f"{l0['trained'] / f0['trained']:.4f}"),
        *[(f"{k} bytes (state_bytes{', less step counters' if k == 'optimizer' else ''})", _mb(_state(f0, k)),
           _mb(_state(l0, k)), f"{_state(l0, k) / _state(f0, k):.4f}") for k in ("params", "grads", "optimizer")],
        ("planner (params / grads / optimizer)",
         " / ".join(_mb(getattr(plan["full"], k)) for k in ("params", "grads", "optimizer")),
         " / ".join(_mb(getattr(plan["lora"], k)) for k in ("params", "grads", "optimizer")), ""),
        ("AdamW step counters (torch CPU, 4 B per tensor)", f"{f0['steps']} B", f"{l0['steps']} B", ""),
        ("reference log-probs from", "a frozen reference model", "the policy, adapters off", ""),
        ("peak RSS (VmHWM), glibc's default allocator, max over the timed runs",
         *col(lambda rs: _mb(1024 * max(r["rss_kib"]["peak"] for r in rs))),
         f"{max(r['rss_kib']['peak'] for r in lora) / max(r['rss_kib']['peak'] for r in full):.2f}"),
        ("... above the process's start", *col(lambda rs: _mb(1024 * max(r["rss_kib"]["peak"] - r["rss_kib"]["start"]
                                                                         for r in rs))),
         f"{_above(lora, 'peak') / _above(full, 'peak'):.2f}"),
        ("RSS above the start after building the roles (default allocator)",
         *col(lambda rs: _mb(1024 * _above(rs, "built"))), f"{_above(lora, 'built') / _above(full, 'built'):.2f}"),
        ("peak RSS above the start, mmap threshold fixed at 128 KiB (the live tensors' peak)",
         _mb(1024 * _above([mem["full"]], "peak")), _mb(1024 * _above([mem["lora"]], "peak")),
         f"{_above([mem['lora']], 'peak') / _above([mem['full']], 'peak'):.2f}"),
        ("RSS above the start at the end of that run (what stays resident)",
         _mb(1024 * _above([mem["full"]], "end")), _mb(1024 * _above([mem["lora"]], "end")),
         f"{_above([mem['lora']], 'end') / _above([mem['full']], 'end'):.2f}"),
        ("reference log-probs s, min / median", *col(lambda rs: _times(joined("reference")(rs))), ""),
        ("update s, min / median", *col(lambda rs: _times(joined("update")(rs))),
         f"{statistics.median(joined('update')(lora)) / statistics.median(joined('update')(full)):.2f}"),
        ("update CPU s (process time, both threads), min / median", *col(lambda rs: _times(joined("update_cpu")(rs))),
         f"{statistics.median(joined('update_cpu')(lora)) / statistics.median(joined('update_cpu')(full)):.2f}"),
        ("GRPO step (reference + update) s, min / median", _times(steps["full"]), _times(steps["lora"]),
         f"{statistics.median(steps['lora']) / statistics.median(steps['full']):.2f}"),
        ("one pass over `engine.weights()` s (LoRA: merged on access), median",
         *col(lambda rs: f"{statistics.median(r['weights_s'] for r in rs):.3f}"), ""),
        ("sync into a TP1 rollout engine, bf16", f"merged: {_mb(plan['merged_bf16'])}",
         f"adapter only (peft): {_mb(plan['peft_bf16'])}", f"{plan['peft_bf16'] / plan['merged_bf16']:.4f}"),
    ]
    out = [f"# LoRA against full fine-tuning on CPU, {info['date']}", "",
           f"- megarl commit {info['commit']}; {info['machine']}; {info['platform']}",
           f"- Python {platform.python_version()}, torch {torch.__version__}, megatron-core {info['mcore']}",
           f"- load average (1 min): {info['load_before']:.2f} before waiting {info['waited_s']:.0f} s for < "
           f"{args.wait_load} ({'reached' if info['reached'] else 'NOT reached'}), {info['load0']:.2f} at start, "
           f"{info['load1']:.2f} at end; after each step in the runs table (the machine's 2 cores are shared)",
           f"- command: `.venv/bin/python benchmarks/lora.py --rank {args.rank} --rows {args.rows} --rounds "
           f"{args.rounds} --repeats {args.repeats} --wait-load {args.wait_load}`", "",
           "## Method", "",
           f"The 31.5 M Qwen2-shaped model of `grpo_cpu.py`'s 30m case ({spec.num_parameters() / 1e6:.2f} M "
           f"parameters: hidden 512, 8 layers, 4/2 heads of 128, FFN 2048, vocabulary {spec.vocab_size}, tied), "
           "converted at TP1; each variant in a fresh process (a gloo world of one, 2 threads), full and LoRA "
           f"alternating over {args.rounds} rounds. Per repeat ({args.repeats} per run after one warm-up): the "
           f"reference log-probs and one GRPO update over the same {args.rows} rows ({args.rows // GROUP} groups of "
           f"{GROUP}) of {PROMPT} prompt + {RESPONSE} response tokens: clipped policy loss plus k3 KL at 0.001, one "
           "micro-batch, AdamW (lr 1e-5) in fp32 with the distributed optimizer of one rank. LoRA: rank "
           f"{args.rank}, alpha 16, on {', '.join(TARGETS)}; full fine-tuning builds a frozen reference model "
           "beside the policy, LoRA takes the reference log-probs from the policy with its adapters off. "
           "Bytes: `MegatronEngine.state_bytes()` after the last update (torch's CPU AdamW keeps a 4-byte step "
           "counter per tensor, listed apart) and the planner's fp32 TP1 numbers (`megarl.planner.lora`, "
           "`memory.training_state_bytes`). Peak RSS: the kernel's VmHWM of the run's process, which starts as a "
           "fork of the test fork server (torch and megatron-core imported), less its RSS then. glibc's default "
           "allocator raises its mmap threshold after large frees and keeps freed activations in its heap, so its "
           "peak (and what stays) reflects the allocator as much as the tensors; one more run per variant (a "
           "warm-up and one step) fixes the threshold at 128 KiB (`mallopt`), so every larger tensor is unmapped "
           "when freed and the RSS follows the live tensors. Sync bytes: into a TP1 rollout engine "
           "in bf16, the whole model for a merged sync (`memory.rollout_weight_bytes`, the resharding plan's "
           "bytes) and the adapter in peft's layout for an adapter-only one (`planner.lora.peft_bytes`; "
           f"`adapters.to_peft` of the trained factors gives {l0['peft_numel']:,} elements, the planner "
           f"{plan['peft']:,}).", "",
           "## Results", "",
           "| | full fine-tuning | LoRA | LoRA / full |", "|---|---|---|---|"]
    out += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    out += ["", f"Adapter parameters: {plan['adapters']:,} in megarl's fused factors (qkv's A shared by q, k and v, "
            f"fc1's by gate and up), {plan['peft']:,} in peft's layout.", "",
            "## Runs", "", "| variant | round | reference s | update s | update CPU s | peak RSS | 1-min load |",
            "|---|---|---|---|---|---|---|"]
    for v in VARIANTS:
        for i, r in [*enumerate(runs[v], 1), ("fixed mmap threshold", mem[v])]:
            t = {k: ", ".join(f"{x:.2f}" for x in xs) for k, xs in r["times"].items()}
            out.append(f"| {v} | {i} | {t['reference']} | {t['update']} | {t['update_cpu']} | "
                       f"{_mb(1024 * r['rss_kib']['peak'])} | {t['load']} |")
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--rows", type=int, default=64, help=f"rows per update, a multiple of {GROUP}")
    p.add_argument("--rounds", type=int, default=3, help="fresh processes per variant, alternating")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per process (after one warm-up)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--wait-load", type=float, default=1.5, help="wait for the 1-min load average below this")
    p.add_argument("--max-wait", type=float, default=900, help="seconds to wait for it at most")
    p.add_argument("--work", default="outputs/lora_bench")
    p.add_argument("--results", help="results file (default: benchmarks/results/lora-<today>.md)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import megatron.core
    import psutil

    from megarl.checkpoint.convert import convert_hf_to_megatron
    from megarl.models.spec import load_hf_config, spec_from_hf_config
    from megarl.testing.addition import make_model
    from megarl.testing.dist import run_world

    root = Path(__file__).resolve().parent.parent
    work = Path(args.work)
    hf, ckpt = work / "model30m", work / "mc"
    if not (hf / "config.json").exists():
        make_model(hf, **SHAPE)
    if not (ckpt / "hf").exists():
        convert_hf_to_megatron(hf, ckpt, tp=1, pp=1)
    spec = spec_from_hf_config(load_hf_config(hf))
    load_before = os.getloadavg()[0]
    start = time.time()
    while os.getloadavg()[0] >= args.wait_load and time.time() - start < args.max_wait:
        logger.info("1-min load %.2f >= %.2f; waiting", os.getloadavg()[0], args.wait_load)
        time.sleep(15)
    waited = time.time() - start
    info = dict(date=datetime.date.today().isoformat(), platform=platform.platform(), mcore=megatron.core.__version__,
                load0=os.getloadavg()[0], load_before=load_before, waited_s=waited,
                reached=os.getloadavg()[0] < args.wait_load,
                machine=f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
                        f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM",
                commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                      text=True).stdout.strip())
    wargs = dict(rank=args.rank, rows=args.rows, repeats=args.repeats, threads=args.threads)
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for i in range(args.rounds):
        for v in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
            runs[v].append(run_world(variant_world, 1, str(ckpt), v, wargs, timeout_s=1800)[0])
            logger.info("round %d %s: update %s s, peak RSS %.0f MiB", i + 1, v, runs[v][-1]["times"]["update"],
                        runs[v][-1]["rss_kib"]["peak"] / 1024)
    mem = {}
    for v in VARIANTS:  # the live tensors' peak: one more run each with the mmap threshold fixed
        mem[v] = run_world(variant_world, 1, str(ckpt), v, dict(wargs, repeats=1), True, timeout_s=1800)[0]
        logger.info("fixed mmap threshold, %s: peak RSS %.0f MiB", v, mem[v]["rss_kib"]["peak"] / 1024)
    info["load1"] = os.getloadavg()[0]
    text = render(info, spec, args, runs, mem, planned(spec, args.rank))
    print(text)
    out = Path(args.results or root / "benchmarks" / "results" / f"lora-{info['date']}.md")
    out.write_text(text)
    logger.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
