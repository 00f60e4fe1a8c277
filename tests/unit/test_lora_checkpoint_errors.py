"""A LoRA run's checkpoint (adapters only) where something else is expected: a clear error that says what it is and
what to do. The checks read megarl_checkpoint.json only, so each directory here is that file alone (what
megarl writes for a LoRA checkpoint: ``CheckpointMeta.lora`` set); tests/distributed/test_lora_checkpoint.py writes
and exports real ones.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from megarl.checkpoint.format import CheckpointMeta, LoRAMeta, read_meta, write_meta
from megarl.errors import CheckpointError, UnsupportedModelError
from megarl.parallel.layout import ParallelLayout

REPO = Path(__file__).resolve().parents[2]


def _meta_dir(path: Path, hf_dir: Path, lora: LoRAMeta | None) -> Path:
    from megarl.models.spec import load_hf_config

    path.mkdir()
    write_meta(path, CheckpointMeta(hf_config=load_hf_config(hf_dir), layout=ParallelLayout(), padded_vocab_size=384,
                                    dtype="float32", megatron_core_version="0.16.0", lora=lora))
    return path


def _lora(targets=("qkv", "proj", "fc1", "fc2"), base="/runs/a/initial_checkpoint") -> LoRAMeta:
    return LoRAMeta(rank=8, alpha=16.0, dropout=0.05, targets=list(targets), base=base)


def test_metadata_records_the_adapter_and_a_models_reads_as_before(tiny_hf, tmp_path):
    ckpt = _meta_dir(tmp_path / "lora", tiny_hf("llama_gqa"), _lora())
    assert read_meta(ckpt).lora == _lora()
    model = _meta_dir(tmp_path / "model", tiny_hf("llama_gqa"), None)
    assert "lora" not in json.loads((model / "megarl_checkpoint.json").read_text())  # older megarl reads it too
    assert read_meta(model).lora is None


def test_lora_checkpoint_is_refused_as_a_model(tiny_hf, tmp_path):
    from megarl.checkpoint import mcore_io

    ckpt = _meta_dir(tmp_path / "step_000100", tiny_hf("llama_gqa"), _lora())
    with pytest.raises(CheckpointError, match=r"step_000100 is a LoRA training checkpoint: it holds rank-8 adapters on "
                                              r"\['qkv', 'proj', 'fc1', 'fc2'\] .*not a model; its base model is "
                                              r"/runs/a/initial_checkpoint. .*tools/convert_megatron_to_hf.py "
                                              r"--mcore-dir .*tools/export_peft.py.*resume its run"):
        mcore_io.load_model([], ckpt)  # every role's model is read here (the engine, a run's model.path)


def test_resume_needs_the_adapters_it_was_saved_with(tmp_path):
    from megarl.checkpoint.training import _check_adapters
    from megarl.engine.config import LoRAConfig

    saved = _lora()
    _check_adapters(saved, LoRAConfig(rank=8, alpha=16.0, dropout=0.0, targets=["fc2", "fc1", "proj", "qkv"]), tmp_path)
    with pytest.raises(CheckpointError, match=r"holds LoRA adapters of rank 8, alpha 16.0 .* but this role trains "
                                              r"every weight \(lora: null\); resume with the lora settings"):
        _check_adapters(saved, None, tmp_path)
    with pytest.raises(CheckpointError, match=r"but this role has lora rank 4, alpha 16.0"):
        _check_adapters(saved, LoRAConfig(rank=4, alpha=16.0), tmp_path)
    with pytest.raises(CheckpointError, match=r"holds a full model's training state, but this role trains LoRA "
                                              r"adapters .*resume it without lora, or start a new LoRA run from it"):
        _check_adapters(None, LoRAConfig(), tmp_path)


def test_merged_export_needs_its_base(tiny_hf, tmp_path):
    from megarl.checkpoint.convert import convert_megatron_to_hf

    ckpt = _meta_dir(tmp_path / "lora", tiny_hf("llama_gqa"), _lora(base=str(tmp_path / "moved")))
    with pytest.raises(CheckpointError, match=r"the base model of the LoRA checkpoint .*moved, is not a megarl "
                                              r"checkpoint .*pass where it is now \(--base-dir\)"):
        convert_megatron_to_hf(ckpt, tmp_path / "out")
    other = _meta_dir(tmp_path / "other", tiny_hf("qwen2_untied"), None)
    with pytest.raises(CheckpointError, match=r"other is not the model the LoRA checkpoint .* adapts"):
        convert_megatron_to_hf(ckpt, tmp_path / "out", base_dir=other)
    assert not (tmp_path / "out").exists()


def test_peft_export_refuses_expert_adapters(tiny_hf, tmp_path):
    from megarl.checkpoint.lora_export import export_peft

    ckpt = _meta_dir(tmp_path / "moe", tiny_hf("qwen3_moe"), _lora())
    with pytest.raises(UnsupportedModelError, match=r"has adapters on MoE experts \(\['decoder.layers.mlp.experts.*"
                                                    r"transformers 5 fuses .*export it merged instead"):
        export_peft(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_scalar_head_lora_checkpoints_are_not_exported(tiny_hf, tmp_path):
    from megarl.checkpoint.convert import convert_megatron_to_hf
    from megarl.checkpoint.lora_export import export_peft

    ckpt = _meta_dir(tmp_path / "critic", tiny_hf("llama_rm"), _lora())  # a LoRA critic's: its head is in neither
    for export in (export_peft, convert_megatron_to_hf):
        with pytest.raises(UnsupportedModelError, match=r"is of a model with a scalar head \(a critic\): the head is "
                                                        r"in neither it nor its base causal LM"):
            export(ckpt, tmp_path / "out")


def test_export_peft_tool_exits_2_on_a_full_model(tiny_hf, tmp_path, monkeypatch, capsys):
    import runpy

    model = _meta_dir(tmp_path / "model", tiny_hf("llama_gqa"), None)
    monkeypatch.setattr(sys, "argv", ["export_peft.py", "--mcore-dir", str(model), "--out-dir", str(tmp_path / "o")])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # what the tool sets (cpu_only); restored after the test
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(REPO / "tools" / "export_peft.py"), run_name="__main__")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "holds a full model, not LoRA adapters" in err and "convert_megatron_to_hf.py" in err
    assert "Traceback" not in err
