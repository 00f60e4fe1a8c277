"""Benchmark rollout generation: EmbeddedEngine.generate vs transformers' model.generate on the same prompts.

    .venv/bin/python benchmarks/generate.py [--repeats 5] [--cases tiny-early-stop,mid-25M-no-stop,mid-25M-long]
        [--wait-load 1.5] [--max-wait 300] [--threads N] [--results FILE]

Sampling with temperature 0.8, top_p 0.95, top_k off, on random Llama models built from configs (no hub), prompts of
random ids (8-40 tokens):

- ``tiny-early-stop``: 16 prompts x n=8 = 128 samples, max_new_tokens=64; hidden 64, 4 layers, vocab 300, biased
  towards its stop token (id 1) so most samples stop early: embedding column 0 is a constant 3.0 for every token
  (a direction the residual stream keeps) and the LM-head row of token 1 reads only that column (weight 3.5), so
  token 1 gets a high logit at every position (~90% of samples stop, median length ~12 of 64);
- ``mid-25M-no-stop``: 16 x 8 = 128 samples of 64 tokens; hidden 512, 6 layers, vocab 8000 (~25.6M parameters),
  no stop tokens: every sample runs the full 64 tokens;
- ``mid-25M-long``: the same model, 4 prompts x n=8 = 32 samples of 512 tokens: long responses, where the KV cache
  dominates. Here ``engine-dynamic-cache`` (the engine with transformers' own ``DynamicLayer``, which grows by
  ``torch.cat`` and so copies the whole cache at every step) isolates what appending in place
  (``megarl.rollout.kv_cache.GrowingLayer``) saves;
- ``mid-25M-early-stop``: the same model biased towards its stop token like ``tiny-early-stop`` (LM-head weight 22:
  RMSNorm at width 512 shrinks the constant column, 3.5 stops nothing), 32 prompts x n=8 = 256 samples,
  max_new_tokens=64: a GRPO-sized batch whose samples mostly stop early.

Variants, run alternately (one of each per round, rotating the order) after one warm-up round:
``engine`` (EmbeddedEngine, default max_batch_size=64: 64 rows decode at once, the others join as rows
finish), ``engine-bs128`` (all 128 rows at once),
``hf`` (model.generate on the left-padded prompt batch, num_return_sequences=n; returns no
log-probs), ``hf+logprob`` (hf plus the extra teacher-forced forward TRL runs to get log-probs), and
``vllm-eager`` / ``vllm-compiled`` (megarl's VLLMEngine on vLLM's CPU build, without and with torch.compile; it
runs in a child process, a torch.distributed world of one, driven over a pipe so that its runs alternate with
the others'; its engine start-up and weight-sync seconds are reported once per case).
Each run records wall and CPU seconds and the process's involuntary context switches ("preempted": on a
machine shared with other work, OpenMP threads that lose their core spin and stall, inflating both times).
Before each run the script waits (up to ``--max-wait`` s) for the 1-min load average to drop below
``--wait-load`` and the CPU pressure (PSI avg10: share of time a runnable task waited for a core) below 20%;
a run that ends with the pressure above 20% is discarded and run again in a later round (at most 3x repeats
rounds).
Prints and writes a Markdown table to benchmarks/results/generate-<date>.md.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import logging
import os
import platform
import resource
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger("bench.generate")
SAMPLING = dict(temperature=0.8, top_p=0.95)
N_SAMPLES = 8
PRESSURE_LIMIT = 20.0  # default % CPU pressure (PSI avg10) to wait below before each round (--pressure-limit)
TARGET_EARLY_STOP = 1.5  # engine at least 1.5x faster than hf when most samples stop early; never slower otherwise
MID_25M = dict(vocab_size=8000, hidden_size=512, intermediate_size=1376, num_layers=6, num_heads=8, num_kv_heads=4)
ALL_VARIANTS = ("engine", "engine-bs128", "hf", "hf+logprob")
VLLM_VARIANTS = ("vllm-eager", "vllm-compiled")
CASES = {
    "tiny-early-stop": dict(shape=dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=4,
                                       num_heads=4, num_kv_heads=2), stop=(1,), eos_bias=(3.0, 3.5),
                            prompts=16, max_new=64, variants=ALL_VARIANTS),
    "mid-25M-no-stop": dict(shape=MID_25M, stop=(), eos_bias=None, prompts=16, max_new=64, variants=ALL_VARIANTS),
    "mid-25M-long": dict(shape=dict(MID_25M, max_positions=600), stop=(), eos_bias=None, prompts=4, max_new=512,
                         variants=("engine", "engine-dynamic-cache", "hf", *VLLM_VARIANTS)),
    "mid-25M-early-stop": dict(shape=MID_25M, stop=(1,), eos_bias=(3.0, 22.0), prompts=32, max_new=64,
                               variants=("engine", "hf", *VLLM_VARIANTS)),
}


def build_case(name: str):
    """(config, model, prompts, stop ids) of a benchmark case; random weights, fixed seeds."""
    from transformers import AutoModelForCausalLM

    from megarl.testing.tiny import randomize_, tiny_config

    case = CASES[name]
    config = tiny_config("llama", **case["shape"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)
    randomize_(model, seed=0)
    if case["eos_bias"] is not None:
        const, weight = case["eos_bias"]
        with torch.no_grad():
            model.model.embed_tokens.weight[:, 0] = const
            model.lm_head.weight[case["stop"][0]] = 0.0
            model.lm_head.weight[case["stop"][0], 0] = weight
    gen = torch.Generator().manual_seed(1)
    vocab = config.vocab_size
    prompts = [torch.randint(5, vocab, (int(torch.randint(8, 41, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(case["prompts"])]
    return config, model, prompts, case["stop"]


def engine_variant(config, model, prompts, stop, max_new: int, max_batch_size: int,
                   dynamic_cache: bool = False) -> Callable[[], dict]:
    from transformers import DynamicCache

    from megarl.rollout import EmbeddedEngine, SamplingParams

    class DynamicCacheEngine(EmbeddedEngine):
        """The engine with transformers' DynamicLayer (torch.cat per step): the baseline of GrowingLayer."""

        def _new_cache(self):
            return DynamicCache(config=self.model.config)

    engine = (DynamicCacheEngine if dynamic_cache else EmbeddedEngine)(config, pad_token_id=0,
                                                                       max_batch_size=max_batch_size)
    engine.update_weights(model.state_dict().items())
    engine.finish_weight_update()
    seed = iter(range(10**6))

    def run() -> dict:
        params = SamplingParams(n=N_SAMPLES, max_new_tokens=max_new, stop_token_ids=stop, seed=next(seed), **SAMPLING)
        out = engine.generate(prompts, params)
        return dict(tokens=int(out.response_lengths.sum()), stopped=out.finish_reasons.count("stop"))

    return run


def _left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def hf_variant(model, prompts, stop, max_new: int, with_log_probs: bool) -> Callable[[], dict]:
    ids, mask = _left_padded(prompts)
    model.generation_config.eos_token_id = None  # only the case's stop ids end a sample

    def run() -> dict:
        with torch.no_grad():
            seqs = model.generate(ids, attention_mask=mask, do_sample=True, top_k=0, max_new_tokens=max_new,
                                  num_return_sequences=N_SAMPLES, eos_token_id=list(stop) or None, pad_token_id=0,
                                  **SAMPLING)
            response = seqs[:, ids.shape[1]:]
            is_stop = torch.isin(response, torch.tensor(stop, dtype=torch.long))
            first = torch.where(is_stop.any(1), is_stop.int().argmax(1) + 1, response.shape[1])
            if with_log_probs:  # what TRL does: one more forward over prompt + response
                resp_mask = torch.arange(response.shape[1])[None] < first[:, None]
                full_mask = torch.cat([mask.repeat_interleave(N_SAMPLES, 0), resp_mask.long()], 1)
                positions = (full_mask.cumsum(1) - 1).clamp(min=0)
                logits = model(seqs, attention_mask=full_mask, position_ids=positions,
                               logits_to_keep=response.shape[1] + 1).logits[:, :-1].float()
                torch.log_softmax(logits / SAMPLING["temperature"], -1).gather(-1, response[..., None])
        return dict(tokens=int(first.sum()), stopped=int(is_stop.any(1).sum()))

    return run


def timed(fn: Callable[[], dict]) -> dict:
    """Result plus wall and CPU seconds and involuntary context switches (a sign of other load on the cores); a
    variant running in another process reports its own."""
    before, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    result = fn()
    wall, after = time.perf_counter() - wall, resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return dict(wall=wall, cpu=cpu, preempted=after.ru_nivcsw - before.ru_nivcsw) | result | dict(
        pressure=cpu_pressure())


def _vllm_child(conn, config: dict, weights: str, prompts, stop, max_new: int, eager: bool) -> None:
    """A world of one hosting a VLLMEngine; answers each seed from the pipe with one timed generate call."""
    from safetensors.torch import load_file

    from megarl.parallel.init import init_distributed
    from megarl.parallel.layout import ParallelLayout
    from megarl.rollout import SamplingParams
    from megarl.rollout.vllm_engine import VLLMEngine
    from megarl.testing.dist import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    init_distributed(ParallelLayout())
    start = time.perf_counter()
    engine = VLLMEngine.from_hf_config(config, tp=1, dtype=torch.float32, enforce_eager=eager, kv_cache_bytes=1 << 29,
                                       max_model_len=max(map(len, prompts)) + max_new + 1)
    startup = time.perf_counter() - start
    tensors = load_file(weights)
    syncs = []
    for _ in range(2):  # the second sync is the steady state
        start = time.perf_counter()
        engine.wake_up()
        engine.update_weights(list(tensors.items()))
        engine.finish_weight_update()
        syncs.append(time.perf_counter() - start)
    conn.send(dict(startup=startup, sync=syncs))
    while (seed := conn.recv()) is not None:
        params = SamplingParams(n=N_SAMPLES, max_new_tokens=max_new, stop_token_ids=stop, seed=seed, **SAMPLING)
        before, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        out = engine.generate(prompts, params)
        wall, after = time.perf_counter() - wall, resource.getrusage(resource.RUSAGE_SELF)
        conn.send(dict(tokens=int(out.response_lengths.sum()), stopped=out.finish_reasons.count("stop"), wall=wall,
                       cpu=after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
                       preempted=after.ru_nivcsw - before.ru_nivcsw))


class VLLMVariant:
    """VLLMEngine in a child process (vLLM keeps one engine's parallel state per process), called like the other
    variants; ``setup`` receives its start-up and weight-sync seconds; :meth:`close` ends the child."""

    def __init__(self, config, model, prompts, stop, max_new: int, eager: bool, setup: dict) -> None:
        import multiprocessing
        import tempfile

        from safetensors.torch import save_file

        weights = Path(tempfile.mkdtemp(prefix="bench-vllm-")) / "model.safetensors"
        save_file({n: t.contiguous() for n, t in model.state_dict().items() if n != "lm_head.weight"
                   or not config.tie_word_embeddings}, str(weights))
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_vllm_child, args=(child_conn, config.to_dict(), str(weights), prompts, stop,
                                                          max_new, eager), daemon=True)
        self.proc.start()
        setup.update(self.conn.recv())
        self.seed = iter(range(10**6))

    def __call__(self) -> dict:
        self.conn.send(next(self.seed))
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(timeout=60)


def bench_case(name: str, repeats: int, load_limit: float, max_wait: float, pressure_limit: float) -> dict:
    config, model, prompts, stop = build_case(name)
    engine = functools.partial(engine_variant, config, model, prompts, stop, CASES[name]["max_new"])
    hf = functools.partial(hf_variant, model, prompts, stop, CASES[name]["max_new"])
    make = {
        "engine": lambda: engine(max_batch_size=64),
        "engine-bs128": lambda: engine(max_batch_size=128),
        "engine-dynamic-cache": lambda: engine(max_batch_size=64, dynamic_cache=True),
        "hf": lambda: hf(with_log_probs=False),
        "hf+logprob": lambda: hf(with_log_probs=True),
    }
    setup: dict[str, dict] = {"vllm-eager": {}, "vllm-compiled": {}}
    vllm = functools.partial(VLLMVariant, config, model, prompts, stop, CASES[name]["max_new"])
    make |= {"vllm-eager": lambda: vllm(eager=True, setup=setup["vllm-eager"]),
             "vllm-compiled": lambda: vllm(eager=False, setup=setup["vllm-compiled"])}
    variants = {v: make[v]() for v in CASES[name]["variants"]}
    names = list(variants)
    runs: dict[str, list[dict]] = {v: [] for v in names}
    loads, discarded, attempt = [], 0, 0
    while min(map(len, runs.values())) < repeats and attempt < 3 * repeats + 1:
        order = names[attempt % len(names):] + names[: attempt % len(names)]
        for v in order:
            if len(runs[v]) >= repeats:
                continue
            wait_for_quiet(load_limit, pressure_limit, max_wait)
            loads.append(os.getloadavg()[0])
            result = timed(variants[v])
            contended = result["pressure"] > pressure_limit
            if attempt and not contended:  # attempt 0 warms up
                runs[v].append(result)
            discarded += bool(attempt and contended)
            logger.info("%s round %d %s: %.3f s, %s", name, attempt, v, result["wall"],
                        "discarded (CPU pressure above the limit)" if contended else "kept")
        attempt += 1
    for variant in variants.values():
        if isinstance(variant, VLLMVariant):
            variant.close()  # the next case runs without this engine
    params = sum(p.numel() for p in model.parameters())
    keys = ("wall", "cpu", "tokens", "stopped", "preempted", "pressure")
    med = {v: {k: statistics.median(r[k] for r in runs[v]) for k in keys} for v in names}
    return dict(name=name, params=params, prompt_lens=[len(p) for p in prompts], med=med, runs=runs,
                loads=loads, discarded=discarded, setup={v: s for v, s in setup.items() if s},
                pressure_limit=pressure_limit)


def verdict(case: dict) -> str:
    speedup = case["med"]["hf"]["wall"] / case["med"]["engine"]["wall"]
    if case["name"] == "tiny-early-stop":
        ok = speedup >= TARGET_EARLY_STOP
        return f"target >= {TARGET_EARLY_STOP}x faster than hf: {'MET' if ok else 'MISSED'} ({speedup:.2f}x)"
    text = f"target never slower than hf: {'MET' if speedup >= 1.0 else 'MISSED'} ({speedup:.2f}x)"
    if "engine-dynamic-cache" in case["med"]:
        gain = case["med"]["engine-dynamic-cache"]["wall"] / case["med"]["engine"]["wall"]
        text += f"; in-place KV cache (GrowingLayer) vs transformers' DynamicLayer: {gain:.2f}x faster"
    return text


def render(info: dict, cases: list[dict]) -> str:
    lines = [f"# Generation benchmark, {info['date']}", "",
             f"- megarl commit {info['commit']}; {os.cpu_count()} CPU cores ({info['cpu']}), no GPU; "
             f"{platform.platform()}",
             f"- Python {platform.python_version()}, torch {torch.__version__}, transformers {info['transformers']}; "
             f"torch.set_num_threads({torch.get_num_threads()})",
             f"- n={N_SAMPLES} samples per prompt (prompts and max_new_tokens per case), "
             f"do_sample temperature={SAMPLING['temperature']} top_p={SAMPLING['top_p']} top_k off; fp32; "
             f"medians of {info['repeats']} kept runs per variant after 1 warm-up round, variants alternating", ""]
    for c in cases:
        n_prompts, max_new = CASES[c["name"]]["prompts"], CASES[c["name"]]["max_new"]
        lines += [f"## {c['name']} ({c['params'] / 1e6:.2f} M parameters, {n_prompts} prompts x n={N_SAMPLES} = "
                  f"{n_prompts * N_SAMPLES} samples, max_new_tokens={max_new}, prompt lengths "
                  f"{min(c['prompt_lens'])}-{max(c['prompt_lens'])})", "",
                  f"1-min load average before each run: {min(c['loads']):.2f}-{max(c['loads']):.2f}; "
                  f"{c['discarded']} runs discarded (CPU pressure > {c['pressure_limit']:.0f}% right after them)", "",
                  "| variant | median wall s | min-max wall s | median CPU s | median preempted | median CPU pressure "
                  "| tokens | stopped | tokens/s | hf wall / variant wall | log-probs |", "|" + "---|" * 11]
        hf = c["med"]["hf"]["wall"]
        for v, m in c["med"].items():
            walls = [r["wall"] for r in c["runs"][v]]
            lp = "yes (from the sampling softmax)" if v.startswith(("engine", "vllm")) else (
                "yes (extra forward)" if v == "hf+logprob" else "no (none without output_scores)")
            lines.append(f"| {v} | {m['wall']:.3f} | {min(walls):.3f}-{max(walls):.3f} | {m['cpu']:.3f} | "
                         f"{m['preempted']:.0f} | {m['pressure']:.0f}% | "
                         f"{m['tokens']:.0f} | {m['stopped']:.0f} | {m['tokens'] / m['wall']:.0f} | "
                         f"{hf / m['wall']:.2f}x | {lp} |")
        lines += ["", f"**{verdict(c)}** (default engine, wall-clock medians)", ""]
        for v, st in c["setup"].items():
            lines += [f"- {v}: engine start-up {st['startup']:.1f} s; weight sync {st['sync'][0]:.2f} s (first), "
                      f"{st['sync'][1]:.2f} s (second)"]
        lines += [""] if c["setup"] else []
    return "\n".join(lines)


def cpu_pressure() -> float:
    """Percent of the last 10 s in which a runnable task waited for a CPU (Linux PSI); 0 where unavailable."""
    try:
        return float(Path("/proc/pressure/cpu").read_text().split()[1].split("=")[1])
    except (OSError, IndexError, ValueError):
        return 0.0


def wait_for_quiet(load_limit: float, pressure_limit: float, max_wait: float) -> None:
    """Sleep until the 1-min load average and the CPU pressure are below the limits (at most ``max_wait`` s)."""
    start = time.monotonic()
    while (os.getloadavg()[0] > load_limit or cpu_pressure() > pressure_limit) and time.monotonic() - start < max_wait:
        logger.info("load %.2f, CPU pressure %.0f%%: waiting", os.getloadavg()[0], cpu_pressure())
        time.sleep(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--wait-load", type=float, default=1.5,
                        help="before each round, wait for the 1-min load average to fall below this")
    parser.add_argument("--max-wait", type=float, default=300, help="longest wait for a quiet machine per round (s)")
    parser.add_argument("--pressure-limit", type=float, default=PRESSURE_LIMIT,
                        help="discard a run that ends with more CPU pressure (PSI avg10, %%) than this")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch.set_num_threads")
    parser.add_argument("--results", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    import transformers

    from megarl.bench.report import cpu_description

    root = Path(__file__).resolve().parents[1]
    date = datetime.date.today().isoformat()
    info = dict(date=date, repeats=args.repeats, transformers=transformers.__version__, cpu=cpu_description(),
                commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                      text=True).stdout.strip())
    out = args.results or root / "benchmarks" / "results" / f"generate-{date}.md"
    cases = []
    for name in args.cases.split(","):
        cases.append(bench_case(name, args.repeats, args.wait_load, args.max_wait, args.pressure_limit))
        out.write_text(render(info, cases) + "\n")  # after every case: a late interruption keeps the rest
    print(render(info, cases))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
