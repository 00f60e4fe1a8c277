"""``python -m megarl.train CONFIG.yaml [key.path=value ...]`` (same as ``megarl train``)."""

from __future__ import annotations

import sys

from megarl.cli.main import main

if __name__ == "__main__":
    sys.argv = [sys.argv[0], "train", *sys.argv[1:]]
    main()
