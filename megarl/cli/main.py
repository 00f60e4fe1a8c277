"""``megarl`` command line: ``megarl train CONFIG.yaml [key.path=value ...]`` runs the built-in step program (or
``trainer.program``); ``megarl run PROGRAM.py[:function] CONFIG.yaml [key.path=value ...]`` runs a user's (the file's
``step`` by default; docs/programming.md §3): the same command with ``trainer.program`` set."""

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
    args = parser.parse_args()
    run_cli(lambda: args.fn(args))


if __name__ == "__main__":
    main()
