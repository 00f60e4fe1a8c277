"""LoRA against full fine-tuning on CPU (issue #45): the same GRPO step of the 31.5 M model, with rank-8 adapters
on qkv, proj, fc1 and fc2 over a frozen base, and with every weight trained.

    .venv/bin/python benchmarks/lora.py [--rank 8] [--rows 64] [--rounds 2] [--repeats 5] [--wait-load 1.5]
        [--results FILE]

A GRPO step: the reference log-probs (full fine-tuning: a frozen reference model beside the policy; LoRA: the
policy's own base, adapters off), then one policy update (clipped policy loss plus k3 KL at 0.001, one micro-batch,
AdamW in fp32, the distributed optimizer of one rank) over ``--rows`` rows (groups of 16) of 8 prompt and 64
response tokens, in gloo worlds of one process with 2 threads. Time: ``--rounds`` processes per allocator setting
(glibc's default, and one that keeps freed memory) each build both variants and alternate their steps, so that the
other load of a shared machine falls on both alike (it first waits for a low load); each step is followed by a timed
forward of the policy itself (LoRA: adapters on, against the reference pass's adapters off). Bytes and memory: a
fresh process per variant, with glibc's default allocator and with its mmap threshold fixed (the RSS then follows
the live tensors). Reported: trained parameters; the policy's parameter, gradient and optimizer bytes as
``MegatronEngine.state_bytes`` counts them (torch's CPU AdamW step counters apart) beside the planner's; RSS after
building, at the peak (VmHWM) and at the end; the step's wall and CPU times and the two forwards; one pass over the
weights a sync streams (``MegatronEngine.weights``: merged on access with LoRA); and the bytes of a weight sync into
a TP1 rollout engine in bf16: merged (the whole model, as a full sync) against the adapter alone in peft's layout,
from the factor shapes (``megarl.planner.lora``) and checked against the tensors ``adapters.to_peft`` makes of the
trained factors. Writes benchmarks/results/lora-<date>.md.
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
# glibc's allocator for a world: its default; "fixed": mmap threshold fixed at 128 KiB (every larger tensor mapped
# when allocated, unmapped when freed: the RSS follows the live tensors); "keep": no mmap below 1 GiB and no trim
# (freed memory is reused without page faults, as engine.py's --variant malloc)
MALLOPT = {"default": {}, "fixed": {M_MMAP_THRESHOLD: 128 * 2**10, M_TRIM_THRESHOLD: 128 * 2**10},
           "keep": {M_MMAP_THRESHOLD: 2**30, M_TRIM_THRESHOLD: 2**31 - 1}}


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


def _set_malloc(mode: str) -> None:
    """This process's glibc allocator as :data:`MALLOPT` ``mode`` says (setting a threshold ends its dynamic raise)."""
    libc = ctypes.CDLL("libc.so.6")
    for param, value in MALLOPT[mode].items():
        if not libc.mallopt(param, value):
            raise RuntimeError(f"mallopt({param}, {value}) refused")


def _context():
    from megarl.controller.role import WorkerContext
    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout

    layout = ParallelLayout()
    init_distributed(layout)
    return WorkerContext(0, 1, layout, layout.coords(0), "127.0.0.1", "local", os.getpid(), "cpu")


def build(ctx, ckpt: str, variant: str, args: dict):
    """(policy, reference log-prob function) of ``variant``: a full policy beside a frozen reference model, or a
    LoRA policy whose base model (adapters off) is the reference."""
    from megarl.algos.config import AlgorithmConfig
    from megarl.engine.config import EngineConfig, LoRAConfig, MicroBatchConfig, OptimConfig
    from megarl.roles.policy import PolicyRole, ReferenceRole

    lora = LoRAConfig(rank=args["rank"], targets=list(TARGETS)) if variant == "lora" else None
    batching = MicroBatchConfig(max_tokens=args["rows"] * (PROMPT + RESPONSE), max_size=args["rows"])
    policy = PolicyRole(ctx, checkpoint_dir=ckpt, engine=EngineConfig(optim=OptimConfig(lr=1e-5), micro_batch=batching,
                                                                     lora=lora),
                        algorithm=AlgorithmConfig(kl_loss_coef=0.001), temperature=1.0)
    if lora is not None:
        return policy, lambda batch: policy.compute_log_probs(batch, adapters=False)
    reference = ReferenceRole(ctx, checkpoint_dir=ckpt, engine=EngineConfig(micro_batch=batching), temperature=1.0)
    return policy, reference.compute_log_probs


def grpo_step(policy, reference, batch) -> tuple[float, float, float, float]:
    """The reference log-probs and one policy update: (reference s, update s, update CPU s of all threads), and the
    policy's own log-probs (LoRA: adapters on; not part of the step: they show the adapters' forward cost)."""
    from megarl.data.batch import Batch

    t0 = time.perf_counter()
    ref = reference(batch)
    t1, c1 = time.perf_counter(), time.process_time()
    policy.update(batch.update(Batch.from_dict({"ref_log_probs": ref["log_probs"]})))
    t2, c2 = time.perf_counter(), time.process_time()
    policy.compute_log_probs(batch)
    return t1 - t0, t2 - t1, c2 - c1, time.perf_counter() - t2


def memory_world(rank: int, world: int, ckpt: str, variant: str, args: dict, malloc: str) -> dict:
    """A fresh process of one variant: a warm-up and ``memory_steps`` GRPO steps; its state bytes, RSS, one pass
    over the weights a sync streams and (LoRA) the adapter's peft elements."""
    _set_malloc(malloc)
    torch.set_num_threads(args["threads"])
    start_kib = _rss_kib("VmRSS")
    policy, reference = build(_context(), ckpt, variant, args)
    batch = make_batch(args["rows"], policy.spec.vocab_size)
    built_kib = _rss_kib("VmRSS")
    for _ in range(args["memory_steps"] + 1):
        grpo_step(policy, reference, batch)
    eng = policy.engine
    steps = sum(s["step"].nbytes for s in eng.optimizer.optimizer.state.values())
    t = time.perf_counter()
    streamed = sum(w.nbytes for w in eng.weights().values())  # the merged weights with LoRA, one at a time
    weights_s = time.perf_counter() - t
    return {"state": eng.state_bytes(), "steps": steps, "weights_s": weights_s, "streamed": streamed,
            "trained": sum(p.numel() for c in eng.chunks for p in c.parameters() if p.requires_grad),
            "peft_numel": _peft_numel(eng) if eng.lora is not None else None,
            "rss_kib": {"start": start_kib, "built": built_kib, "peak": _rss_kib("VmHWM"), "end": _rss_kib("VmRSS")}}


def timing_world(rank: int, world: int, ckpt: str, args: dict, malloc: str) -> dict:
    """Both variants in one process, their GRPO steps alternating (the order swapped every repeat), so that the
    other load of a shared machine falls on both alike: per variant, the :func:`grpo_step` times of each repeat."""
    _set_malloc(malloc)
    torch.set_num_threads(args["threads"])
    ctx = _context()
    built = {v: build(ctx, ckpt, v, args) for v in VARIANTS}
    batch = make_batch(args["rows"], built["full"][0].spec.vocab_size)
    out: dict[str, list] = {v: [] for v in VARIANTS} | {"load": []}
    for i in range(args["repeats"] + 1):  # 0: warm-up
        for v in VARIANTS if i % 2 else VARIANTS[::-1]:
            times = grpo_step(*built[v], batch)
            if i:
                out[v].append(times)
        if i:
            out["load"].append(os.getloadavg()[0])
    return out


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


def _state(run: dict, key: str) -> int:
    """``state_bytes()[key]`` of a run, the optimizer's without torch's per-tensor step counters."""
    return run["state"][key] - (run["steps"] if key == "optimizer" else 0)


def _above(run: dict, key: str) -> int:
    """Bytes of RSS (``key``: built, peak, end) a run had above its process's start."""
    return 1024 * (run["rss_kib"][key] - run["rss_kib"]["start"])


def _timing_rows(mode: str, timing: list[dict]) -> list[tuple[str, str, str, str]]:
    """The time rows of the timed runs with glibc's allocator in ``mode``."""
    series = {v: {k: [t[i] for r in timing for t in r[v]]
                  for i, k in enumerate(("reference", "update", "cpu", "policy"))} for v in VARIANTS}
    for v in VARIANTS:
        series[v]["step"] = [a + b for a, b in zip(series[v]["reference"], series[v]["update"], strict=True)]
    paired = [b[1] / a[1] for r in timing for a, b in zip(r["full"], r["lora"], strict=True)]
    labels = {"reference": "reference log-probs s (LoRA: the policy, adapters off)",
              "policy": "the policy's own log-probs s (LoRA: adapters on; not in the step)",
              "update": "update s", "cpu": "update CPU s (both threads)", "step": "GRPO step (reference + update) s"}
    rows = [(f"{mode} allocator: {label}, min / median", _times(series["full"][k]), _times(series["lora"][k]),
             f"{statistics.median(series['lora'][k]) / statistics.median(series['full'][k]):.2f}")
            for k, label in labels.items()]
    return rows + [(f"{mode} allocator: update LoRA / full, adjacent steps, min / median / max", "", "",
                    f"{min(paired):.2f} / {statistics.median(paired):.2f} / {max(paired):.2f}")]


def render(info: dict, spec, args, mem: dict[tuple[str, str], dict], timing: dict[str, list[dict]],
           plan: dict) -> str:
    full, lora = mem[("full", "default")], mem[("lora", "default")]
    fixed = {v: mem[(v, "fixed")] for v in VARIANTS}

    def ratio(a: float, b: float) -> str:
        return f"{b / a:.4f}" if b / a < 0.1 else f"{b / a:.2f}"

    def row(label: str, key: str, fn) -> tuple[str, str, str, str]:
        a, b = fn(full if key == "default" else fixed["full"]), fn(lora if key == "default" else fixed["lora"])
        return label, _mb(a), _mb(b), ratio(a, b)

    rows = [
        ("trained parameters", f"{full['trained'] / 1e6:.3f} M", f"{lora['trained'] / 1e6:.3f} M",
         ratio(full["trained"], lora["trained"])),
        *[(f"{k} bytes (state_bytes{', less step counters' if k == 'optimizer' else ''})", _mb(_state(full, k)),
           _mb(_state(lora, k)), ratio(_state(full, k), _state(lora, k))) for k in ("params", "grads", "optimizer")],
        ("planner (params / grads / optimizer)",
         " / ".join(_mb(getattr(plan["full"], k)) for k in ("params", "grads", "optimizer")),
         " / ".join(_mb(getattr(plan["lora"], k)) for k in ("params", "grads", "optimizer")), ""),
        ("AdamW step counters (torch CPU, 4 B per tensor)", f"{full['steps']} B", f"{lora['steps']} B", ""),
        ("reference log-probs from", "a frozen reference model", "the policy, adapters off", ""),
        row("RSS above the start after building the roles", "default", lambda r: _above(r, "built")),
        row("peak RSS above the start (VmHWM), glibc's default allocator", "default", lambda r: _above(r, "peak")),
        row("... with the mmap threshold fixed at 128 KiB (the live tensors' peak)", "fixed",
            lambda r: _above(r, "peak")),
        row("... resident at the end of that run", "fixed", lambda r: _above(r, "end")),
        *[r for mode, runs in timing.items() for r in _timing_rows(mode, runs)],
        ("one pass over `engine.weights()` s (LoRA: merged on access)", f"{full['weights_s']:.3f}",
         f"{lora['weights_s']:.3f}", ""),
        ("sync into a TP1 rollout engine, bf16", f"merged: {_mb(plan['merged_bf16'])}",
         f"adapter only (peft): {_mb(plan['peft_bf16'])}", ratio(plan["merged_bf16"], plan["peft_bf16"])),
    ]
    out = [f"# LoRA against full fine-tuning on CPU, {info['date']}", "",
           f"- megarl commit {info['commit']}; {info['machine']}; {info['platform']}",
           f"- Python {platform.python_version()}, torch {torch.__version__}, megatron-core {info['mcore']}",
           f"- load average (1 min): {info['load_before']:.2f} before waiting {info['waited_s']:.0f} s for < "
           f"{args.wait_load} ({'reached' if info['reached'] else 'NOT reached'}), {info['load0']:.2f} at start, "
           f"{info['load1']:.2f} at end; after each timed pair in the runs table (the 2 cores are shared)",
           f"- command: `.venv/bin/python benchmarks/lora.py --rank {args.rank} --rows {args.rows} --rounds "
           f"{args.rounds} --repeats {args.repeats} --wait-load {args.wait_load}`", "",
           "## Method", "",
           f"The 31.5 M Qwen2-shaped model of `grpo_cpu.py`'s 30m case ({spec.num_parameters() / 1e6:.2f} M "
           f"parameters: hidden 512, 8 layers, 4/2 heads of 128, FFN 2048, vocabulary {spec.vocab_size}, tied), "
           f"converted at TP1, in gloo worlds of one process with 2 threads. A GRPO step over {args.rows} rows "
           f"({args.rows // GROUP} groups of {GROUP}) of {PROMPT} prompt + {RESPONSE} response tokens: the reference "
           "log-probs, then one policy update (clipped policy loss plus k3 KL at 0.001, one micro-batch, AdamW at "
           "lr 1e-5 in fp32, the distributed optimizer of one rank). Full fine-tuning builds a frozen reference model "
           f"beside the policy; LoRA (rank {args.rank}, alpha 16, on {', '.join(TARGETS)}) takes the reference "
           "log-probs from the policy with its adapters off.", "",
           f"- Time: {args.rounds} fresh processes per allocator setting each build both variants and alternate their "
           f"steps ({args.repeats} pairs after a warm-up pair, the order swapped every pair), so that other load falls "
           "on both alike; min and median over all steps, and the ratio of adjacent steps. Each step is followed "
           "by a forward of the policy itself (LoRA: adapters on). Allocator: glibc's default, which maps every "
           "tensor above its 32 MiB maximum mmap threshold anew (page faults on each), and `keep` (`mallopt`: no "
           "mmap below 1 GiB, no trim), which reuses freed memory.",
           f"- Bytes and memory: a fresh process per variant, a warm-up and {args.memory_steps} steps. "
           "`MegatronEngine.state_bytes()` (torch's CPU AdamW keeps a 4-byte step counter per tensor, listed apart) "
           "beside the planner's fp32 TP1 numbers (`megarl.planner.lora`, `memory.training_state_bytes`). RSS: "
           "the kernel's VmRSS / VmHWM less the process's RSS at its start (a fork of the fork server, torch and "
           "megatron-core imported). glibc's default allocator raises its mmap threshold after large frees and "
           "keeps freed activations in its heap, so its peak reflects the allocator as much as the tensors; a "
           "second process per variant fixes the threshold at 128 KiB (`mallopt`), so every larger tensor is "
           "unmapped when freed and the RSS follows the live tensors.",
           "- Sync bytes: into a TP1 rollout engine in bf16, the whole model for a merged sync "
           "(`memory.rollout_weight_bytes`, the resharding plan's bytes) and the adapter in peft's layout for an "
           f"adapter-only one (`planner.lora.peft_bytes`; `adapters.to_peft` of the trained factors gives "
           f"{lora['peft_numel']:,} elements, the planner {plan['peft']:,}).", "",
           "## Results", "",
           "| | full fine-tuning | LoRA | LoRA / full |", "|---|---|---|---|"]
    out += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    out += ["", f"Adapter parameters: {plan['adapters']:,} in megarl's fused factors (qkv's A shared by q, k and v, "
            f"fc1's by gate and up), {plan['peft']:,} in peft's layout.", "",
            "## Timed runs", "",
            "| allocator | round | variant | reference s | update s | update CPU s | policy log-probs s |",
            "|---|---|---|---|---|---|---|"]
    for mode, runs in timing.items():
        for i, r in enumerate(runs, 1):
            for v in VARIANTS:
                cols = [", ".join(f"{t[k]:.2f}" for t in r[v]) for k in range(4)]
                out.append(f"| {mode} | {i} | {v} | {' | '.join(cols)} |")
            out.append(f"| {mode} | {i} | 1-min load | {', '.join(f'{x:.2f}' for x in r['load'])} | | | |")
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--rows", type=int, default=64, help=f"rows per update, a multiple of {GROUP}")
    p.add_argument("--rounds", type=int, default=2, help="timing processes per allocator, each with both variants")
    p.add_argument("--repeats", type=int, default=5, help="timed pairs of steps per process (after a warm-up pair)")
    p.add_argument("--memory-steps", type=int, default=2, help="steps of each memory run (after a warm-up)")
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
    load_before, start = os.getloadavg()[0], time.time()
    while os.getloadavg()[0] >= args.wait_load and time.time() - start < args.max_wait:
        logger.info("1-min load %.2f >= %.2f; waiting", os.getloadavg()[0], args.wait_load)
        time.sleep(15)
    info = dict(date=datetime.date.today().isoformat(), platform=platform.platform(), mcore=megatron.core.__version__,
                load0=os.getloadavg()[0], load_before=load_before, waited_s=time.time() - start,
                reached=os.getloadavg()[0] < args.wait_load,
                machine=f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
                        f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM",
                commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                      text=True).stdout.strip())
    wargs = dict(rank=args.rank, rows=args.rows, repeats=args.repeats, threads=args.threads,
                 memory_steps=args.memory_steps)
    timing: dict[str, list[dict]] = {"default": [], "keep": []}
    for i in range(args.rounds):
        for mode, runs in timing.items():
            runs.append(run_world(timing_world, 1, str(ckpt), wargs, mode, timeout_s=3600)[0])
            logger.info("timing round %d, %s allocator: update s full %s, lora %s", i + 1, mode,
                        [round(t[1], 2) for t in runs[-1]["full"]], [round(t[1], 2) for t in runs[-1]["lora"]])
    mem = {}
    for mode in ("default", "fixed"):
        for v in VARIANTS:
            mem[(v, mode)] = run_world(memory_world, 1, str(ckpt), v, wargs, mode, timeout_s=1800)[0]
            logger.info("memory %s, %s allocator: peak RSS %.0f MiB", v, mode, mem[(v, mode)]["rss_kib"]["peak"] / 1024)
    info["load1"] = os.getloadavg()[0]
    text = render(info, spec, args, mem, timing, planned(spec, args.rank))
    print(text)
    out = Path(args.results or root / "benchmarks" / "results" / f"lora-{info['date']}.md")
    out.write_text(text)
    logger.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
