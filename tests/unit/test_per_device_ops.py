"""Under a mesh of several devices (the trainer's step), the attention and rotation operations run on
each device's own images: the same values as on one device, and no collective moves activations.

XLA's partitioner, given a loop over the attention slices (``lax.map``) whose slice axis is sharded,
gathered the whole operand onto every device on every trip (compiled for 16 H100s, the ISIC step's
multi-resolution blocks moved 80 MB per trip, 9,216 trips); the window partition and the joins of
the segments moved activations between devices; RoSE's angles, shared by every image, had their
gradient summed over the devices at token-grid size. These tests compile on this CPU's simulated
devices, where the partitioner behaves the same way.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrat import ops
from jaxrat.models.rat.rose import RotarySpatialEmbedding
from jaxrat.ops import attention as attn
from jaxrat.parallel.mesh import make_mesh

MOVES_ACTIVATIONS = re.compile(r"\b(all-gather|all-to-all|collective-permute)(-start)?\(")
DEVICES = 4


@pytest.fixture(scope="module")
def mesh():
    return make_mesh((("data", DEVICES),), devices=jax.devices()[:DEVICES])


def _sharded(mesh, *arrays):
    return [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in arrays]


def _compiled(fn, mesh, *args):
    """(values and gradients, optimized module text) of ``fn`` traced under ``mesh`` as the trainer's step is."""
    with jax.set_mesh(mesh):
        jitted = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(jnp.square(fn(*a).astype(jnp.float32))),
                                            argnums=tuple(range(len(args)))))
        return jitted(*args), jitted.lower(*args).compile().as_text()


def _one_device(fn, *args):
    f = lambda *a: jnp.sum(jnp.square(fn(*a).astype(jnp.float32)))  # noqa: E731
    return jax.jit(jax.value_and_grad(f, argnums=tuple(range(len(args)))))(*args)


def _same(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)


def _random(*shapes, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    return [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes)]


# small blocks, so the portable kernels loop over their slices as at full size
POLICY = ops.KernelPolicy("portable", block_elements=256)


@pytest.mark.parametrize("window", [None, 4])
def test_multires_attention_runs_per_device(mesh, window):
    segments = [(3, None), (12 * 12, (12, 12)), (16, (4, 4))]
    n = sum(s for s, _ in segments)
    q, k, v = _random((8, n, 2, 8), (8, n, 2, 8), (8, n, 2, 8))
    fn = lambda q, k, v: attn.multires_attention(q, k, v, segments, window, POLICY)  # noqa: E731
    got, text = _compiled(fn, mesh, *_sharded(mesh, q, k, v))
    assert not MOVES_ACTIVATIONS.search(text), MOVES_ACTIVATIONS.search(text).group(0)
    _same(got, _one_device(fn, q, k, v))


@pytest.mark.parametrize("kind", ["grouping", "softmax"])
def test_chunked_attention_runs_per_device(mesh, kind):
    q, k, v = _random((8, 2, 40, 8), (8, 2, 96, 8), (8, 2, 96, 8))
    op = attn.grouping_attention if kind == "grouping" else attn.softmax_attention
    fn = lambda q, k, v: op(q, k, v, POLICY)  # noqa: E731
    got, text = _compiled(fn, mesh, *_sharded(mesh, q, k, v))
    assert "while" in text  # the slices are looped over, as at full size
    assert not MOVES_ACTIVATIONS.search(text)
    _same(got, _one_device(fn, q, k, v))


def test_sparse_grouping_attention_runs_per_device(mesh):
    window = attn.Window((12, 12), (5, 5), (2, 2))
    q, k, v = _random((8, 36, 2, 8), (8, 144, 2, 8), (8, 144, 2, 8))

    def fn(q, k, v):
        keys = attn.sparse_keys(k, v, window, POLICY)
        return attn.sparse_grouping_attention(q, keys, POLICY)

    got, text = _compiled(fn, mesh, *_sharded(mesh, q, k, v))
    assert not MOVES_ACTIVATIONS.search(text)
    _same(got, _one_device(fn, q, k, v))


def _largest_all_reduce(text: str) -> int:
    sizes = [int(np.prod([int(d) for d in dims.split(",") if d]))
             for dims in re.findall(r"= \(?\w+\[([\d,]*)\][^\n]*? all-reduce(?:-start)?\(", text)]
    return max(sizes, default=0)


def test_rose_angle_gradients_are_summed_per_device_before_the_devices_sum_them(mesh):
    """The learnable frequencies' and spacing scales' gradients leave each device as a few numbers,
    not as the (tokens, heads, planes) angles' gradient, and equal the one-device gradients."""
    grid = (16, 16)
    rose = RotarySpatialEmbedding(16, 2, 2, rotary_ratio=1.0, learnable_scale=True, initial_scaling="log",
                                  rngs=nnx.Rngs(0), kernels=ops.PORTABLE)
    graphdef, params = nnx.split(rose, nnx.Param)
    x = _random((8, grid[0] * grid[1], 2, 8))[0].astype(jnp.bfloat16)  # as the gpu step computes

    def loss(params, x):
        return jnp.sum(jnp.square(nnx.merge(graphdef, params)(x, grid, (1.0, 1.0))))

    want = jax.jit(jax.value_and_grad(loss))(params, x)
    (xs,) = _sharded(mesh, x)
    with jax.set_mesh(mesh):
        step = jax.jit(jax.value_and_grad(loss))
        got = step(params, xs)
        text = step.lower(params, xs).compile().as_text()
    _same(got, want)
    tokens = grid[0] * grid[1]
    assert 0 < _largest_all_reduce(text) < tokens, _largest_all_reduce(text)
    assert not MOVES_ACTIVATIONS.search(text)
