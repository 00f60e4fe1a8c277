"""cluster.allocator: which library is preloaded, the errors for missing ones, and a real re-exec."""

import os
import subprocess
import sys

import pytest

from megarl.errors import ConfigError
from megarl.host import allocator
from megarl.host.allocator import Allocator


@pytest.fixture
def libdir(tmp_path, monkeypatch):
    """An empty library directory standing in for the system's."""
    monkeypatch.setattr(allocator, "search_dirs", lambda: [tmp_path])
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    return tmp_path


def test_resolution_and_environment(libdir, monkeypatch):
    assert allocator.resolve(Allocator.AUTO) == ("system", None)  # nothing installed: glibc, no error
    assert allocator.preload_env(Allocator.AUTO) == {"MEGARL_ALLOCATOR": "system"}
    with pytest.raises(ConfigError, match=r"tcmalloc is not installed .*libtcmalloc-minimal4.*cluster.allocator=auto"):
        allocator.resolve(Allocator.TCMALLOC)
    with pytest.raises(ConfigError, match="expected one of auto, system, tcmalloc, jemalloc, found 'mimalloc'"):
        Allocator("mimalloc")
    assert Allocator("jemalloc") is Allocator.JEMALLOC

    je = libdir / "libjemalloc.so.2"
    je.write_bytes(b"")
    assert allocator.resolve(Allocator.AUTO) == ("jemalloc", je)  # tcmalloc is preferred but absent
    monkeypatch.setenv("LD_PRELOAD", "/opt/user/libprofiler.so")  # the user's own preload stays, after ours
    assert allocator.preload_env(Allocator.AUTO) == {"MEGARL_ALLOCATOR": "jemalloc",
                                                     "MALLOC_CONF": allocator.JEMALLOC_CONF,
                                                     "LD_PRELOAD": f"{je} /opt/user/libprofiler.so"}
    monkeypatch.setenv("MALLOC_CONF", "narenas:1")  # the user's jemalloc settings win
    assert "MALLOC_CONF" not in allocator.preload_env(Allocator.JEMALLOC)

    tc = libdir / "libtcmalloc_minimal.so.4"
    tc.write_bytes(b"")
    monkeypatch.setenv("LD_PRELOAD", f"{tc}")  # already preloaded: not twice
    assert allocator.preload_env(Allocator.AUTO) == {"MEGARL_ALLOCATOR": "tcmalloc", "LD_PRELOAD": str(tc)}
    assert allocator.resolve(Allocator.JEMALLOC) == ("jemalloc", je)  # named explicitly: that one
    assert allocator.preload_env(Allocator.SYSTEM) == {"MEGARL_ALLOCATOR": "system"}


PROBE = """
import os, sys
from megarl.host import allocator
print("started", flush=True)
allocator.exec_with(allocator.Allocator(sys.argv[1]))
maps = open("/proc/self/maps").read()
print(os.environ["MEGARL_ALLOCATOR"], allocator.loaded(), sys.argv[2] in maps, sep="\\n")
"""


@pytest.mark.skipif(allocator.resolve(Allocator.AUTO)[1] is None,
                    reason="neither jemalloc nor tcmalloc is installed (Ray's wheel ships jemalloc: reinstall Ray)")
def test_exec_with_re_executes_once_with_the_library_mapped():
    name, lib = allocator.resolve(Allocator.AUTO)
    env = {k: v for k, v in os.environ.items() if k not in ("MEGARL_ALLOCATOR", "LD_PRELOAD")}

    def probe(setting: str) -> list[str]:
        return subprocess.run([sys.executable, "-c", PROBE, setting, str(lib.resolve())], capture_output=True,
                              text=True, env=env, timeout=60, check=True).stdout.split()

    # the command ran twice (before and after the exec), the second time with the library in its address space
    assert probe("auto") == ["started", "started", name, name, "True"]
    assert probe("system") == ["started", "system", "system", "False"]


def test_rays_jemalloc_is_found_without_importing_ray():
    """Every install has an allocator to preload: Ray's wheel ships jemalloc, and the CLI finds it before
    anything heavy (Ray included) is imported."""
    code = ("import sys\nfrom megarl.host import allocator\n"
            "print(allocator.search_dirs()[-1], allocator.find(allocator.Allocator.JEMALLOC), 'ray' in sys.modules)")
    ray_core, _, imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                           timeout=60, check=True).stdout.split()
    import ray

    assert ray_core == os.path.join(os.path.dirname(ray.__file__), "core") and imported == "False"
    assert os.path.isfile(os.path.join(ray_core, "libjemalloc.so"))
    # a machine without a system jemalloc (this one, CI) finds Ray's
    assert allocator.resolve(Allocator.AUTO)[1] is not None
