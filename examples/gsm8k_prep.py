#!/usr/bin/env python
"""GSM8K -> megarl prompt files: ``train.parquet`` and ``test.parquet`` with ``prompt`` and ``answer``.

Download the raw dataset once, on a machine with internet access (the ``main`` configuration's
parquet files land in ``RAW/main/``)::

    huggingface-cli download openai/gsm8k --repo-type dataset --local-dir /data/gsm8k_raw

then convert it (no network needed)::

    python examples/gsm8k_prep.py --raw-dir /data/gsm8k_raw --out-dir /data/gsm8k

Each output row holds
  - ``prompt``: chat messages ``[{"role": "user", "content": question + " " + INSTRUCTION}]``, the
    instruction verl's GSM8K preprocessing appends (verl ``examples/data_preprocess/gsm8k.py``);
  - ``answer``: the full GSM8K solution, unchanged; it ends in ``#### <number>``, which is what the
    built-in ``gsm8k`` reward (:class:`megarl.rewards.GSM8KReward`) extracts as the ground truth.

Only pyarrow is needed (no ``datasets``). Input without a ``question``/``answer`` column, or an answer
without ``#### <number>``, is refused with the file and row named.
"""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

from megarl.cli.common import run_cli
from megarl.data.prompts import DataError

logger = logging.getLogger(__name__)

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
INPUT_COLUMNS = ("question", "answer")
SPLITS = ("train", "test")
# GSM8K solutions end in "#### 72" (sometimes "#### 1,000" or "#### -3").
_FINAL_ANSWER = re.compile(r"####\s*-?\$?\d[\d,]*(?:\.\d+)?")


def make_prompt(question: str) -> list[dict[str, str]]:
    """The chat messages megarl prompts the policy with for one GSM8K question."""
    return [{"role": "user", "content": f"{question.strip()} {INSTRUCTION}"}]


def check_columns(found: list[str], where: str) -> None:
    missing = [c for c in INPUT_COLUMNS if c not in found]
    if missing:
        raise DataError(f"{where}: GSM8K rows need columns {list(INPUT_COLUMNS)}, found {sorted(found)} "
                        f"(missing {missing}); give the parquet files of openai/gsm8k's 'main' configuration")


def convert_rows(rows: list[dict], where: str = "input") -> list[dict]:
    """GSM8K rows (``question``, ``answer``) -> megarl rows (``prompt``, ``answer``); ``where`` names the
    source in errors."""
    if rows:
        check_columns(list(rows[0]), where)
    out = []
    for i, row in enumerate(rows):
        question, answer = row["question"], row["answer"]
        if not isinstance(question, str) or not question.strip():
            raise DataError(f"{where} row {i}: 'question' must be a non-empty string, found {question!r}")
        if not isinstance(answer, str) or not _FINAL_ANSWER.search(answer):
            raise DataError(f"{where} row {i}: 'answer' must be a GSM8K solution ending in '#### <number>', "
                            f"found {str(answer)[-80:]!r}")
        out.append({"prompt": make_prompt(question), "answer": answer})
    return out


def convert_file(src: str | Path, dst: str | Path) -> int:
    """Convert one GSM8K parquet file to a megarl prompt parquet; returns the number of rows written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    src, dst = Path(src), Path(dst)
    try:
        table = pq.read_table(src)
    except (OSError, pa.ArrowInvalid) as e:
        raise DataError(f"{src}: not a readable parquet file ({type(e).__name__}: {e})") from e
    check_columns(table.column_names, str(src))
    rows = convert_rows(table.select(list(INPUT_COLUMNS)).to_pylist(), where=str(src))
    if not rows:
        raise DataError(f"{src}: holds no rows")
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    schema = pa.schema([("prompt", pa.list_(message)), ("answer", pa.string())])
    dst.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), dst)
    return len(rows)


def find_split(raw_dir: str | Path, split: str) -> Path:
    """The one parquet file of ``split`` in a ``huggingface-cli download openai/gsm8k`` directory."""
    raw_dir = Path(raw_dir)
    found = sorted(raw_dir.glob(f"main/{split}-*.parquet")) or sorted(raw_dir.glob(f"{split}-*.parquet"))
    if len(found) != 1:
        raise DataError(f"{raw_dir}: expected one file main/{split}-*.parquet (from `huggingface-cli download "
                        f"openai/gsm8k --repo-type dataset --local-dir {raw_dir}`), found {[str(p) for p in found]}")
    return found[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--raw-dir", required=True, help="directory of `huggingface-cli download openai/gsm8k ...`")
    p.add_argument("--out-dir", required=True, help="where train.parquet and test.parquet are written")
    args = p.parse_args()
    for split in SPLITS:
        src = find_split(args.raw_dir, split)
        dst = Path(args.out_dir) / f"{split}.parquet"
        logger.info("%s: %d rows (%s -> %s)", split, convert_file(src, dst), src, dst)
    return 0


if __name__ == "__main__":
    run_cli(main)
