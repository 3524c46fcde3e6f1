"""Which convolution the kernel policy picks for the layers that may take a CPU form."""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
from jax.sharding import PartitionSpec as P

from jaxrat.ops.per_device import splits
from jaxrat.ops.policy import KernelPolicy


def conv_general_dilated(policy: KernelPolicy) -> Optional[Callable]:
    """The ``conv_general_dilated`` a convolution layer should use under ``policy``: on the cpu
    policy the CPU forms (:mod:`jaxrat.ops.cpu.strided_conv`, which falls back to XLA's where
    they do not apply); elsewhere XLA's own (the vendor's kernel on GPUs) with the kernel whole."""
    if policy.cpu:
        from jaxrat.ops.cpu.strided_conv import conv_general_dilated as cpu_conv

        return cpu_conv
    return _whole_kernel


def _whole_kernel(lhs: jax.Array, rhs: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
    """XLA's convolution with the kernel gathered whole first where its parameter is sharded (ZeRO-3).
    Left to the partitioner, the strided convolution's input gradient under a sharded kernel became a
    zero-interleaved pad and a dense convolution (~9x the FLOPs, compiled for H100s), where a whole
    kernel keeps cuDNN's backward-data kernel; the kernel's gradient is scattered back to its shards."""
    if splits() > 1:
        rhs = jax.lax.with_sharding_constraint(rhs, P())
    return jax.lax.conv_general_dilated(lhs, rhs, *args, **kwargs)
