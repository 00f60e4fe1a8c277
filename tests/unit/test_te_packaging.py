"""Transformer Engine as megatron-core declares it: the pins megarl installs, and who decides TE is used.

References: megatron-core's installed metadata (its Requires-Dist on transformer-engine) and megatron-core's
own ``HAVE_TE`` flag (``megatron.core.extensions.transformer_engine``, which its TE classes check).
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]


def _mcore_te() -> Requirement:
    reqs = [Requirement(r) for r in importlib.metadata.requires("megatron-core") or []]
    (te,) = {str(r.specifier): r for r in reqs if r.name == "transformer-engine"}.values()  # dev and lts alike
    return te


def _setup_extra(name: str) -> list[str]:
    """An extras_require entry of setup.py, read without running it."""
    call = next(n for n in ast.walk(ast.parse((REPO / "setup.py").read_text()))
                if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup")
    extras = next(k.value for k in call.keywords if k.arg == "extras_require")
    return ast.literal_eval(extras)[name]


def test_te_extra_and_dockerfile_pin_are_megatron_cores_range():
    mcore = _mcore_te()
    assert str(mcore.specifier)  # megatron-core 0.16.1: >=2.9.0a0,<2.12.0
    (extra,) = (Requirement(r) for r in _setup_extra("te"))
    assert extra.name == "transformer-engine" and extra.specifier == mcore.specifier
    # the metapackage's "pytorch" extra is only the PyTorch extension; the core library is a core_cu* extra
    assert extra.extras == mcore.extras and "pytorch" in extra.extras
    assert any(e.startswith("core_cu") for e in extra.extras)

    dockerfile = (REPO / "Dockerfile").read_text()
    (pin,) = re.findall(r"^ARG TE_VERSION=(\S+)$", dockerfile, flags=re.M)
    assert mcore.specifier.contains(Version(pin), prereleases=True), (pin, str(mcore.specifier))
    (install,) = re.findall(r'"transformer_engine\[([a-z0-9_,]+)\]==\$\{TE_VERSION\}"', dockerfile)
    assert set(install.split(",")) == extra.extras


# A TE that imports but lacks part of the API megatron-core 0.16.1's TE extension imports (fp8_autocast), as a
# TE release outside megatron-core's range may: megatron-core's HAVE_TE is False there. The TE modules megatron-core
# imports elsewhere at import time are present, so megatron-core itself imports.
_TE_STAND_IN = {
    "transformer_engine/__init__.py": '__version__ = "2.20.2"\n',
    "transformer_engine/pytorch/__init__.py": "",
    "transformer_engine/pytorch/tensor/__init__.py": "class QuantizedTensor: ...\n",
    "transformer_engine/pytorch/fp8.py": "class FP8GlobalStateManager: ...\n",
}
_ANSWERS = ("from megatron.core.extensions import transformer_engine as mcore_te; import transformer_engine; "
            "from megarl.parallel import mcore_compat; "
            "print(transformer_engine.__file__, mcore_te.HAVE_TE, mcore_compat.transformer_engine_available())")


def test_megarl_uses_te_exactly_when_megatron_core_says_it_can(tmp_path):
    from megatron.core.extensions import transformer_engine as mcore_te

    from megarl.parallel import mcore_compat

    assert mcore_compat.transformer_engine_available() == (mcore_te.HAVE_TE and torch.cuda.is_available())
    for name, text in _TE_STAND_IN.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")]),
                        "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-c", _ANSWERS], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    where, have_te, megarl_te = out.stdout.split()
    assert where == str(tmp_path / "transformer_engine" / "__init__.py")  # the stand-in imported
    assert have_te == "False" and megarl_te == "False"
