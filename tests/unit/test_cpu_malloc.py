"""The scheduler process's allocator (server.model.cpu_malloc): tcmalloc preloaded where the OS
has it and the device is the CPU, the user's own LD_PRELOAD kept, each mode reachable."""

import subprocess
import sys

import pytest

from server.model import cpu_malloc
from server.options import ConfigError

LIB = "libtcmalloc_minimal.so.4"


def env(mode, device="cpu", environ=None, found=LIB, gpu=False):
    return cpu_malloc.malloc_env(mode, device, environ or {}, find=lambda: found,
                                 gpu=lambda: gpu)


def test_auto_preloads_tcmalloc_for_cpu_serving_where_the_os_has_it():
    assert env("auto") == {"LD_PRELOAD": LIB}
    assert env("auto", device="auto") == {"LD_PRELOAD": LIB}
    assert env("auto", found=None) == {}  # not installed: the C library's malloc
    assert env("auto", device="cuda") == {} and env("auto", device="cuda:1") == {}
    assert env("auto", device="auto", gpu=True) == {}  # --device auto would pick the GPU


def test_the_users_own_preload_is_kept_after_tcmalloc():
    assert env("auto", environ={"LD_PRELOAD": "/opt/libiomp5.so"}) == {
        "LD_PRELOAD": f"{LIB} /opt/libiomp5.so"}
    assert env("auto", environ={"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}) == {}


def test_system_never_preloads_and_tcmalloc_is_required_when_asked():
    assert env("system") == {}
    assert env("tcmalloc", device="cuda") == {"LD_PRELOAD": LIB}
    with pytest.raises(ConfigError, match="libtcmalloc_minimal is not installed"):
        env("tcmalloc", found=None)


def test_the_flag_is_validated_by_the_model_config():
    from server.model_config import ModelConfig

    with pytest.raises(ConfigError, match="cpu_malloc"):
        ModelConfig(cpu_malloc="jemalloc")


@pytest.mark.skipif(cpu_malloc.find_tcmalloc() is None, reason="no libtcmalloc_minimal here")
def test_a_process_started_with_the_env_runs_on_tcmalloc():
    """The real library, loaded by the dynamic loader into a fresh process (as the scheduler
    process is started)."""
    extra = cpu_malloc.malloc_env("tcmalloc", "cpu", {})
    maps = subprocess.run([sys.executable, "-c", "print(open('/proc/self/maps').read())"],
                          env={"PATH": "/usr/bin:/bin", **extra}, capture_output=True,
                          text=True, check=True).stdout
    assert "libtcmalloc_minimal" in maps
