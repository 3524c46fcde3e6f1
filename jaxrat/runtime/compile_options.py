"""XLA options for compiling the train and eval steps, per platform.

On a CPU the step's compile is most of the wait before the first step (a full RAT at 256 px: about
a minute on 2 cores), and most of that is LLVM optimising some 3,400 fused kernels at its default
level 2. Level 1 compiles the same program ~13% faster and runs it no slower
(``docs/history/cpu.md``), so the steps ask for it on CPU. A user's own
``--xla_backend_optimization_level`` in ``XLA_FLAGS`` wins: per-compile options would override it.
"""

from __future__ import annotations

import os
from typing import Any

CPU_OPTIMIZATION_LEVEL = 1


def step_compiler_options(platform: str) -> dict[str, Any]:
    """The ``compiler_options`` for ``jax.jit`` of a step running on ``platform`` ("cpu", "gpu", ...)."""
    if platform != "cpu" or "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", ""):
        return {}
    return {"xla_backend_optimization_level": CPU_OPTIMIZATION_LEVEL}
