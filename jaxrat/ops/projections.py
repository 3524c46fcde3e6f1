"""Several linear projections of one input (a transformer decoder's layers each projecting the same
memory into its keys, or its values), with their gradients taken as one product.

Autodiff of separate projections accumulates the input's gradient product by product (each product
reads the sum so far and writes it back) and reads the input once per weight gradient. Here the
forward is each projection's own product, as :class:`flax.nnx.Linear` computes it; the backward puts
the projections' output gradients side by side and takes the input's gradient in one product (written
once, summed in float32 inside it) and every weight's in one more (the input read once). Compiled for
an H100 (benchmarks/gpu_cost.py), the COCO RAT-DETR step's six decoder layers' key and value
projections of the memory take fewer kernels and move fewer bytes this way. The forward as one
product too costs more than it saves: each layer's slice of the joint output is copied out for the
attention kernel.
"""

from __future__ import annotations

import itertools
from functools import partial
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp

Array = jax.Array


def _product(x: Array, w: Array, precision: Any) -> Array:
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)


def shared_input_projections(x: Array, weights: Sequence[Array], biases: Sequence[Array], *,
                             dtype: Optional[Any] = None, precision: Any = None) -> list[Array]:
    """``[x @ w + b for w, b in zip(weights, biases)]`` for ``x`` (..., C) and weights (C, D_i), every
    operand cast to ``dtype`` first (None: their common type), as :class:`flax.nnx.Linear` does."""
    if len(weights) != len(biases) or not weights:
        raise ValueError(f"{len(weights)} weights and {len(biases)} biases: give one bias per weight, at least one")
    dtype = jnp.result_type(x, *weights, *biases) if dtype is None else dtype
    cast = lambda a: jnp.asarray(a, dtype)
    return list(_projections(cast(x), tuple(map(cast, weights)), tuple(map(cast, biases)), precision))


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _projections(x, weights, biases, precision):
    return tuple(_product(x, w, precision) + b for w, b in zip(weights, biases))


def _projections_fwd(x, weights, biases, precision):
    return _projections(x, weights, biases, precision), (x, weights)


def _projections_bwd(precision, res, cts):
    x, weights = res
    widths = [w.shape[1] for w in weights]
    dy = jnp.concatenate([jnp.asarray(c, x.dtype) for c in cts], -1)
    w = jnp.concatenate(weights, 1)
    dx = jax.lax.dot_general(dy, w, (((dy.ndim - 1,), (1,)), ((), ())), precision=precision)
    lead = tuple(range(x.ndim - 1))
    dw = jax.lax.dot_general(x, dy, ((lead, lead), ((), ())), precision=precision)
    db = jnp.sum(dy.astype(jnp.float32), lead).astype(x.dtype)
    bounds = list(itertools.accumulate(widths))[:-1]
    return (dx.astype(x.dtype), tuple(jnp.split(dw.astype(x.dtype), bounds, 1)), tuple(jnp.split(db, bounds)))


_projections.defvjp(_projections_fwd, _projections_bwd)
