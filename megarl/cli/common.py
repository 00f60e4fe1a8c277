"""Shared CLI plumbing: logging setup and turning MegarlError into a one-paragraph message + exit 2."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Callable

from megarl.errors import MegarlError


def run_cli(main: Callable[[], int]) -> None:
    """Run ``main``; a MegarlError prints its message (no traceback) and exits with status 2."""
    logging.basicConfig(level=os.environ.get("MEGARL_LOG_LEVEL", "INFO"), format="%(levelname)s %(name)s: %(message)s")
    # megatron-core warns about missing apex / TE on every import: expected on CPU, not actionable.
    warnings.filterwarnings("ignore", message=".*(Apex|apex|Transformer Engine|TransformerEngine|full scope).*")
    logging.getLogger("megatron").setLevel(logging.WARNING)
    try:
        code = main()
    except MegarlError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    sys.exit(code)
