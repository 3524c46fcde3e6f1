"""Which platform a run will train on, guessed before JAX starts (for process-level CPU settings).

Some settings only help a CPU run and must be made before JAX exists (glibc's huge pages at
process start, the CPU client's thread count), so the platform cannot be asked of JAX yet. This
reads what JAX will read: ``JAX_PLATFORMS`` when set, else whether a GPU plugin is installed and a
GPU device node exists. The model's kernels are chosen later, from the mesh's real devices
(:mod:`jaxrat.ops.policy`); this guess only decides the CPU process settings.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from typing import Mapping

_ACCELERATORS = ("cuda", "gpu", "rocm", "tpu")
_GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")


def _gpu_plugin_installed() -> bool:
    return any(importlib.util.find_spec(name) is not None for name in _GPU_PLUGINS)


def _gpu_device_present() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd"))


def expects_cpu(env: Mapping[str, str] | None = None) -> bool:
    """Whether a JAX process started with ``env`` (default ``os.environ``) will run on CPU devices."""
    env = os.environ if env is None else env
    platforms = env.get("JAX_PLATFORMS", env.get("JAX_PLATFORM_NAME", "")).strip().lower()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not (_gpu_plugin_installed() and _gpu_device_present())
