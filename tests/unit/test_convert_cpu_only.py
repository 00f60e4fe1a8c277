"""Conversion runs on the CPU even where CUDA is visible: the tools and the run's conversion child see no GPU.

With CUDA visible megarl builds a model on GPU 0 (the whole of it, in a conversion). The reference is the
environment the conversion runs with, as the child process holds it (asked in the child) and as the tool's
process holds it when the conversion is called: an empty ``CUDA_VISIBLE_DEVICES``, with which CUDA reports no
device.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("tool, module, function, args", [
    ("convert_hf_to_megatron", "convert", "convert_hf_to_megatron", ["--hf-dir", "hf", "--out-dir", "out"]),
    ("convert_megatron_to_hf", "convert", "convert_megatron_to_hf", ["--mcore-dir", "mc", "--out-dir", "out"]),
    ("export_peft", "lora_export", "export_peft", ["--mcore-dir", "mc", "--out-dir", "out"]),
])
def test_tools_convert_with_cuda_hidden(monkeypatch, tool, module, function, args):
    """The tool's conversion function is replaced by a recorder of the environment it would run in."""
    import importlib

    from megarl.checkpoint import convert

    seen = []

    def record(*_, **__):
        seen.append(os.environ.get("CUDA_VISIBLE_DEVICES"))
        return convert.ConversionSummary(function, 0, 0, 0.0, Path("out"))

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # a GPU machine's; restored after the test
    monkeypatch.setattr(importlib.import_module(f"megarl.checkpoint.{module}"), function, record)
    monkeypatch.setattr(sys, "argv", [tool, *args])
    assert _tool(tool).main() == 0
    assert seen == [""]


def _child_env(key: str) -> str | None:
    return os.environ.get(key)


@pytest.mark.dist  # starts the conversion child
def test_the_runs_conversion_child_converts_with_cuda_hidden_and_the_drivers_environment(tiny_hf, tmp_path,
                                                                                        monkeypatch):
    from megarl.checkpoint.format import read_meta
    from megarl.config.train import ClusterConfig
    from megarl.trainer.cluster import Conversions

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("MEGARL_DRIVER_PROBE", str(tmp_path))  # set now: after any fork server started
    conversions = Conversions(ClusterConfig(), {"policy": (tiny_hf("llama_gqa"), tmp_path / "initial_checkpoint")})
    try:
        seen = [conversions._executor.submit(_child_env, key).result(timeout=300)  # the child's, after its setup
                for key in ("CUDA_VISIBLE_DEVICES", "MEGARL_DRIVER_PROBE")]
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"  # the driver's own environment is as it was
        paths = conversions.result()
    finally:
        conversions.close()
    assert seen == ["", str(tmp_path)]
    assert paths == {"policy": tmp_path / "initial_checkpoint"}
    assert read_meta(paths["policy"]).layout.tp == 1  # the child converted
