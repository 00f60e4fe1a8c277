"""``layout: auto`` (megarl/config/auto.py, docs/planner.md §13): a pool's tp/pp/ep and rollout.engine.tp set to auto
become the planner's first fitting layout, as ``tools/plan.py`` prints its table for the same model, cluster and
workload; the dumped config.yaml records the choice and reloads to the same ints; no fit names the nearest miss.

The reference is ``tools/plan.py`` itself, run in this process with its command-line flags written out here (the
published presets' config.json files, so no download), not the resolver's own planning. The run config is the tiny
GRPO example's with the planner's default workload (bf16, micro-batches of 2048 tokens, prompt 512 + response 512,
policy + reference, vLLM colocated).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

from megarl.config.checks import check_config
from megarl.config.resolve import resolve
from megarl.config.train import dump_config, load_config, to_plain
from megarl.errors import ConfigError
from megarl.parallel.layout import Auto
from megarl.planner.presets import preset_config

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = ["data.max_prompt_length=512", "rollout.max_new_tokens=512", "policy.micro_batch.max_tokens=2048",
            "policy.precision=bfloat16", "rollout.engine.backend=vllm"]
ALL_AUTO = ["cluster.pools.main.tp=auto", "cluster.pools.main.pp=auto", "rollout.engine.tp=auto"]


def _config(tmp_path: Path, preset: str, nodes: int, overrides: list[str]):
    model = tmp_path / preset
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(preset_config(preset)))
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1="}\n')
    return load_config(ROOT / "examples" / "grpo_addition_tiny" / "config.yaml", [
        f"model.path={model}", f"data.train={tmp_path / 'train.jsonl'}", f"trainer.output_dir={tmp_path / 'run'}",
        f"cluster.pools.main.nodes={nodes}", "cluster.pools.main.devices_per_node=8",
        "cluster.pools.main.device_memory_gb=80", *WORKLOAD, *overrides])


def _plan_tool(argv: list[str], capsys) -> str:
    """What ``python tools/plan.py ARGV`` prints."""
    spec = importlib.util.spec_from_file_location("plan_tool", ROOT / "tools" / "plan.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    old = sys.argv
    sys.argv = ["plan.py", *argv]
    try:
        capsys.readouterr()
        assert tool.main() == 0
    finally:
        sys.argv = old
    return capsys.readouterr().out


def _table(preset: str, nodes: int, capsys) -> list[tuple[str, int]]:
    """(layout, rollout tp) of every row of the planner's proposals table, cheapest first."""
    out = _plan_tool(["--preset", preset, "--nodes", str(nodes), "--gpus-per-node", "8", "--gpu-mem-gb", "80",
                      "--roles", "policy,reference", "--top", "1000"], capsys)
    lines = out.split("\n\nbest:")[0].splitlines()
    assert "fitting layouts, cheapest first" in lines[0] and lines[1].split()[:2] == ["layout", "rollout"]
    return [(row.split()[0], int(row.split()[1].removeprefix("TP"))) for row in lines[2:]]


def _chosen(cfg) -> tuple[str, int]:
    return str(cfg.cluster.layout()), cfg.rollout.engine.tp


@pytest.mark.parametrize("preset, nodes, extra, expected", [
    ("qwen2.5-7b", 1, [], ("TP2xPP1xDP4", 2)),
    ("llama3-70b", 8, [], ("TP8xPP2xDP4", 8)),
    # MoE: ep auto too; the planner's first row is the layout examples/grpo_gsm8k_qwen3_30b_a3b sets by hand
    ("qwen3-30b-a3b", 2, ["cluster.pools.main.ep=auto"], ("TP4xPP1xDP4xEP8", 4)),
])
def test_auto_chooses_the_planners_first_row(tmp_path, capsys, preset, nodes, extra, expected):
    cfg = _config(tmp_path, preset, nodes, ALL_AUTO + extra)
    check_config(cfg)  # the auto sizes checked as decided
    resolved = resolve(cfg)
    table = _table(preset, nodes, capsys)
    assert _chosen(resolved) == table[0] == expected
    reason = resolved.cluster.pools["main"].auto_reason
    assert f"{expected[0]} with rollout TP{expected[1]}, the planner's rank 1 of {len(table)} fitting layouts" in reason


def test_fixed_sizes_are_kept(tmp_path, capsys):
    """tp set to 4: the first row with TP4 (rank 4 of the table); the embedded engine's rollout tp is 1."""
    table = _table("qwen2.5-7b", 1, capsys)
    cfg = resolve(_config(tmp_path, "qwen2.5-7b", 1, ["cluster.pools.main.tp=4", "cluster.pools.main.pp=auto",
                                                     "rollout.engine.tp=auto"]))
    first = next(row for row in table if row[0].startswith("TP4x"))
    assert _chosen(cfg) == first == ("TP4xPP1xDP2", 4)
    assert f"rank {table.index(first) + 1} of {len(table)}" in cfg.cluster.pools["main"].auto_reason
    assert "with tp=4 as set" in cfg.cluster.pools["main"].auto_reason
    embedded = resolve(_config(tmp_path, "qwen2.5-7b", 1, [*ALL_AUTO, "rollout.engine.backend=embedded"]))
    assert _chosen(embedded) == next(row for row in table if row[1] == 1)


def test_dumped_config_records_the_choice_and_reloads_to_it(tmp_path):
    cfg = _config(tmp_path, "qwen2.5-7b", 1, ALL_AUTO)
    resolved = resolve(cfg)
    dump_config(resolved, tmp_path / "config.yaml")
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())
    main = written["cluster"]["pools"]["main"]
    assert (main["tp"], main["pp"], main["ep"], written["rollout"]["engine"]["tp"]) == (2, 1, 1, 2)
    assert main["device_memory_gb"] == 80 and "planner's rank 1" in main["auto_reason"]
    reloaded = load_config(tmp_path / "config.yaml")
    assert reloaded == resolved and resolve(reloaded) == reloaded
    check_config(reloaded)


def test_no_fit_names_the_nearest_miss(tmp_path, capsys):
    """Llama-3-70B with a reference on 16 GPUs of 80 GB: the planner's closest layout, by how much it misses."""
    out = _plan_tool(["--preset", "llama3-70b", "--nodes", "2", "--gpus-per-node", "8", "--gpu-mem-gb", "80",
                      "--roles", "policy,reference"], capsys)
    assert out.startswith("no layout fits this cluster; the closest one")
    layout = next(line for line in out.splitlines() if line.startswith("layout: ")).split()[1]  # TP8xPP2xDP1
    need = next(line.strip() for line in out.splitlines() if line.strip().startswith("train phase needs"))
    total = float(need.split()[3])
    cfg = _config(tmp_path, "llama3-70b", 2, ALL_AUTO)
    with pytest.raises(ConfigError) as info:
        check_config(cfg)
    message = str(info.value)
    assert f"nearest miss is {layout} with rollout TP8, {total - 80:.1f} GB over per device" in message
    assert need in message and "more devices (cluster.pools.main.nodes)" in message
    assert layout == "TP8xPP2xDP1" and round(total - 80, 1) == 30.9


def test_auto_parses_from_yaml_and_overrides(tmp_path):
    cfg = _config(tmp_path, "qwen2.5-7b", 1, ALL_AUTO + ["cluster.pools.main.ep=auto"])
    main = cfg.cluster.pools["main"]
    assert (main.tp, main.pp, main.ep, cfg.rollout.engine.tp) == (Auto.AUTO,) * 4 and main.auto_sizes == (
        "tp", "pp", "ep")
    assert to_plain(cfg)["cluster"]["pools"]["main"]["tp"] == "auto"
    with pytest.raises(ConfigError, match="cluster.pools.main.tp: expected int or 'auto', found 'four'"):
        _config(tmp_path, "qwen2.5-7b", 1, ["cluster.pools.main.tp=four"])
    with pytest.raises(ConfigError, match="pp are auto, not yet decided"):
        _config(tmp_path, "qwen2.5-7b", 1, ["cluster.pools.main.pp=auto"]).cluster.layout()


def test_device_memory_is_needed(tmp_path, monkeypatch):
    """Without device_memory_gb and without a GPU on the driver, say what to set."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = _config(tmp_path, "qwen2.5-7b", 1, [*ALL_AUTO, "cluster.pools.main.device_memory_gb=null"])
    with pytest.raises(ConfigError, match="set cluster.pools.main.device_memory_gb"):
        resolve(cfg)


def test_auto_is_for_the_policys_pool(tmp_path):
    cfg = _config(tmp_path, "qwen2.5-7b", 1, ["cluster.pools.ref.devices_per_node=2", "cluster.pools.ref.tp=auto",
                                               "cluster.placement.reference=ref"])
    with pytest.raises(ConfigError, match=r"cluster.pools.ref.tp=auto: auto sizes are chosen for the policy's pool"):
        check_config(cfg)
