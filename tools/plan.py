#!/usr/bin/env python
"""Plan a layout: memory per GPU in every hybrid-engine phase, resharding traffic, config overrides.

    python tools/plan.py --preset llama3-70b --nodes 8 --gpus-per-node 8 --gpu-mem-gb 80 [--tp 8 --pp 4 --rollout-tp 8]
    python tools/plan.py --hf-config /models/Qwen2.5-7B --nodes 1 --gpus-per-node 8 --gpu-mem-gb 80
    python tools/plan.py --preset qwen3-30b-a3b --nodes 1 --gpus-per-node 8 --gpu-mem-gb 80 --tp 1 --pp 1 --ep 8
    python tools/plan.py --preset llama3-70b --nodes 8 --gpus-per-node 8 --gpu-mem-gb 80 --rollout-gpus 16 \
        --tp 8 --pp 6 --gen-s 120 --train-s 90 --push-every 4
    python tools/plan.py --preset qwen2.5-7b --nodes 1 --gpus-per-node 8 --gpu-mem-gb 80 --tp 4 --lora-rank 32
    python tools/plan.py --preset llama3-8b --nodes 1 --gpus-per-node 8 --gpu-mem-gb 80 --tp 4 --cp 2 \
        --prompt-tokens 1024 --response-tokens 15360 --micro-batch-tokens 8192 --response-mean 6000

With --tp/--pp the given layout is reported (NOT FITTING with the reason when it does not fit);
without, the fitting layouts are listed cheapest first and the best one is reported. --rollout-gpus R
plans a split placement: the last R GPUs are the rollout engines' own pool (memory per pool, the bytes
each weight sync moves between the pools). --gen-s and --train-s (measured stage seconds) add the
predicted step time of each mode (colocated: sync; split: sync, one_step_off, async). A Mixture-of-Experts
model also gets expert parallelism: --ep for the given layout, every ep dividing the experts and tp*dp
among the proposals, and the all-to-all bytes per micro-batch in the report. --lora-rank R plans a LoRA
policy (policy.lora: the base frozen, gradients and optimizer state of the adapters only, no reference role)
with adapters on --lora-targets, and reports the adapter's size and the bytes of an adapter-only sync. --cp splits
every sequence over that many ranks (context parallelism, with --tp/--pp; proposals try it where one sequence
exceeds the micro-batch budget). Micro-batches are packed (the engine's default; --no-packing: padded rows);
--response-mean or --response-min (the responses' distribution, up to --response-tokens) adds the padding fraction
of a rank's pass over --rows-per-rank sequences, padded against packed. Exit status 0 either way; 2 for bad input
(unknown preset, a layout that does not divide the model or cluster).
"""

import argparse

from megarl.cli.common import run_cli


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--preset", help="published model config: llama3-8b, llama3-70b, qwen2.5-7b, qwen2.5-72b, "
                       "qwen3-30b-a3b (MoE)")
    model.add_argument("--hf-config", help="an HF config.json, or the model directory holding it")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--gpu-mem-gb", type=float, required=True, help="memory per GPU, decimal GB")
    p.add_argument("--intra-node-gbps", type=float, default=300.0, help="NVLink GB/s per GPU")
    p.add_argument("--inter-node-gbps", type=float, default=40.0, help="InfiniBand GB/s per GPU")
    p.add_argument("--reserved-gb", type=float, default=4.0, help="CUDA context, NCCL buffers, fragmentation")
    p.add_argument("--tp", type=int, help="training tensor-parallel size (with --pp: plan this layout)")
    p.add_argument("--pp", type=int, help="training pipeline-parallel size")
    p.add_argument("--vpp", type=int, help="virtual pipeline stages per rank")
    p.add_argument("--ep", type=int, help="expert-parallel size of an MoE model (with --tp/--pp; default 1)")
    p.add_argument("--cp", type=int, help="context-parallel size: every sequence split over cp ranks (with --tp/--pp; "
                   "default 1)")
    p.add_argument("--rollout-tp", type=int, help="rollout tensor-parallel size, 1 or tp (default: tp)")
    p.add_argument("--roles", help="comma-separated: policy, reference, critic (default: policy,reference,critic; "
                   "with --lora-rank policy,critic: a LoRA policy's base model is its reference)")
    p.add_argument("--precision", default="bfloat16", help="bfloat16 or float32")
    p.add_argument("--no-distributed-optimizer", action="store_true")
    p.add_argument("--micro-batch-tokens", type=int, default=2048, help="policy/critic micro_batch.max_tokens")
    p.add_argument("--micro-batch-rows", type=int, default=64, help="policy/critic micro_batch.max_size")
    p.add_argument("--no-packing", action="store_true", help="policy/critic packing: false (rows padded to the "
                   "micro-batch's longest)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--response-tokens", type=int, default=512, help="the longest response (rollout.max_new_tokens)")
    p.add_argument("--response-mean", type=float, help="mean response length: report the padding fraction")
    p.add_argument("--response-min", type=int, help="shortest response (default 1): report the padding fraction; "
                   "alone, responses uniform on min..--response-tokens")
    p.add_argument("--rows-per-rank", type=int, default=64, help="sequences one rank passes over, for the padding "
                   "fraction")
    p.add_argument("--recompute", default="selective", help="none, selective (or flash attention) or full")
    p.add_argument("--concurrent-seqs", type=int, default=256, help="sequences each rollout replica decodes at once")
    p.add_argument("--rollout-dtype", default="bfloat16")
    p.add_argument("--enforce-eager", action="store_true", help="rollout.engine.enforce_eager: no vLLM CUDA graphs")
    p.add_argument("--bucket-mb", type=float, default=64.0, help="rollout.engine.bucket_mb")
    p.add_argument("--top", type=int, default=5, help="proposed layouts to list")
    p.add_argument("--rollout-gpus", type=int, default=0,
                   help="split placement: the last N GPUs form the rollout pool (cluster.placement.rollout); "
                   "0: colocated")
    p.add_argument("--gen-s", type=float, help="measured generation seconds per step (timing/rollout_s)")
    p.add_argument("--train-s", type=float, help="measured seconds per step on the training pool (log-probs, "
                   "reference, values, updates)")
    p.add_argument("--sync-s", type=float, help="measured weight-sync seconds (default: the planned lower bound)")
    p.add_argument("--reward-s", type=float, default=0.0, help="measured reward seconds per step (timing/reward_s)")
    p.add_argument("--push-every", type=int, default=1, help="async mode: updates between weight pushes")
    p.add_argument("--lora-rank", type=int, help="policy.lora.rank: train rank-R adapters on a frozen base")
    p.add_argument("--lora-targets", help="policy.lora.targets with --lora-rank, comma-separated out of qkv, proj, "
                   "fc1, fc2 (default: all four)")
    args = p.parse_args()

    from megarl.engine.config import LoRAConfig, Precision
    from megarl.errors import ConfigError
    from megarl.parallel.layout import ParallelLayout
    from megarl.planner import Cluster, Recompute, Role, Workload, closest, load_model, plan_layout, propose
    from megarl.planner.report import padding_lines, proposals_table, render

    if (args.gen_s is None) != (args.train_s is None):
        raise ConfigError("--gen-s and --train-s go together: both measured stage times are needed for a step time.")
    if args.lora_targets is not None and args.lora_rank is None:
        raise ConfigError("--lora-targets chooses where a LoRA policy's adapters go; give --lora-rank too.")
    lora = None
    if args.lora_rank is not None:
        targets = [t.strip() for t in (args.lora_targets or "qkv,proj,fc1,fc2").split(",") if t.strip()]
        lora = LoRAConfig(rank=args.lora_rank, targets=targets)
    roles = args.roles or ("policy,critic" if lora else "policy,reference,critic")
    spec, name = load_model(args.preset, args.hf_config)
    cluster = Cluster(args.nodes, args.gpus_per_node, args.gpu_mem_gb, args.intra_node_gbps, args.inter_node_gbps,
                      args.reserved_gb, rollout_gpus=args.rollout_gpus)
    workload = Workload(
        roles=tuple(_choice(Role, r.strip(), "--roles") for r in roles.split(",") if r.strip()),
        precision=_choice(Precision, args.precision, "--precision"),
        distributed_optimizer=not args.no_distributed_optimizer, micro_batch_tokens=args.micro_batch_tokens,
        micro_batch_rows=args.micro_batch_rows, packing=not args.no_packing,
        prompt_tokens=args.prompt_tokens, response_tokens=args.response_tokens,
        recompute=_choice(Recompute, args.recompute, "--recompute"), rollout_dtype=args.rollout_dtype,
        concurrent_seqs=args.concurrent_seqs, bucket_mb=args.bucket_mb, enforce_eager=args.enforce_eager, lora=lora,
    )
    responses = _responses(args)
    if args.tp is not None or args.pp is not None or args.ep is not None or args.cp is not None:
        layout = ParallelLayout.for_world(cluster.train_gpus, tp=args.tp or 1, pp=args.pp or 1, vpp=args.vpp,
                                          ep=args.ep or 1, cp=args.cp or 1)
        rollout_tp = args.rollout_tp if args.rollout_tp is not None else layout.tp
        plan = plan_layout(spec, cluster, workload, layout, rollout_tp, name)
        print(render(plan))
        if responses is not None:
            print("\n".join(padding_lines(plan, responses, args.rows_per_rank)))
        _print_step_times(args, plan)
        return 0
    plans = propose(spec, cluster, workload, vpp=args.vpp, model_name=name)
    if not plans:
        near = closest(spec, cluster, workload, vpp=args.vpp, model_name=name)
        print("no layout fits this cluster; the closest one:\n" if near else "no layout divides this model and cluster")
        if near:
            print(render(near, with_reshard=False))
        return 0
    print(proposals_table(plans, args.top))
    print("\nbest:\n" + render(plans[0]))
    if responses is not None:
        print("\n".join(padding_lines(plans[0], responses, args.rows_per_rank)))
    _print_step_times(args, plans[0])
    return 0


def _responses(args):
    """The response-length distribution the padding report is for, or None when neither flag gives one."""
    from megarl.planner import ResponseLengths

    if args.response_mean is None and args.response_min is None:
        return None
    low = args.response_min or 1
    if args.response_mean is None:
        return ResponseLengths(low, args.response_tokens)
    return ResponseLengths.from_mean(args.response_tokens, args.response_mean, low)


def _print_step_times(args, plan) -> None:
    """The modes' predicted step times, when measured stage times were given (the sync's: given, or planned)."""
    if args.gen_s is None:
        return
    from megarl.planner import StageTimes, predict_modes, step_time_lines

    if args.sync_s is not None:
        sync_s, source = args.sync_s, "given"
    else:
        sync_s, source = plan.reshard.seconds, "planned lower bound"
    times = StageTimes(gen_s=args.gen_s, train_s=args.train_s, sync_s=sync_s, reward_s=args.reward_s)
    predictions = predict_modes(times, split=plan.cluster.split, push_every=args.push_every)
    print("\n" + "\n".join(step_time_lines(times, predictions, sync_source=source)))


def _choice(enum_cls, value, flag):
    from megarl.errors import ConfigError

    try:
        return enum_cls(value)
    except ValueError:
        raise ConfigError(f"{flag}: unknown value {value!r}; choose from {[e.value for e in enum_cls]}.") from None


if __name__ == "__main__":
    run_cli(main)
