"""HF -> Megatron -> HF conversion: bit-exact round trips, sharded output, loadable by transformers.

Runs in the test process as a world of one (the conversion tools' own mode).
"""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from megarl.checkpoint import mcore_io
from megarl.checkpoint.convert import convert_hf_to_megatron, convert_megatron_to_hf
from megarl.checkpoint.format import read_meta


def _read_all(hf_dir):
    tensors = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118 (not a dict)
    return tensors


@pytest.mark.parametrize("model", ["llama_gqa", "qwen2_untied", "qwen2_tied"])
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_roundtrip_bit_exact(tiny_hf, tmp_path, model, tp, pp):
    src = tiny_hf(model)
    s1 = convert_hf_to_megatron(src, tmp_path / "mc", tp=tp, pp=pp)
    s2 = convert_megatron_to_hf(tmp_path / "mc", tmp_path / "hf")
    a, b = _read_all(src), _read_all(tmp_path / "hf")
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name
    assert s2.tensors == len(a) and s2.bytes == sum(t.numel() * t.element_size() for t in a.values())
    meta = read_meta(tmp_path / "mc")
    assert (meta.layout.tp, meta.layout.pp) == (tp, pp)
    assert meta.padded_vocab_size == 128 * tp * -(-300 // (128 * tp))  # Megatron-LM's padding rule
    assert s1.tensors == len(mcore_io.tensors_metadata(tmp_path / "mc")) or s1.tensors > 0
    # tiny_config's pad_token_id is 0: the summary says how megarl trains that row (docs/resharding.md §1.7)
    assert len(s1.notes) == 1 and s1.notes[0].startswith("embedding row 0 (pad_token_id) gets no gradient from the")
    assert s2.notes == ()


def test_qwen3_and_bf16_roundtrip(tiny_hf, tmp_path):
    src = tiny_hf("qwen3")
    convert_hf_to_megatron(src, tmp_path / "mc", tp=2, dtype="bfloat16")
    convert_megatron_to_hf(tmp_path / "mc", tmp_path / "hf")
    a, b = _read_all(src), _read_all(tmp_path / "hf")
    assert sorted(a) == sorted(b)
    for name in a:
        assert b[name].dtype == torch.bfloat16
        assert torch.equal(a[name].to(torch.bfloat16), b[name]), name
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


def test_sharded_output_loads_in_transformers_with_same_logits(tiny_hf, tmp_path):
    src = tiny_hf("llama_gqa")
    convert_hf_to_megatron(src, tmp_path / "mc", tp=2, pp=2)
    convert_megatron_to_hf(tmp_path / "mc", tmp_path / "hf", max_shard_bytes=100_000)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and all((tmp_path / "hf" / f).is_file() for f in files)
    ids = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(0))
    ref = AutoModelForCausalLM.from_pretrained(src).eval()
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, out(ids).logits)
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.decode(tok("hello world")["input_ids"]) == "hello world"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<|user|>hi")


@pytest.mark.parametrize("model", ["llama_rm", "qwen2_rm"])
def test_reward_model_roundtrip_bit_exact(tiny_hf, tmp_path, model):
    src = tiny_hf(model)
    convert_hf_to_megatron(src, tmp_path / "mc", tp=2, pp=2)
    convert_megatron_to_hf(tmp_path / "mc", tmp_path / "hf")
    a, b = _read_all(src), _read_all(tmp_path / "hf")
    assert "score.weight" in a and sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_saves_leave_no_checkpoint_writer_process(tiny_hf, tmp_path, monkeypatch):
    """megatron-core's writer would keep a spawned Manager process alive after the first save and fork
    2 writers per save; megarl's saves on CPU hand results through an in-process queue and write the
    buckets in this process, so no process is started at all (the bit-exact round trips above read
    what these writes produced)."""
    import multiprocessing
    import os

    forks = []
    real_fork = os.fork
    monkeypatch.setattr(os, "fork", lambda: forks.append(1) or real_fork())
    convert_hf_to_megatron(tiny_hf("llama_gqa"), tmp_path / "a")
    assert multiprocessing.active_children() == [] and forks == []
    convert_hf_to_megatron(tiny_hf("llama_gqa"), tmp_path / "b")
    assert multiprocessing.active_children() == []
    a = mcore_io.tensors_metadata(tmp_path / "a")
    assert sorted(a) == sorted(mcore_io.tensors_metadata(tmp_path / "b"))
