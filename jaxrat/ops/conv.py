"""Which convolution the kernel policy picks for the layers that may take a CPU form."""

from __future__ import annotations

from typing import Callable, Optional

from jaxrat.ops.policy import KernelPolicy


def conv_general_dilated(policy: KernelPolicy) -> Optional[Callable]:
    """The ``conv_general_dilated`` a convolution layer should use under ``policy``: on the cpu
    policy the CPU forms (:mod:`jaxrat.ops.cpu.strided_conv`, which falls back to XLA's where
    they do not apply); None (XLA's own, the vendor's kernel on GPUs) otherwise."""
    if policy.cpu:
        from jaxrat.ops.cpu.strided_conv import conv_general_dilated as cpu_conv

        return cpu_conv
    return None
