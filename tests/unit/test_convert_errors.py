"""Bad input to conversion: a clear one-paragraph error, and no output directory left behind."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.checkpoint.convert import convert_hf_to_megatron, convert_megatron_to_hf
from megarl.errors import CheckpointError, ConfigError, LayoutError, UnsupportedModelError

REPO = Path(__file__).resolve().parents[2]


def _assert_nothing_written(out):
    assert not out.exists(), f"{out} was left behind"
    assert not list(out.parent.glob(f".{out.name}.tmp-*")), "a temporary directory was left behind"


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture(tiny_hf, tmp_path):
    src = _copy(tiny_hf("llama_gqa"), tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(cfg | {"architectures": ["MistralForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match=r"MistralForCausalLM.*supports \['LlamaForCausalLM'"):
        convert_hf_to_megatron(src, tmp_path / "out")
    _assert_nothing_written(tmp_path / "out")


def test_tp_not_dividing_query_groups(tiny_hf, tmp_path):
    with pytest.raises(LayoutError, match=r"tp=4 must divide the number of key/value heads .*choose tp from \[1, 2\]"):
        convert_hf_to_megatron(tiny_hf("llama_gqa"), tmp_path / "out", tp=4)
    _assert_nothing_written(tmp_path / "out")


def test_hf_dir_without_config(tiny_hf, tmp_path):
    src = _copy(tiny_hf("llama_gqa"), tmp_path / "src")
    (src / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json.*save_pretrained"):
        convert_hf_to_megatron(src, tmp_path / "out")
    _assert_nothing_written(tmp_path / "out")


def test_corrupt_and_missing_hf_shards(tiny_hf, tmp_path):
    src = _copy(tiny_hf("llama_gqa"), tmp_path / "src")
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        convert_hf_to_megatron(src, tmp_path / "out")
    _assert_nothing_written(tmp_path / "out")
    (src / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="has no model.safetensors"):
        convert_hf_to_megatron(src, tmp_path / "out")
    _assert_nothing_written(tmp_path / "out")


def test_missing_shard_of_sharded_hf_checkpoint(tiny_hf, tmp_path):
    convert_hf_to_megatron(tiny_hf("llama_gqa"), tmp_path / "mc")
    convert_megatron_to_hf(tmp_path / "mc", tmp_path / "sharded", max_shard_bytes=100_000)
    next((tmp_path / "sharded").glob("model-00002-of-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-\d+.safetensors listed in .* is missing"):
        convert_hf_to_megatron(tmp_path / "sharded", tmp_path / "out")
    _assert_nothing_written(tmp_path / "out")


def test_missing_and_corrupt_megatron_shards(tiny_hf, tmp_path):
    convert_hf_to_megatron(tiny_hf("qwen2_untied"), tmp_path / "mc", tp=2)
    bad = _copy(tmp_path / "mc", tmp_path / "missing")
    for f in (bad / "weights").glob("__0_1.distcp"):
        f.unlink()
    with pytest.raises(CheckpointError, match="cannot read from the Megatron checkpoint"):
        convert_megatron_to_hf(bad, tmp_path / "out")  # fails half-way: the output must not survive
    _assert_nothing_written(tmp_path / "out")

    bad = _copy(tmp_path / "mc", tmp_path / "corrupt")
    for f in (bad / "weights").glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="Megatron checkpoint"):
        convert_megatron_to_hf(bad, tmp_path / "out")
    _assert_nothing_written(tmp_path / "out")

    with pytest.raises(CheckpointError, match="not a megarl Megatron checkpoint"):
        convert_megatron_to_hf(tmp_path, tmp_path / "out")
    _assert_nothing_written(tmp_path / "out")


def test_refuses_to_overwrite(tiny_hf, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("precious")
    with pytest.raises(ConfigError, match="already exists and is not empty"):
        convert_hf_to_megatron(tiny_hf("llama_gqa"), tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "precious"


def test_cli_prints_error_without_traceback(tmp_path):
    (tmp_path / "hf").mkdir()
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "convert_hf_to_megatron.py"), "--hf-dir", str(tmp_path / "hf"),
         "--out-dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert "error:" in proc.stderr and "no config.json" in proc.stderr and "Traceback" not in proc.stderr
    _assert_nothing_written(tmp_path / "out")
