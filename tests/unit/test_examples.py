"""examples/: every config loads and passes the pre-flight checks; the GPU examples' layouts divide their
models; examples/gsm8k_prep.py turns GSM8K rows into prompts megarl loads and the gsm8k reward scores.

Model dimensions are written here by hand from each model's HF ``config.json`` (not read from megarl),
so a layout that does not fit the real model fails here before anyone books a GPU cluster.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from megarl.config.checks import check_config
from megarl.config.train import load_config
from megarl.data.prompts import DataError, PromptConfig, load_prompts
from megarl.parallel.layout import ParallelLayout
from megarl.rewards import resolve_reward_function
from megarl.rollout.config import RolloutBackend

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CONFIGS = sorted(EXAMPLES.glob("*/*.yaml"))  # config.yaml, and the several configs of one task (offline programs)

# (num_hidden_layers, num_attention_heads, num_key_value_heads) from the HF config.json files:
QWEN25_05B = (24, 14, 2)  # huggingface.co/Qwen/Qwen2.5-0.5B-Instruct/blob/main/config.json
QWEN25_7B = (28, 28, 4)  # huggingface.co/Qwen/Qwen2.5-7B-Instruct/blob/main/config.json
LLAMA3_70B = (80, 64, 8)  # huggingface.co/meta-llama/Meta-Llama-3-70B-Instruct/blob/main/config.json
QWEN3_30B_A3B = (48, 32, 4)  # huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json (128 experts, top 8)

# example -> (model dims, expected training layout, GPUs)
GPU_EXAMPLES = {
    "ppo_gsm8k_qwen2.5_0.5b": (QWEN25_05B, ParallelLayout(tp=1, pp=1, dp=8), 8),
    "grpo_gsm8k_qwen2.5_7b": (QWEN25_7B, ParallelLayout(tp=2, pp=1, dp=4), 8),
    "dapo_gsm8k_qwen2.5_7b": (QWEN25_7B, ParallelLayout(tp=2, pp=1, dp=4), 8),
    "multiturn_gsm8k_python_qwen2.5_7b": (QWEN25_7B, ParallelLayout(tp=2, pp=1, dp=4), 8),
    "ppo_llama3_70b": (LLAMA3_70B, ParallelLayout(tp=8, pp=4, dp=2), 64),
    "grpo_gsm8k_qwen3_30b_a3b": (QWEN3_30B_A3B, ParallelLayout(tp=4, pp=1, dp=4, ep=8), 16),
    "grpo_lora_gsm8k_qwen2.5_7b": (QWEN25_7B, ParallelLayout(tp=2, pp=1, dp=4), 8),
}


# offline programs (docs/offline.md): example/config -> (model dims, layout, GPUs)
GPU_OFFLINE = {f"offline_qwen2.5_7b/{program}.yaml": (QWEN25_7B, ParallelLayout(tp=4, pp=1, dp=2), 8)
               for program in ("sft", "dpo", "reward_model")}


def test_examples_are_found():
    names = {p.parent.name for p in CONFIGS}
    assert set(GPU_EXAMPLES) <= names and "grpo_addition_tiny" in names
    assert {str(p.relative_to(EXAMPLES)) for p in CONFIGS} >= set(GPU_OFFLINE)


@pytest.mark.parametrize("name", sorted(GPU_OFFLINE))
def test_offline_gpu_layout_divides_the_model(name):
    (layers, heads, kv_heads), expected, gpus = GPU_OFFLINE[name]
    cfg = load_config(EXAMPLES / name)
    trained = cfg.roles()[0]
    layout = cfg.cluster.layout(trained)
    assert layout == expected and layout.world_size == gpus
    layout.check_model(num_layers=layers, num_attention_heads=heads, num_query_groups=kv_heads)
    engine = cfg.critic if trained.value == "critic" else cfg.policy
    assert engine.precision.value == "bfloat16" and cfg.cluster.pool(trained).device.value == "gpu"
    assert cfg.data.batch_size % layout.dp == 0


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_config_loads_and_passes_checks(path, tmp_path):
    cfg = load_config(path)
    # check_config needs model.path to be a directory; everything else (layout vs world, batch and
    # mini-batch divisibility, algorithm/role consistency) is checked as written.
    frozen = [f"{section}.model.path={tmp_path}" for section in ("teacher", "reward_model", "cost_model")
              if getattr(cfg, section) is not None]  # e.g. built by the example's task script
    check_config(load_config(path, [f"model.path={tmp_path}", *frozen]))
    assert cfg.trainer.output_dir and cfg.data.train


@pytest.mark.parametrize("name", sorted(GPU_EXAMPLES))
def test_gpu_layout_divides_the_model(name):
    (layers, heads, kv_heads), expected, gpus = GPU_EXAMPLES[name]
    cfg = load_config(EXAMPLES / name / "config.yaml")
    layout = cfg.cluster.layout()
    assert layout == expected and layout.world_size == gpus == cfg.cluster.pool().world_size
    layout.check_model(num_layers=layers, num_attention_heads=heads, num_query_groups=kv_heads)
    r = cfg.rollout.engine
    assert r.backend is RolloutBackend.VLLM and r.dtype.value == "bfloat16"
    assert cfg.policy.precision.value == "bfloat16" and cfg.cluster.pool().device.value == "gpu"
    # vLLM builds TP groups from consecutive ranks; the training tp (and 1) always match the plan's groups
    assert r.tp in (1, layout.tp)
    ParallelLayout(tp=r.tp).check_model(num_layers=layers, num_attention_heads=heads, num_query_groups=kv_heads)
    if cfg.algorithm.needs_critic:
        assert cfg.critic.precision.value == "bfloat16"


# ------------------------------------------------------------------------------------------ gsm8k


@pytest.fixture(scope="module")
def prep():
    spec = importlib.util.spec_from_file_location("gsm8k_prep", EXAMPLES / "gsm8k_prep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
RAW = [  # GSM8K-style rows (the first is GSM8K train row 0)
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
               "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"},
    {"question": "A shop sells 1,000 pens a day for 3 days. How many pens does it sell?",
     "answer": "It sells 1,000*3 = <<1000*3=3000>>3000 pens.\n#### 3,000"},
    {"question": "  The temperature is 2 degrees and drops by 5. What is it now?\n",
     "answer": "It is 2-5 = <<2-5=-3>>-3 degrees.\n#### -3"},
]


def _write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_gsm8k_prep_rows(prep, tmp_path):
    src = _write_parquet(tmp_path / "train-00000-of-00001.parquet", RAW)
    assert prep.convert_file(src, tmp_path / "out" / "train.parquet") == 3
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "out" / "train.parquet")
    assert table.column_names == ["prompt", "answer"]
    assert table.to_pylist() == [
        {"prompt": [{"role": "user", "content": RAW[0]["question"] + " " + INSTRUCTION}], "answer": RAW[0]["answer"]},
        {"prompt": [{"role": "user", "content": "A shop sells 1,000 pens a day for 3 days. How many pens does it "
                                                "sell? " + INSTRUCTION}], "answer": RAW[1]["answer"]},
        {"prompt": [{"role": "user", "content": "The temperature is 2 degrees and drops by 5. What is it now? "
                                                + INSTRUCTION}], "answer": RAW[2]["answer"]},
    ]


def test_gsm8k_prep_output_loads_and_scores(prep, tmp_path):
    from megarl.testing.tiny import make_tokenizer

    prep.convert_file(_write_parquet(tmp_path / "raw.parquet", RAW), tmp_path / "train.parquet")
    data = load_prompts(str(tmp_path / "train.parquet"), PromptConfig(max_prompt_length=10_000),
                        make_tokenizer())
    assert len(data) == 3 and data.num_filtered == 0
    reward = resolve_reward_function("gsm8k")  # what the examples' reward.function names
    truths = ["72", "3000", "-3"]
    for record, truth in zip(data.records, truths, strict=True):
        assert record.text.endswith(INSTRUCTION) and record.row == {"answer": RAW[record.index]["answer"]}
        assert reward(record.text, f"Step by step ... so the answer is\n#### {truth}", record.row) == 1.0
        assert reward(record.text, f"#### {int(truth) + 1}", record.row) == 0.0


def test_gsm8k_prep_finds_the_downloaded_files(prep, tmp_path):
    (tmp_path / "main").mkdir()
    for split in ("train", "test"):
        _write_parquet(tmp_path / "main" / f"{split}-00000-of-00001.parquet", RAW)
    assert prep.find_split(tmp_path, "test") == tmp_path / "main" / "test-00000-of-00001.parquet"
    with pytest.raises(DataError, match="expected one file main/validation"):
        prep.find_split(tmp_path, "validation")


@pytest.mark.parametrize("rows, match", [
    ([{"prompt": "x", "answer": "#### 1"}], r"need columns \['question', 'answer'\], found \['answer', 'prompt'\]"),
    ([{"question": "q", "answer": "the answer is 4"}], r"row 0: 'answer' must be a GSM8K solution ending in"),
    ([RAW[0], {"question": "", "answer": "#### 1"}], r"row 1: 'question' must be a non-empty string"),
])
def test_gsm8k_prep_refuses_bad_input(prep, tmp_path, rows, match):
    src = _write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(DataError, match=match) as info:
        prep.convert_file(src, tmp_path / "out.parquet")
    assert str(src) in str(info.value) and not (tmp_path / "out.parquet").exists()


def test_moe_example_fits_the_planner():
    """The Qwen3-30B-A3B example's layout divides the model (its 128 experts by ep 8, inside each stage's tp*dp)
    and fits 80 GB GPUs in every phase by the planner, with the example's own workload."""
    from megarl.planner.layouts import Cluster, Role, Workload, plan_layout
    from megarl.planner.presets import preset_spec

    cfg = load_config(EXAMPLES / "grpo_gsm8k_qwen3_30b_a3b" / "config.yaml")
    spec, layout, pool = preset_spec("qwen3-30b-a3b"), cfg.cluster.layout(), cfg.cluster.pool()
    spec.check_layout(layout)
    work = Workload(roles=(Role.POLICY, Role.REFERENCE), micro_batch_tokens=cfg.policy.micro_batch.max_tokens,
                    prompt_tokens=cfg.data.max_prompt_length, response_tokens=cfg.rollout.max_new_tokens,
                    concurrent_seqs=128)
    plan = plan_layout(spec, Cluster(nodes=pool.nodes, gpus_per_node=pool.devices_per_node, gpu_mem_gb=80), work,
                       layout, cfg.rollout.engine.tp)
    assert plan.fits, plan.reason
    assert cfg.rollout.engine.gpu_memory_utilization >= plan.gpu_memory_utilization


def test_python_tool_of_the_multiturn_example():
    """The GSM8K example's tool runs a program and returns what it printed, or its error's last line."""
    spec = importlib.util.spec_from_file_location("python_tool", EXAMPLES / "multiturn_gsm8k_python_qwen2.5_7b" /
                                                  "tools.py")
    tools = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tools)
    assert tools.python("print(48 + 48 // 2)") == "72\n"
    assert tools.python("x = 1") == "(no output: print the values you need)"
    assert tools.python("print('a'); 1 / 0") == "a\nZeroDivisionError: division by zero"
