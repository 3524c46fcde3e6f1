"""Huge pages for malloc in training processes (jaxrat.runtime.hugepages): when they are asked for, and the re-exec."""

import os
import subprocess
import sys

import pytest

from jaxrat.runtime import hugepages, platform_hint


@pytest.fixture
def capable(monkeypatch):
    monkeypatch.setattr(hugepages, "_glibc_has_tunable", lambda: True)
    monkeypatch.setattr(hugepages, "_thp_on_request", lambda: True)
    monkeypatch.setattr(hugepages.sys, "platform", "linux")


def test_the_tunable_is_added_to_the_users_own(capable):
    assert hugepages.environ({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    env = hugepages.environ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "PATH": "/bin"})
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "PATH": "/bin"}


@pytest.mark.parametrize("env", [
    {"JAXRAT_HUGEPAGES": "0"},  # the user's opt-out
    {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"},  # the user's own choice stays
    {"_JAXRAT_HUGEPAGES_REEXECUTED": "1"},  # never a second re-exec, whatever glibc made of the first
])
def test_nothing_is_added_where_the_user_or_an_earlier_exec_decided(capable, env):
    assert hugepages.environ(env) == env


def test_nothing_is_added_where_it_cannot_help(monkeypatch):
    monkeypatch.setattr(hugepages, "_glibc_has_tunable", lambda: True)
    monkeypatch.setattr(hugepages, "_thp_on_request", lambda: False)  # THP "always" or "never"
    assert hugepages.environ({}) == {}
    monkeypatch.setattr(hugepages, "_thp_on_request", lambda: True)
    monkeypatch.setattr(hugepages, "_glibc_has_tunable", lambda: False)  # musl, or glibc < 2.35
    assert hugepages.environ({}) == {}


def test_the_process_reexecutes_itself_once_with_its_own_command_line(tmp_path):
    """A real exec: interpreter flags and arguments survive, the pid stays, the tunable is on."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import os, sys\n"
        "print('start', os.getpid(), flush=True)\n"
        "from jaxrat.runtime import hugepages\n"
        "hugepages.reexec_if_wanted()\n"
        "print('env', os.environ.get('GLIBC_TUNABLES'), sys.flags.optimize, sys.argv[1:])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "JAXRAT_HUGEPAGES",
                                                            "_JAXRAT_HUGEPAGES_REEXECUTED")}
    out = subprocess.run([sys.executable, "-O", str(script), "a", "--b=c"], env=env, capture_output=True, text=True,
                         check=True, timeout=60).stdout.splitlines()
    expected_tunables = "glibc.malloc.hugetlb=1" if hugepages.wanted(env) else "None"
    starts = [line for line in out if line.startswith("start")]
    assert len(starts) == (2 if hugepages.wanted(env) else 1) and len(set(starts)) == 1  # same pid
    assert out[-1] == f"env {expected_tunables} 1 ['a', '--b=c']"


def test_a_gpu_run_keeps_its_allocator(monkeypatch):
    """Huge pages are a CPU-run setting: a process that will run on GPUs is not re-executed."""
    monkeypatch.setattr(hugepages, "_glibc_has_tunable", lambda: True)
    monkeypatch.setattr(hugepages, "_thp_on_request", lambda: True)
    monkeypatch.setattr(hugepages.sys, "platform", "linux")
    assert hugepages.environ({"JAX_PLATFORMS": "cpu"})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert "GLIBC_TUNABLES" not in hugepages.environ({"JAX_PLATFORMS": "cuda"})
    monkeypatch.setattr(platform_hint, "_gpu_plugin_installed", lambda: True)
    monkeypatch.setattr(platform_hint, "_gpu_device_present", lambda: True)
    assert "GLIBC_TUNABLES" not in hugepages.environ({})  # a CUDA plugin and a GPU: JAX will take the GPU
    assert hugepages.environ({"JAX_PLATFORMS": "cpu"})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
