"""docs/tasks.md shows real code: every code block is a file of examples/successor_tiny (``<!-- file: PATH -->``: the
whole file; ``<!-- excerpt: PATH -->``: a part), or checked here against what it shows (the example row, the rendered
conversation, the console line, the commands, the table of demo and example settings). The example's reward
functions (both calling conventions, through megarl's own loader), its environment (a conversation played by hand)
and its multi-turn config (the config.yaml is checked with every example by test_examples and test_config_schema).
The training runs are tests/trainer/test_task_guide.py. CPU only, a few seconds.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "tasks.md"
EXAMPLE = ROOT / "examples" / "successor_tiny"
DEMO = ROOT / "examples" / "grpo_addition_tiny" / "config.yaml"
# an optional marker line, a blank line or none, then a fenced block
_BLOCK = re.compile(r"(?:<!-- (file|excerpt): (\S+) -->\n)?```(\w*)\n(.*?)```", re.DOTALL)


def _blocks() -> list[tuple[str | None, str | None, str, str]]:
    """(marker kind, path, language, text) of every fenced block of the guide."""
    return [m.groups() for m in _BLOCK.finditer(GUIDE.read_text())]


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"guide_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_code_block_is_a_file_or_checked_here():
    blocks = _blocks()
    assert len(blocks) >= 10
    for kind, path, language, text in blocks:
        if kind is not None:
            source = (ROOT / path).read_text()
            assert (text == source) if kind == "file" else (text in source), f"the guide's {path} differs from the file"
        else:  # the blocks checked by the tests below
            assert language in ("json", "bash", ""), f"a {language} block without a file marker:\n{text}"
    shown = {path for kind, path, _, _ in blocks if kind == "file"}
    assert shown == {f"examples/successor_tiny/{name}" for name in
                     ("task.py", "reward.py", "config.yaml", "curve.py", "env.py", "multiturn.yaml")}


def test_example_row_is_one_task_py_writes():
    (text,) = [t for _, _, language, t in _blocks() if language == "json"]
    row = json.loads(text)
    digit = int(row["prompt"].split()[1])
    assert row == {"prompt": f"after {digit} comes", "target": str((digit + 1) % 10)}


def test_commands_name_files_that_exist_and_configs_that_load():
    from megarl.config.train import load_config

    commands = [line for _, _, language, t in _blocks() if language == "bash" for line in t.splitlines()]
    assert len(commands) == 4
    for line in commands:
        command = line.split("#")[0].split()
        assert command[0] in (".venv/bin/python", "megarl"), line
        script = command[2] if command[0] == "megarl" else command[1]
        assert (ROOT / script).is_file(), line
        if script.endswith(".yaml"):
            load_config(ROOT / script)


def test_rendered_conversation_is_the_chat_templates():
    from megarl.toy import char_tokenizer

    task = _module("task")
    (text,) = [t for _, _, language, t in _blocks() if language == "" and t.startswith("<|user|>")]
    tokenizer = char_tokenizer("after comes 0123456789", specials=["<|user|>", "<|assistant|>"],
                               chat_template=task.CHAT_TEMPLATE)
    messages = [{"role": "user", "content": "after 3 comes"}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "after 7 comes"}, {"role": "assistant", "content": "8"}]
    assert text.strip() == tokenizer.apply_chat_template(messages, tokenize=False)


def test_console_line_has_the_trackers_labels_in_order():
    from megarl.metrics.tracking import CONSOLE_KEYS

    (text,) = [t for _, _, language, t in _blocks() if language == "" and t.startswith("step ")]
    assert re.fullmatch(r"step \d+/\d+ \[\d\d:\d\d<\d\d:\d\d, [\d.]+s/step\]( \S+=\S+)+\n", text)
    labels = [pair.split("=")[0] for pair in text.split("]", 1)[1].split()]
    assert labels == [k for k in CONSOLE_KEYS if k in labels] and {"reward", "val_reward", "s/step"} <= set(labels)


def test_settings_table_gives_the_demos_and_the_examples_values():
    from megarl.config.train import load_config

    configs = {"demo": load_config(DEMO), "here": load_config(EXAMPLE / "config.yaml")}
    values = {"data.max_prompt_length": lambda c: c.data.max_prompt_length,
              "rollout.max_new_tokens": lambda c: c.rollout.max_new_tokens,
              "data.batch_size": lambda c: c.data.batch_size, "rollout.sampling.n": lambda c: c.rollout.sampling.n,
              "policy.optim.lr": lambda c: c.policy.optim.lr}
    rows = {m.group(1): (m.group(2), m.group(3)) for m in
            re.finditer(r"^\| `([\w.]+)` \| ([^|]+) \| ([^|]+) \|", GUIDE.read_text(), re.MULTILINE)}
    assert set(values) <= set(rows)
    for key, get in values.items():
        demo, here = (float(cell) for cell in rows[key])
        assert (demo, here) == (get(configs["demo"]), get(configs["here"])), key


def test_reward_functions_in_both_conventions_score_by_hand():
    from megarl.rewards import resolve_reward_function, score_samples
    from megarl.rewards.conventions import Convention

    responses = ["4", " 4", "4<", "5", "", "45"]
    expected = [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    for name, convention in (("reward", Convention.KEYWORDS), ("reward_row", Convention.ROW)):
        fn = resolve_reward_function(f"{EXAMPLE / 'reward.py'}:{name}")
        assert fn.convention is convention
        rows = [{"target": "4"}] * len(responses)
        scores, info = score_samples(fn, ["after 3 comes"] * len(responses), responses, rows)
        assert scores.tolist() == expected and info.num_errors == 0, name
        assert fn("after 9 comes", "0", {"target": "0", "other": "x"}) == 1.0  # other columns do not disturb it


def test_environment_plays_a_conversation_as_its_docstring_says():
    from megarl.multiturn import Step

    env_module = _module("env")
    env = env_module.Successor()
    follow_up = env.digits[0]
    assert env.reset({"prompt": "after 9 comes", "target": "0"}) == [{"role": "user", "content": "after 9 comes"}]
    first = env.step(" 0")
    assert isinstance(first, Step) and first.reward == 0.5 and not first.done
    assert first.messages == [{"role": "user", "content": f"after {follow_up} comes"}]
    last = env.step(str(follow_up))  # the follow-up digit itself, not its successor: wrong
    assert last == Step([], reward=0.0, done=True)
    other = env_module.Successor()
    other.reset({"prompt": "after 1 comes"})
    other.step("3")
    assert other.step(str((other.asked + 1) % 10)).reward == 0.5 and env_module.TURNS == 2


def test_multiturn_config_passes_the_checks_and_builds_its_environment(tmp_path):
    from megarl.config.checks import check_config
    from megarl.config.train import load_config
    from megarl.multiturn.environment import environment_factory

    cfg = load_config(EXAMPLE / "multiturn.yaml", [f"model.path={tmp_path}",
                                                   f"rollout.multi_turn.environment={EXAMPLE / 'env.py'}:Successor"])
    check_config(cfg)
    make, tools = environment_factory(cfg.rollout.multi_turn)
    assert tools is None and type(make()).__name__ == "Successor"
    assert cfg.rollout.multi_turn.max_turns == _module("env").TURNS and cfg.reward.function is None


@pytest.mark.parametrize("name", ["README.md", "examples/README.md"])
def test_guide_is_linked(name):
    assert "tasks.md" in (ROOT / name).read_text()
