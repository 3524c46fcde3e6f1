"""``config.model`` for a RAT model from one flat dict of fields, as tests write them."""

from __future__ import annotations

import jax.numpy as jnp
import ml_collections as mlc
from flax import nnx

from jaxrat.models.rat.config import field_names

# A RAT small enough to compile in seconds, and the images the unit tests feed it.
TINY_RAT = dict(feature_dims=16, num_blocks=2, num_heads=2, iters=1, decoder_dim=8, mlp_dropout=0.0)
TINY_IMAGES = (2, 24, 20, 3)


def rat_model(name: str = "rat", **fields) -> mlc.ConfigDict:
    """``{name, <task model fields>, rat: {<RAT options>}}``: each field goes where it belongs."""
    rat = {k: fields.pop(k) for k in list(fields) if k in field_names()}
    return mlc.ConfigDict(dict(name=name, **fields, rat=rat))


@nnx.jit
def mean_square_and_grads(model: nnx.Module, x: jnp.ndarray):
    """``mean(model(x) ** 2)`` and its gradients. One jitted function for every test module, so tests
    that build the same model share its compiled program (in one process, and across processes
    through the test run's compilation cache: a RAT forward and backward is seconds of XLA)."""
    return nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
