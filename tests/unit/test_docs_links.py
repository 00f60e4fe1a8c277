"""Every Markdown document the repository names must exist in it.

A token ending in ``.md`` in a text file of the repository (Python, Markdown, YAML, shell, TOML, the
Makefile and the Dockerfile) names a document. It resolves when a file of that path exists relative to
the citing file's directory or to the repository root. A bare file name (no directory part) also
resolves when some file of the repository has that name, since such citations name files that the
surrounding text locates (``the results file X``). Not checked: links whose target is a URL (their
text may name an upstream file), ``owner/repo:path`` citations of other repositories (the token
follows a colon), templates such as ``name-<date>.md``, and the output files that megarl's own tools
write (:data:`GENERATED`). This file is not scanned: its examples name missing documents on purpose.

The repository's files are ``git ls-files`` (tracked, plus untracked files git does not ignore, so a
new document counts before it is committed) that exist on disk. CPU only, well under a second.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TEXT_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".sh", ".sbatch", ".toml")
TEXT_NAMES = ("Makefile", "Dockerfile")
GENERATED = frozenset({"benchmark.md"})  # written by tools/benchmark.py into its output directory

# a token: ./ or ../ steps, then a word character, then word characters, / . - and a final .md; not preceded by
# a character that would make it the tail of a longer path, a URL or a `repo:path` citation; not followed by
# more path (x.mdx, x.md.bak, x.md/)
_TOKEN = re.compile(r"(?<![\w./:-])((?:\.\.?/)*\w[\w./-]*\.md)(?!\.?[\w/-])")
_URL_LINK = re.compile(r"\[[^\]]*\]\((?:https?|ftp)://[^)]*\)")


def repo_files(root: Path) -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=root,
                             capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"not a git checkout, or git is missing ({e}): cannot list the repository's files")
    return sorted({f for f in out.splitlines() if f and (root / f).is_file()})


def cited_documents(text: str) -> list[tuple[int, str]]:
    """(line number, token) of every Markdown document named in ``text``."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        for m in _TOKEN.finditer(_URL_LINK.sub("", line)):
            out.append((number, m.group(1)))
    return out


def resolves(token: str, citing: str, files: set[str], names: set[str]) -> bool:
    if os.path.basename(token) in GENERATED:
        return True
    here = os.path.dirname(citing)
    candidates = {os.path.normpath(os.path.join(here, token)), os.path.normpath(token)}
    if candidates & files:
        return True
    return "/" not in token and token in names


def broken_citations(root: Path) -> list[str]:
    files = repo_files(root)
    present, names = set(files), {os.path.basename(f) for f in files}
    broken = []
    this_file = os.path.relpath(Path(__file__).resolve(), root.resolve())  # its examples cite missing documents
    for f in files:
        if f == this_file or not (f.endswith(TEXT_SUFFIXES) or os.path.basename(f) in TEXT_NAMES):
            continue
        text = (root / f).read_text(encoding="utf-8", errors="replace")
        broken += [f"{f}:{n}: {tok}" for n, tok in cited_documents(text) if not resolves(tok, f, present, names)]
    return broken


def test_every_cited_markdown_document_exists():
    broken = broken_citations(REPO)
    assert not broken, (
        f"{len(broken)} citation(s) of Markdown documents that are not in the repository (add the document "
        "or point the citation at one that exists):\n" + "\n".join(broken)
    )


def test_the_scanner_finds_what_it_must_and_skips_what_it_may():
    missing = "DESIGN" + ".md"  # spelled in two parts so that this file does not cite it
    text = "\n".join([
        f"see {missing} section 2 and `docs/design.md`, README.md's table",
        "upstream: [docs/algo/baseline.md](https://github.com/org/repo/blob/main/docs/algo/baseline.md)",
        "org/repo:docs/notes.md and https://example.org/a/b.md and results/name-<date>.md",
        "(x.mdx, y.md.bak) [link](../launch/README.md).",
    ])
    assert [t for _, t in cited_documents(text)] == [missing, "docs/design.md", "README.md", "../launch/README.md"]
    files = {"docs/design.md", "README.md", "launch/README.md", "benchmarks/results/a-2026.md"}
    names = {os.path.basename(f) for f in files}
    assert not resolves(missing, "megarl/x.py", files, names)
    assert resolves("docs/design.md", "docs/planner.md", files, names)  # from the repository root
    assert resolves("design.md", "docs/planner.md", files, names)  # relative to the citing file
    assert resolves("../launch/README.md", "docs/planner.md", files, names)
    assert resolves("a-2026.md", "docs/vllm.md", files, names)  # a bare name found elsewhere
    assert not resolves("results/a-2026.md", "docs/vllm.md", files, names)  # a path must resolve as written
    assert resolves("out/benchmark.md", "tools/benchmark.py", files, names)  # a file the tools write
