"""Shared CLI plumbing: logging, quiet third-party warnings, plain console output when it is not a terminal,
MegarlError -> one paragraph + its exit status (:mod:`megarl.errors`)."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Callable

from megarl.errors import MegarlError
from megarl.metrics.tracking import is_terminal

# megatron-core warns about missing apex / TE on every import (expected on CPU, not actionable), and
# torch about deprecated APIs megatron-core still calls. As PYTHONWARNINGS it reaches spawned workers.
_QUIET = (
    "ignore::FutureWarning,ignore::DeprecationWarning,ignore:Apex is not installed,"
    "ignore:Transformer Engine and Apex,ignore:full scope is deprecated,ignore:When using async grad allreduce"
)
# Output to CI, a file or `| tee`: one plain line per progress update. The run's own steps are log lines there
# (megarl.metrics.tracking); other libraries' tqdm bars (transformers' shard writes, ...) would redraw with \r, and
# Ray colours its forwarded worker lines. Environment variables: Ray's processes, started later, inherit them.
_PLAIN_CONSOLE = {"TQDM_DISABLE": "1", "RAY_COLOR_PREFIX": "0"}


def run_cli(main: Callable[[], int]) -> None:
    """Run ``main``; a MegarlError prints its message (no traceback) and exits with its status (2 for bad input)."""
    logging.basicConfig(level=os.environ.get("MEGARL_LOG_LEVEL", "INFO"), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    os.environ.setdefault("PYTHONWARNINGS", _QUIET)
    if not is_terminal():
        for key, value in _PLAIN_CONSOLE.items():
            os.environ.setdefault(key, value)
    warnings.simplefilter("ignore", FutureWarning)
    warnings.simplefilter("ignore", DeprecationWarning)
    for spec in _QUIET.split(",")[2:]:
        warnings.filterwarnings("ignore", message=spec.removeprefix("ignore:"))
    try:
        code = main()
    except MegarlError as e:
        print(f"{e.label}: {e}", file=sys.stderr)
        code = e.exit_code
    sys.exit(code)
