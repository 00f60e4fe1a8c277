"""``megarl`` command line: ``megarl train CONFIG.yaml [key.path=value ...]`` runs the built-in step program (or
``trainer.program``); ``megarl run PROGRAM.py[:function] CONFIG.yaml [key.path=value ...]`` runs a user's (the file's
``step`` by default; docs/programming.md §3): the same command with ``trainer.program`` set; ``megarl rehearse
RECIPE.yaml`` runs a GPU recipe's model at its true widths, layers cut, on this machine (docs/rehearsal.md)."""

from __future__ import annotations

import argparse

from megarl.cli.common import run_cli


def _train(args: argparse.Namespace) -> int:
    from megarl.config.loader import read_data
    from megarl.host import allocator

    # once, before torch is imported (~4 s of a re-executed command): this command again, with
    # tcmalloc/jemalloc preloaded; only the allocator is read here, the whole config is checked next
    cluster = read_data(args.config, args.overrides).get("cluster")
    allocator.exec_with(allocator.Allocator(cluster.get("allocator", allocator.DEFAULT)
                                            if isinstance(cluster, dict) else allocator.DEFAULT))

    from megarl.config.checks import check_config
    from megarl.config.train import load_config

    cfg = load_config(args.config, args.overrides)
    check_config(cfg)  # config errors in ~4 s: before megatron-core and Ray are imported
    from megarl.trainer.trainer import run

    run(cfg)
    return 0


def _run(args: argparse.Namespace) -> int:
    program = args.program if ":" in args.program else f"{args.program}:step"
    args.overrides = [*args.overrides, f"trainer.program={program}"]
    return _train(args)


def _rehearse(args: argparse.Namespace) -> int:
    from megarl.bench import rehearse

    report = rehearse.run(args.config, args.workdir, keep=args.keep, layers=args.layers, world=args.world,
                          preset=args.preset, hf_config=args.hf_config, tp=args.tp, ep=args.ep, update=args.update,
                          rollout=args.rollout, device=args.device, train_dtype=args.train_dtype)
    print(rehearse.markdown(report))
    for line in report["failures"]:
        print(f"FAILED: {line}")
    print(f"report: {args.workdir}/rehearsal.md, rehearsal.json")
    return 1 if report["failures"] else 0


def main() -> None:
    parser = argparse.ArgumentParser(prog="megarl", description="Megatron-core + Ray RL post-training.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a policy (PPO, GRPO, ...) from a YAML config")
    train.add_argument("config", help="YAML config file (see examples/)")
    train.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. policy.optim.lr=1e-5")
    train.set_defaults(fn=_train)
    run = sub.add_parser("run", help="run a step program of your own (a Python file) with a YAML config")
    run.add_argument("program", help="path/to/program.py (its function `step`) or path/to/program.py:function")
    run.add_argument("config", help="YAML config file (see examples/)")
    run.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. policy.optim.lr=1e-5")
    run.set_defaults(fn=_run)
    rehearse = sub.add_parser("rehearse", help="rehearse a GPU recipe on this machine: its model at true widths, "
                              "layers cut (docs/rehearsal.md)")
    rehearse.add_argument("config", help="the recipe's YAML config (examples/*/config.yaml)")
    rehearse.add_argument("--layers", type=int, default=1, help="decoder layers kept (default 1)")
    rehearse.add_argument("--world", type=int, default=2, help="ranks of the world (default 2)")
    rehearse.add_argument("--device", default="cpu", help="cpu (gloo ranks, default) or cuda (NCCL ranks, rank r on "
                          "GPU r; the reference on the GPU too)")
    model = rehearse.add_mutually_exclusive_group()
    model.add_argument("--preset", help="the model's planner preset, where model.path is not on this machine")
    model.add_argument("--hf-config", help="the model's config.json, where model.path is not on this machine")
    rehearse.add_argument("--tp", type=int, help="tensor-parallel size (default: the recipe's, within the world)")
    rehearse.add_argument("--ep", type=int, help="expert-parallel size (default: the recipe's, within the world)")
    rehearse.add_argument("--workdir", default="outputs/rehearsal", help="where the model files and report go")
    rehearse.add_argument("--update", action="store_true", help="one SGD step too (the policy holds gradients)")
    rehearse.add_argument("--train-dtype", default="float32", help="the training copy: float32 (default) or bfloat16 "
                          "(HF weights written in bfloat16; half the bytes: the 70B's sync fits 24 GB at --world 1)")
    rehearse.add_argument("--rollout", action=argparse.BooleanOptionalAction, default=None,
                          help="run the sync and generation phases (default: where the planner says they fit)")
    rehearse.add_argument("--keep", action="store_true", help="keep the model files (GBs) in the workdir")
    rehearse.set_defaults(fn=_rehearse)
    args = parser.parse_args()
    run_cli(lambda: args.fn(args))


if __name__ == "__main__":
    main()
