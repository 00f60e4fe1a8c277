"""docs/programming.md's Python listings run as written (issue #43: no listing drifts from the API)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "programming.md"
LISTINGS = re.findall(r"^```python\n(.*?)^```", GUIDE.read_text(), re.M | re.S)


def test_the_guide_has_listings():
    assert LISTINGS


@pytest.mark.parametrize("code", LISTINGS, ids=[f"listing{i}" for i in range(len(LISTINGS))])
def test_listing_runs(code):
    exec(compile(code, str(GUIDE), "exec"), {"__name__": "megarl_guide"})  # noqa: S102 - the guide's own code
