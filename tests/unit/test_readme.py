"""README.md's code map against the package tree, and the Chinese quick start against README.md.

The code map (the fenced block under "## Code map") lists each package as ``  name/  [summary:] module
(gloss), module (gloss), ...``, continued on deeper-indented lines: every package of ``megarl/`` (a directory
with an ``__init__.py``) must be listed, and every module it names (the first word of each comma-separated
item outside parentheses, after an optional summary ending in ``: ``) must exist as ``name.py`` or a
subpackage. README.zh-CN.md may only repeat: each command of its fenced code blocks is one of README.md's,
and each relative link resolves and is one of README.md's links (or README.md itself). CPU only, instant.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ZH = ROOT / "README.zh-CN.md"
PACKAGE = ROOT / "megarl"


def code_map(text: str) -> dict[str, str]:
    """Package name -> its entry's text (continuation lines joined)."""
    block = re.search(r"^## Code map\n.*?^```\n(megarl/\n.*?)^```", text, re.M | re.S)
    assert block, "README.md has no ## Code map section with a fenced block starting with megarl/"
    entries: dict[str, str] = {}
    current = None
    for line in block.group(1).splitlines()[1:]:
        head = re.match(r"^  (\w+)/\s+(.*)$", line)
        if head:
            current = head.group(1)
            assert current not in entries, f"package {current}/ listed twice"
            entries[current] = head.group(2)
        elif current and re.match(r"^ {4,}\S", line):
            entries[current] += " " + line.strip()
        else:
            current = None  # a top-level line (tools/ examples/ ...) ends the package list
    return entries


def _top_level_split(text: str, sep: str) -> list[str]:
    """``text`` cut at each ``sep`` outside parentheses and backticks."""
    parts, depth, quoted, start = [], 0, False, 0
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "`":
            quoted = not quoted
        elif not quoted and ch == "(":
            depth += 1
        elif not quoted and ch == ")":
            depth -= 1
        elif not quoted and depth == 0 and text.startswith(sep, i):
            parts.append(text[start:i])
            start = i + len(sep)
            i = start
            continue
        i += 1
    return parts + [text[start:]]


def named_modules(entry: str) -> list[str]:
    """The modules an entry names: the first word of each top-level item, after the optional summary."""
    head = _top_level_split(entry, ": ")
    items = _top_level_split(": ".join(head[1:]) if len(head) > 1 else entry, ", ")
    return [re.match(r"\s*([^\s(]+)", item).group(1) for item in items if item.strip()]


def packages() -> set[str]:
    return {p.parent.name for p in PACKAGE.glob("*/__init__.py")}


def test_the_code_map_lists_every_package_and_only_modules_that_exist():
    entries = code_map(README.read_text())
    assert set(entries) == packages(), (
        f"README.md's code map: packages missing {sorted(packages() - set(entries))}, listed but not packages "
        f"{sorted(set(entries) - packages())}")
    missing = []
    for package, entry in entries.items():
        modules = named_modules(entry)
        assert modules, f"code map entry {package}/ names no module: {entry!r}"
        here = PACKAGE / package
        missing += [f"megarl/{package}/{m}" for m in modules
                    if not (here / f"{m}.py").is_file() and not (here / m / "__init__.py").is_file()]
    assert not missing, f"README.md's code map names modules that do not exist: {missing}"


def test_the_code_map_parser_reads_what_it_must():
    text = "\n".join([
        "## Code map", "", "```", "megarl/",
        "  algos/       pure math: advantages (GAE, GRPO; see `x: y`), losses", "               (PPO), config",
        "  cli/         main (`megarl train`), common (errors: one paragraph, exit status)",
        "tools/  examples/", "```",
    ])
    entries = code_map(text)
    assert list(entries) == ["algos", "cli"]
    assert named_modules(entries["algos"]) == ["advantages", "losses", "config"]
    assert named_modules(entries["cli"]) == ["main", "common"]


def _commands(text: str) -> list[str]:
    """Each command line of the fenced code blocks (comments cut, spaces collapsed)."""
    out = []
    for block in re.findall(r"^```[\w-]*\n(.*?)^```", text, re.M | re.S):
        for line in block.splitlines():
            command = " ".join(line.split("#", 1)[0].split())
            if command:
                out.append(command)
    return out


def _links(text: str) -> set[str]:
    """Relative link targets ([text](target)), anchors cut."""
    return {t.split("#", 1)[0] for t in re.findall(r"\]\(([^)\s]+)\)", text)
            if not re.match(r"[a-z]+:", t) and not t.startswith("#")}


def test_the_chinese_quick_start_repeats_the_readme():
    zh, en = ZH.read_text(), README.read_text()
    assert "[README.zh-CN.md](README.zh-CN.md)" in en.split("\n## ", 1)[0], "README.md links the quick start at the top"
    commands = _commands(zh)
    assert {"make demo", "make test"} <= set(commands)
    assert not set(commands) - set(_commands(en)), (
        f"README.zh-CN.md runs commands README.md does not: {sorted(set(commands) - set(_commands(en)))}")
    links = _links(zh)
    assert "docs/tasks.md" in links  # the first task of one's own
    broken = sorted(link for link in links if not (ROOT / link).exists())
    assert not broken, f"README.zh-CN.md links to missing files: {broken}"
    extra = links - _links(en) - {"README.md"}
    assert not extra, f"README.zh-CN.md links to documents README.md does not: {sorted(extra)}"
