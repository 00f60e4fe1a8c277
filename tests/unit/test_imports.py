"""The driver's modules import without side effects: no megatron-core, no Ray, no CPU redirection.

``megarl.parallel.cpu_compat.enable()`` installs a process-wide CUDA -> CPU TorchFunctionMode; only a
process that runs megatron-core turns it on (when it joins its world). The driver's configuration and
loop modules need checkpoint names and metadata only (``megarl.checkpoint.format``): they import no
megatron-core at all. A Ray run's driver also imports the role classes (and so megatron-core) to
address them, and must still leave torch untouched. Each check runs in a fresh interpreter: this test
process has imported megatron-core already.
"""

import json
import subprocess
import sys

import pytest

_PROBE = r"""
import json, sys
for name in sys.argv[1:]:
    __import__(name)
import torch
cc = sys.modules.get("megarl.parallel.cpu_compat")
modes = [type(m).__name__ for m in torch.overrides._get_current_function_mode_stack()]
print(json.dumps({
    "megatron": sorted(m for m in sys.modules if m == "megatron" or m.startswith("megatron.")),
    "ray": "ray" in sys.modules,
    "vllm": "vllm" in sys.modules,
    "mcore_compat": "megarl.parallel.mcore_compat" in sys.modules,
    "cpu_compat_enabled": bool(cc is not None and cc.is_enabled()),
    "function_modes": modes,
}))
"""


def _probe(*modules: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _PROBE, *modules], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


DRIVER = ("megarl.config.train", "megarl.trainer.trainer", "megarl.cli.main")


@pytest.mark.parametrize("modules", [(m,) for m in DRIVER] + [DRIVER])
def test_driver_imports_leave_torch_alone(modules):
    seen = _probe(*modules)
    assert seen["megatron"] == [], f"importing {modules} imported megatron-core: {seen['megatron'][:5]}"
    assert not seen["mcore_compat"]
    assert not seen["cpu_compat_enabled"], f"importing {modules} enabled megarl.parallel.cpu_compat"
    assert seen["function_modes"] == [], f"a TorchFunctionMode is active after importing {modules}"
    assert not seen["vllm"]


def test_a_ray_driver_addressing_the_roles_leaves_torch_alone():
    seen = _probe("megarl.trainer.trainer", "megarl.trainer.cluster")
    assert seen["megatron"], "the role classes import megatron-core (the probe would prove nothing otherwise)"
    assert not seen["cpu_compat_enabled"] and seen["function_modes"] == []


def test_config_and_cli_do_not_import_ray():
    assert not _probe("megarl.config.train", "megarl.cli.main")["ray"]


def test_import_megarl_imports_no_torch():
    proc = subprocess.run([sys.executable, "-c", "import sys, megarl; print(sorted(m for m in sys.modules if m in "
                           "('torch', 'megatron', 'ray', 'vllm', 'transformers')))"],
                          capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.strip() == "[]"
