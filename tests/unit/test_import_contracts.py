"""Import contracts: the pure layers stay free of megatron-core, torch.distributed, Ray and vLLM.

megarl's own import graph is built from the source with ``ast`` (no module is imported): every
``import`` / ``from ... import`` anywhere in a module, function bodies included, except those under
``if TYPE_CHECKING:``; importing ``megarl.a.b`` also runs ``megarl/__init__.py`` and
``megarl/a/__init__.py``. A contract holds when no module reachable from a pure one imports a
forbidden package; a failure names the chain of imports that reaches it. (import-linter cannot
express this: it squashes ``torch.distributed`` into ``torch``.)
"""

from __future__ import annotations

import ast
import functools
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "megarl"

# Importable without megatron-core, torch.distributed, Ray or vLLM: the driver, the planner and the
# config checks use them; a package name covers all of its modules.
PURE = (
    "megarl.errors",
    "megarl.config",
    "megarl.data",
    "megarl.algos",
    "megarl.rewards",
    "megarl.multiturn",  # environments, tools, trajectories: the driver's side of a conversation
    "megarl.resharding.plan",
    "megarl.models.mapping",
    "megarl.models.spec",
    "megarl.models.adapters",  # LoRA factor names and their peft layout (export, adapter sync, planner)
    "megarl.checkpoint.format",
    "megarl.planner",  # the run's config (megarl.config.train) is part of megarl.config
    # what the driver reads of the workers: specs, results, the rollout contract, the report
    "megarl.controller.spec",
    "megarl.controller.handles",
    "megarl.engine.config",
    "megarl.engine.results",
    "megarl.roles.results",
    "megarl.resharding.stats",
    "megarl.resharding.buckets",
    "megarl.rollout.base",
    "megarl.rollout.config",
    "megarl.rollout.mismatch",
    "megarl.trainer.callbacks",
    "megarl.trainer.run",  # what a step program calls (megarl.program's Run; its train() starts the trainer)
    "megarl.bench.report",
)
FORBIDDEN = ("megatron", "torch.distributed", "ray", "vllm")
# Not even torch: the driver recognises checkpoints and the CLI sets up its processes before torch.
TORCH_FREE = ("megarl.errors", "megarl.parallel.layout", "megarl.checkpoint.format", "megarl.checkpoint.run",
              "megarl.checkpoint.manifest", "megarl.checkpoint.atomic", "megarl.checkpoint.cpu_only", "megarl.host",
              "megarl.trainer.lock", "megarl.trainer.signals")
# ``import megarl`` is cheap: nothing beyond the standard library.
HEAVY = ("torch", "megatron", "ray", "vllm", "transformers", "safetensors", "numpy")


@functools.cache
def modules() -> dict[str, Path]:
    """Every module of megarl by dotted name (a package by its own name, for its ``__init__.py``)."""
    found = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_statements(tree: ast.AST):
    """All Import / ImportFrom nodes and ``importlib.import_module("...")`` calls, outside TYPE_CHECKING blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield ast.Import(names=[ast.alias(name=node.args[0].value)], lineno=node.lineno)
        stack.extend(ast.iter_child_nodes(node))


def _with_parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


@functools.cache
def imports_of(module: str) -> dict[str, int]:
    """What ``module`` imports (dotted names, megarl's and external) -> the line of the first such import."""
    path = modules()[module]
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    found: dict[str, int] = {}

    def add(name: str, line: int) -> None:
        for target in _with_parents(name):  # importing a.b.c runs a and a.b first
            if target != module:
                found.setdefault(target, line)

    for node in _import_statements(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
            continue
        if node.level:  # relative: from the module's package
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module
        add(source, node.lineno)
        for alias in node.names:  # `from torch import distributed`, `from megarl.checkpoint import run`
            candidate = f"{source}.{alias.name}"
            if not candidate.startswith(PACKAGE + ".") or candidate in modules():
                add(candidate, node.lineno)
    return found


def _matches(name: str, prefixes: tuple[str, ...]) -> str | None:
    return next((p for p in prefixes if name == p or name.startswith(p + ".")), None)


def _roots(name: str) -> list[str]:
    return [m for m in modules() if m == name or m.startswith(name + ".")]


def violations(starts: list[str], forbidden: tuple[str, ...]) -> list[str]:
    """One chain per forbidden package reached from ``starts``, e.g.
    ``megarl.a:12 -> megarl.b:3 -> torch.distributed`` (line 12 of megarl.a imports megarl.b, ...)."""
    parent: dict[str, tuple[str, int] | None] = dict.fromkeys(starts)
    queue = deque(starts)
    reached: dict[str, str] = {}
    while queue:
        module = queue.popleft()
        for target, line in imports_of(module).items():
            if (bad := _matches(target, forbidden)) is not None:
                if bad not in reached:
                    links, at = [target, f"{module}:{line}"], module
                    while (up := parent[at]) is not None:
                        at, line_at = up
                        links.append(f"{at}:{line_at}")
                    reached[bad] = " -> ".join(reversed(links))
            elif target in modules() and target not in parent:
                parent[target] = (module, line)
                queue.append(target)
    return sorted(reached.values())


def test_the_graph_sees_function_level_imports_and_skips_type_checking():
    assert "megarl.parallel.mcore_compat" in imports_of("megarl.checkpoint.mcore_io")
    # a function-level import (conversion builds the model inside the function)
    assert "megarl.models.provider" in imports_of("megarl.checkpoint.convert")
    # only under TYPE_CHECKING: the engine is an annotation of a training checkpoint, not an import
    assert "megarl.engine.engine" not in imports_of("megarl.checkpoint.training")
    assert violations(["megarl.checkpoint.mcore_io"], FORBIDDEN)  # the check does find things


@pytest.mark.parametrize("layer", PURE)
def test_pure_layer_imports_no_distributed_runtime(layer):
    assert _roots(layer), f"{layer} is not a module of megarl: update PURE"
    found = violations(_roots(layer), FORBIDDEN)
    assert not found, f"{layer} must not import {', '.join(FORBIDDEN)}; it does through:\n  " + "\n  ".join(found)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_torch_free_modules(module):
    assert _roots(module), f"{module} is not a module of megarl: update TORCH_FREE"
    found = violations(_roots(module), ("torch", *FORBIDDEN))
    assert not found, f"{module} must not import torch; it does through:\n  " + "\n  ".join(found)


def test_importing_megarl_is_cheap():
    found = violations([PACKAGE], HEAVY)
    assert not found, "megarl/__init__.py must stay cheap; it imports:\n  " + "\n  ".join(found)


# Ray is the controller's business: the worker groups, pools and processes, and the driver's cluster facade.
RAY_IMPORTERS = {"megarl.controller.group", "megarl.controller.pools", "megarl.controller.process",
                 "megarl.trainer.cluster"}


def test_only_the_controller_imports_ray():
    direct = {m for m in modules() if _matches_any(imports_of(m), ("ray",))}
    assert direct == RAY_IMPORTERS, f"modules importing Ray: {sorted(direct)}, expected {sorted(RAY_IMPORTERS)}"


def _matches_any(targets: dict[str, int], forbidden: tuple[str, ...]) -> bool:
    return any(_matches(t, forbidden) is not None for t in targets)
