"""megarl.data.tokenizer: tokenizers load as saved; prompts a tokenizer would rewrite are refused before any worker.

The reference for "as saved" is the tokenizer object the demo builds in memory (same ids, vocabulary, special
tokens); the negative controls show what ``AutoTokenizer`` makes of the same directory (transformers 5.19: a
``Qwen2Tokenizer`` that drops spaces), so the tests prove the loader, not the files, makes the difference.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

from megarl.data.prompts import DataError, PromptConfig, load_prompts
from megarl.data.tokenizer import (
    describe_characters,
    load_tokenizer,
    lost_characters,
    round_trips,
    saved_tokenizer_class,
)
from megarl.errors import ConfigError
from megarl.testing import addition, lookup, tiny

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "grpo_addition_tiny" / "config.yaml"
SPACED = ["1 + 2 = 3", " 4+5 =", "6 +  1="]  # every character in the addition vocabulary


def _qwen2_config(out: Path, vocab_size: int) -> None:
    Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, architectures=["Qwen2ForCausalLM"]).save_pretrained(str(out))


@pytest.fixture(scope="module")
def demo_dirs(tmp_path_factory):
    """The addition and lookup tokenizers saved beside a Qwen2 config.json, as make_model saves them."""
    root = tmp_path_factory.mktemp("tokenizers")
    dirs = {}
    for name, maker in (("addition", addition.make_tokenizer), ("lookup", lookup.make_tokenizer)):
        out = root / name
        _qwen2_config(out, len(maker(out)))
        dirs[name] = (out, maker)
    return dirs


# ---- (a) the demo's tokenizers load as saved -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["addition", "lookup"])
def test_demo_tokenizer_loads_as_saved(demo_dirs, name):
    path, maker = demo_dirs[name]
    built = maker()  # the tokenizer object make_model saved
    loaded = load_tokenizer(path)
    assert type(loaded).__name__ == saved_tokenizer_class(path) and isinstance(loaded, PreTrainedTokenizerFast)
    assert loaded.get_vocab() == built.get_vocab() and len(loaded) == len(built)
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.unk_token) == (0, 1, None)
    assert loaded.chat_template == built.chat_template
    texts = SPACED if name == "addition" else ["? 1 2", "3 ?  4"]
    for text in texts:
        assert loaded.encode(text) == built.encode(text)
        assert loaded.decode(loaded.encode(text)) == text  # spaces kept
    assert all(t.exact for t in round_trips(loaded, texts))
    # negative control: AutoTokenizer rebuilds it as the Qwen2Tokenizer config.json's model type names, which
    # drops every space and adds <|endoftext|> at an id the model does not embed
    auto = AutoTokenizer.from_pretrained(path)
    assert type(auto).__name__ == "Qwen2Tokenizer", "AutoTokenizer no longer overrides the saved class: update"
    assert auto.decode(auto.encode(texts[0])) == texts[0].replace(" ", "")
    assert auto.convert_tokens_to_ids("<|endoftext|>") == len(built)
    assert [t.lost for t in round_trips(auto, texts)] == [(" ",)] * len(texts)


def test_real_model_tokenizers_load_as_autotokenizer_does(tmp_path):
    """A tokenizer that names a model-specific class (Qwen2.5's ``Qwen2Tokenizer``) or a generic one beside a
    model type that does not override it (Llama-3's ``PreTrainedTokenizerFast``), or that has no config.json beside
    it: the same class and ids as AutoTokenizer."""
    text = "Hello, world!\n  def f(x):\treturn x ** 2  # ünïcode 数学 🙂"
    cases = {}
    for name, saved_class, config in (("qwen25", "Qwen2Tokenizer", _qwen2_config),
                                      ("llama3", "PreTrainedTokenizerFast", None), ("alone", None, None)):
        out = tmp_path / name
        tiny.make_tokenizer(out)
        if saved_class is not None:
            file = out / "tokenizer_config.json"
            file.write_text(json.dumps(json.loads(file.read_text()) | {"tokenizer_class": saved_class}))
        if name == "qwen25":
            config(out, 300)
        elif name == "llama3":
            LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2).save_pretrained(str(out))
        ours, auto = load_tokenizer(out), AutoTokenizer.from_pretrained(out)
        assert type(ours) is type(auto)
        assert ours.encode(text) == auto.encode(text) and ours.get_vocab() == auto.get_vocab()
        assert ours.apply_chat_template([{"role": "user", "content": text}], tokenize=False) == \
            auto.apply_chat_template([{"role": "user", "content": text}], tokenize=False)
        cases[name] = type(ours).__name__
    assert cases["qwen25"] == "Qwen2Tokenizer"


def test_a_directory_without_a_tokenizer_is_named(tmp_path):
    _qwen2_config(tmp_path, 15)
    with pytest.raises(ConfigError, match=f"no tokenizer in {tmp_path}: none of tokenizer.json, "):
        load_tokenizer(tmp_path)  # AutoTokenizer returns an empty Qwen2Tokenizer here
    with pytest.raises(ConfigError, match=f"no tokenizer could be loaded from {tmp_path / 'missing'}"):
        load_tokenizer(tmp_path / "missing")


# ---- (c) byte-level BPE round-trips any text; what "equal" and "lost" mean ---------------------------------------


def test_byte_level_bpe_round_trips_arbitrary_text(tmp_path, caplog):
    tok = tiny.make_tokenizer()
    rng = random.Random(0)
    alphabet = ("abcXYZ019 +-=*/()[]{}<>'\"\\\t\n\r" "éüßñ" "数学日本語" "🙂🚀👩‍💻" "\u0301\u200b\u3000\xa0" "ﬁ①")
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80))) for _ in range(300)]
    texts += ["  leading spaces", "trailing spaces  ", "\n\nnewlines\n", "<|im_start|> literal special"]
    assert all(t.exact and t.decoded == t.text for t in round_trips(tok, texts))
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts if t.strip()))
    data = load_prompts(str(path), PromptConfig(max_unknown_token_share=0.0, max_prompt_length=4096), tok,
                        vocab_size=300)
    assert len(data) == sum(1 for t in texts if t.strip()) and data.num_unknown == 0
    assert "megarl.data.prompts" not in {r.name for r in caplog.records if r.levelname == "WARNING"}


def test_sentencepiece_style_leading_space_is_not_a_loss():
    """A Metaspace (Llama-2 style) tokenizer decodes ' hello' as 'hello': equal; a tab it cannot spell is lost."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "▁hello": 2, "▁world": 3, "▁": 4}, unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    trips = round_trips(fast, ["hello world", " hello", "hello  world", "hello\tworld"])
    assert [t.exact for t in trips] == [True, True, True, False]
    assert trips[1].decoded == "hello" and trips[3].lost == tuple("helo\twrd")


def test_lost_characters_and_their_names():
    assert lost_characters("after 5 comes", "5") == ("a", "f", "t", "e", "r", " ", "c", "o", "m", "s")
    assert lost_characters("ab\u00e9", "abe\u0301") == ()  # NFKC: the same text
    assert lost_characters("x\u00a0y", "x y") == ()  # a no-break space is a space under NFKC
    assert describe_characters([" ", "a", "\t", "\n", "\u200b", "é"]) == (
        "' ' (space), 'a', '\\t' (tab), '\\n' (newline), '\\u200b' (ZERO WIDTH SPACE), 'é'")
    assert describe_characters(list("abcd"), limit=2) == "'a', 'b', and 2 more"


# ---- (b) refused by the trainer before any worker starts; megarl train exits 2 --------------------------------


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = addition.make_task(tmp_path_factory.mktemp("addition"), train_rows=16, val_rows=4)
    rows = ["1+2=", "what is 3+4=", "5+1=", "2+2="]  # 'what is ' is outside the vocabulary (' ' is in it)
    (root / "letters.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": "3"}) + "\n" for p in rows))
    rows = ["1 + 2 =", "3 + 4 =", "5 + 1 =", "2 + 2 ="]  # in the vocabulary, with spaces
    (root / "spaced.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": "3"}) + "\n" for p in rows))
    return root


def _overrides(task, out, train):
    return [f"model.path={task / 'model'}", f"data.train={task / train}", f"data.val={task / 'val.jsonl'}",
            f"trainer.output_dir={out}", "data.batch_size=2", "data.max_prompt_length=32"]


class _Started(Exception):
    pass


@pytest.fixture
def no_start(monkeypatch):
    """Trainer._start (the output directory, Ray, the workers) raises instead of running."""
    from megarl.trainer.trainer import Trainer

    def start(self):
        raise _Started

    monkeypatch.setattr(Trainer, "_start", start)


def test_trainer_refuses_prompts_the_tokenizer_cannot_represent(task, tmp_path, no_start):
    from megarl.config.train import load_config
    from megarl.trainer.trainer import Trainer

    out = tmp_path / "out"
    cfg = load_config(EXAMPLE, _overrides(task, out, "letters.jsonl"))
    with pytest.raises(DataError) as e:
        Trainer(cfg)
    message = str(e.value)
    assert "letters.jsonl: 1 of 4 prompts (25.0%) hold pad/unknown token ids (pad '<|pad|>' (id 0))" in message
    assert "characters lost: 'w', 'h', 'a', 't', 'i', 's'" in message
    assert "above data.max_unknown_token_share=0.05" in message and "model.tokenizer" in message
    assert not out.exists()  # nothing written: the run never reached _start
    with pytest.raises(_Started):  # the clean file goes on to start the workers
        Trainer(load_config(EXAMPLE, _overrides(task, out, "spaced.jsonl")))


def test_trainer_would_have_refused_the_autotokenizer_one(task, tmp_path, no_start, monkeypatch):
    """The reported run: spaced prompts through AutoTokenizer's Qwen2Tokenizer lost their spaces without an
    unknown id, and trained to reward 0. With that loader put back, the round trip refuses them at start."""
    import megarl.trainer.trainer as trainer
    from megarl.config.train import load_config

    monkeypatch.setattr(trainer, "_load_tokenizer", AutoTokenizer.from_pretrained)
    cfg = load_config(EXAMPLE, _overrides(task, tmp_path / "out", "spaced.jsonl"))
    with pytest.raises(DataError, match=r"spaced\.jsonl: 4 of 4 prompts checked \(100\.0%\) change in a round trip "
                                        r"through the tokenizer, .*'1 \+ 2 =' comes back as '1\+2='\); characters "
                                        r"lost: ' ' \(space\) \(tokenizer Qwen2Tokenizer"):
        trainer.Trainer(cfg)


@pytest.mark.slow  # one `megarl train` process: ~10 s idle, 35 s on a loaded 2-core machine
def test_cli_exits_2_naming_the_lost_characters(task, tmp_path):
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("MEGARL_ALLOCATOR", "LD_PRELOAD")} | {"RAY_ADDRESS": ""}
    # one process, one step, no Ray: were the check to let the prompts through, the run would be short
    small = ["cluster.launcher=local", "cluster.pools.main.devices_per_node=1", "cluster.pools.main.tp=1",
             "trainer.total_steps=1"]
    proc = subprocess.run([sys.executable, "-m", "megarl.train", str(EXAMPLE), *_overrides(task, out, "letters.jsonl"),
                           *small], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "characters lost: 'w', 'h', 'a', 't', 'i', 's'" in proc.stderr
    assert "Traceback" not in proc.stderr and "Ray" not in proc.stderr and not out.exists()
