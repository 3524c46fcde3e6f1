"""Transparent huge pages for glibc's malloc in jaxrat's training processes (CPU speed).

XLA's CPU runtime allocates a step's temporaries afresh every step. glibc serves allocations
above 32 MiB with new memory maps and unmaps them when freed, so each step faults its working
memory (GiB at full resolution) in again, 4 KiB at a time. With the glibc tunable
``glibc.malloc.hugetlb=1`` malloc asks the kernel for transparent huge pages (``madvise``), 2 MiB
per fault, and the sparse RAT's step on a 2-core CPU ran about a fifth faster at 128-512 px
(benchmarks/rat_scaling.py; docs/history/cpu.md, "Huge pages"). glibc reads its
tunables only when a process starts, so ``python -m jaxrat.main`` re-executes itself once with the
tunable added. Nothing changes where it cannot help: another libc, glibc older than 2.35, or a
kernel whose huge pages are ``always`` (already on) or ``never``, and a process that will run on
GPUs (:func:`jaxrat.runtime.platform_hint.expects_cpu`). ``JAXRAT_HUGEPAGES=0`` opts out.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Mapping

from jaxrat.runtime import platform_hint

TUNABLE = "glibc.malloc.hugetlb"
OPT_OUT = "JAXRAT_HUGEPAGES"
_REEXECUTED = "_JAXRAT_HUGEPAGES_REEXECUTED"  # at most one re-execution, whatever glibc does with it
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _glibc_has_tunable() -> bool:
    lib, version = platform.libc_ver()
    try:
        return lib == "glibc" and tuple(int(p) for p in version.split(".")[:2]) >= (2, 35)
    except ValueError:
        return False


def _thp_on_request() -> bool:
    try:
        with open(THP_MODE) as f:
            return "[madvise]" in f.read()
    except OSError:
        return False


def wanted(env: Mapping[str, str]) -> bool:
    """Whether a process started with ``env`` would gain from the tunable and does not have it."""
    if env.get(OPT_OUT, "1").strip() == "0" or env.get(_REEXECUTED):
        return False
    if TUNABLE in env.get("GLIBC_TUNABLES", ""):
        return False  # set already, by us or by the user (whatever its value)
    return (sys.platform.startswith("linux") and _glibc_has_tunable() and _thp_on_request()
            and platform_hint.expects_cpu(env))


def environ(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default ``os.environ``) with the tunable added to ``GLIBC_TUNABLES`` where wanted."""
    env = dict(os.environ if base is None else base)
    if wanted(env):
        env["GLIBC_TUNABLES"] = ":".join(p for p in (env.get("GLIBC_TUNABLES", ""), f"{TUNABLE}=1") if p)
    return env


def reexec_if_wanted() -> None:
    """Re-execute this process's own command line with the tunable on, once; return if not wanted.

    Called first thing by the entry point, before JAX or any thread exists. ``exec`` keeps the
    process id, so launchers (srun, mpirun) and signals see the same process.
    """
    env = environ()
    if env.get("GLIBC_TUNABLES") == os.environ.get("GLIBC_TUNABLES"):
        return
    env[_REEXECUTED] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), env)
