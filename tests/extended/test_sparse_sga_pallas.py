"""The fused Pallas sparse SGA kernels (jaxrat.ops.gpu.sparse_sga) against the portable kernel.

On this CPU the kernels run in Pallas interpret mode (the same kernel bodies, executed by XLA);
the GPU form is lowered for CUDA here, and compiled by Triton for an H100 in tests/extended/test_gpu_cost.py.
Shapes are tiny but chosen so that rows span several tiles and no grid divides by a tile.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmark_scripts import load
from jaxrat.ops.gpu.sparse_sga import laid_out_update, lay_out_keys, sparse_update, supports
from jaxrat.ops.policy import SparseSGABlocks
from jaxrat.ops.portable.sparse_sga import Geometry, sparse_grouping

hbm_bytes = load("sparse_sga_traffic").hbm_bytes

TRITON = re.compile(r"custom_call @__gpu\$xla\.gpu\.triton\(")


def _inputs(geom: Geometry, dh: int, dv: int, dtype):
    n_out, n_in = int(np.prod(geom.out)), int(np.prod(geom.grid))
    kq, kk, kv, kg = jax.random.split(jax.random.PRNGKey(0), 4)
    q = 0.7 * jax.random.normal(kq, (2, 2, n_out, dh))
    k = 0.7 * jax.random.normal(kk, (2, 2, n_in, dh))
    v = jax.random.normal(kv, (2, 2, n_in, dv))
    g = jax.random.normal(kg, (2, 2, n_out, dv))
    return tuple(x.astype(dtype) for x in (q, k, v)), g


def _value_and_vjp(f, q, k, v, g):
    """f(q, k, v) and its gradients for the cotangent g, jitted as one program."""
    def run(q, k, v, g):
        u, vjp = jax.vjp(f, q, k, v)
        return (u, *vjp(g.astype(u.dtype)))
    return [np.asarray(x, np.float32) for x in jax.jit(run)(q, k, v, g)]


def _heads_last(x):
    """(B, H, N, d) <-> (B, N, H, d): the tests' inputs are head-major, the fused kernels token-major."""
    return x.transpose(0, 2, 1, 3)


def _fused(geom, normalise, blocks=SparseSGABlocks()):
    return lambda q, k, v: _heads_last(sparse_update(*map(_heads_last, (q, k, v)), geom, normalise, interpret=True,
                                                     blocks=blocks))


def _portable(geom, normalise):
    """The portable update; it takes values as wide as the queries, and the update is linear in
    v, so other widths go through in zero-padded chunks of that width."""
    def f(q, k, v):
        dh, dv = q.shape[-1], v.shape[-1]
        v = jnp.pad(v, [(0, 0)] * 3 + [(0, -dv % dh)])
        chunks = [sparse_grouping(q, k, v[..., i:i + dh], geom.grid, geom.kernel, geom.stride, normalise)[0]
                  for i in range(0, v.shape[-1], dh)]
        return jnp.concatenate(chunks, axis=-1)[..., :dv]
    return f


@functools.lru_cache
def _reference(case, dtype=jnp.float32):
    """The portable kernel's (u, dq, dk, dv) for a case's inputs (cached: two tests use one)."""
    grid, kernel, stride, dh, dv, normalise = case
    geom = Geometry(grid, kernel, stride)
    (q, k, v), g = _inputs(geom, dh, dv, jnp.float32)
    return _value_and_vjp(_portable(geom, normalise), *(x.astype(dtype) for x in (q, k, v)), g)


ISIC = ((13, 11), (7, 7), (3, 3), 16, 16, True)  # the ISIC layers' kernel and stride
CASES = [  # grid, kernel, stride, dh, dv, normalise_columns
    ISIC,
    ((4, 70), (3, 3), (1, 1), 8, 24, True),  # "same" grid; 2 input tiles and 3 group tiles a row
    ((10, 13), (5, 5), (2, 2), 32, 16, False),
    ((9, 20), (5, 3), (2, 1), 16, 8, False),  # the axes differ in kernel and stride
    ((4, 200), (7, 7), (3, 3), 16, 16, True),  # ISIC's kernel and stride over 4 input and 3 group tiles a row
]


@pytest.fixture(params=[False, True], ids=["taps", "products"])
def group_form(request):
    """The kernels' switches: the passes tap by tap (the default) and as matrix products over row segments."""
    return SparseSGABlocks(products=request.param)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "k{}s{}_{}".format(*c[1:3], "norm" if c[5] else "plain"))
def test_float32_matches_the_portable_kernel_forward_and_every_gradient(case, group_form):
    grid, kernel, stride, dh, dv, normalise = case
    geom = Geometry(grid, kernel, stride)
    (q, k, v), g = _inputs(geom, dh, dv, jnp.float32)
    got = _value_and_vjp(_fused(geom, normalise, group_form), q, k, v, g)
    want = _reference(case)
    for name, a, b in zip(("u", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape, name
        err = np.max(np.abs(a - b)) / np.max(np.abs(b))
        assert err < 1e-5, f"{name}: max error {err:.2e} of the largest entry"


TAIL = ((12, 10), (5, 5), (4, 4), 16, 16, True)  # the last window ends above the last input row


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("case", [ISIC, CASES[1], TAIL], ids=["k7s3", "k3s1", "tail"])
def test_sweeps_of_a_few_output_rows_a_program_match_the_portable_kernel(case, rows):
    """The column sums and the update, and d's gradient and the queries', each as one sweep over
    ``rows`` output rows a program: programs share their windows' overlap rows, the last one's rows
    run past the grid (clamped to its edge), and the input rows below the last window (TAIL) still
    get their statistics (the keys' pass reads them)."""
    grid, kernel, stride, dh, dv, normalise = case
    geom = Geometry(grid, kernel, stride)
    assert -(-geom.out[0] // rows) > 1  # several programs a slice
    (q, k, v), g = _inputs(geom, dh, dv, jnp.float32)
    got = _value_and_vjp(_fused(geom, normalise, SparseSGABlocks(sweep_rows=rows)), q, k, v, g)
    for name, a, b in zip(("u", "dq", "dk", "dv"), got, _reference(case)):
        err = np.max(np.abs(a - b)) / np.max(np.abs(b))
        assert err < 1e-5, f"{name}: max error {err:.2e} of the largest entry"


@pytest.mark.parametrize("rows", [1, 8])
def test_the_sweeps_give_what_the_separate_passes_give(rows, group_form):
    """With and without the sweeps, float32 in interpret mode, every statistic and result of a call's
    forward and backward (the column sums d and d's gradient gd of the rows below the last window too,
    which no group reads but the keys' pass does): the same tile code in another order, in both forms."""
    from jaxrat.ops.gpu.sparse_sga import api as gs
    from jaxrat.ops.gpu.sparse_sga import sweep as sparse_sga_sweep
    from jaxrat.ops.gpu.sparse_sga.tiling import Tiling

    grid, kernel, stride, dh, dv, _ = TAIL
    geom = Geometry(grid, kernel, stride)
    (q, k, v), g = _inputs(geom, dh, dv, jnp.float32)
    b, h = q.shape[:2]
    t = Tiling.of(geom, dh, dv, heads=h, blocks=dataclasses.replace(group_form, sweep_rows=rows))
    assert sparse_sga_sweep.applies(t)
    assert t.Y > (t.OY - 1) * t.sy - t.py + t.ky  # input rows below the last window
    q, g = (x.transpose(0, 2, 1, 3).reshape(b, -1) for x in (q, g))  # token-major, as the layer gives them
    k, v = (x.reshape(b * h, -1) for x in (k, v))

    def call(t):
        u, r, d = gs._forward(q, k, v, t, True, True)
        dq, _, _, tape = gs._update_bwd(t, True, True, (q, k, v, u, r, d), g)
        return [np.asarray(x) for x in (u, r, d, dq, *tape)]

    apart = t._replace(sweep_rows=0)
    assert not sparse_sga_sweep.applies(apart)
    for a, b in zip(call(t), call(apart)):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(np.max(np.abs(b))))


def _iterations(update, q, k, v, w, uses):
    """A layer's grouping iterations in miniature: each call's queries move with the last update."""
    out = 0.0
    for use in range(uses):
        u = update(q, k, v, use)
        out = out + (use + 1) * u
        q = q + jnp.tanh(u @ w)
    return out


@pytest.mark.parametrize("case", [ISIC, CASES[2]], ids=["norm", "plain"])
def test_keys_laid_out_once_sum_the_gradients_of_every_use(case, group_form):
    """Three calls on keys laid out once: the keys' and values' gradients, summed in one pass over
    the inputs, equal the portable kernel's summed over three separate calls (float32)."""
    grid, kernel, stride, dh, dv, normalise = case
    geom = Geometry(grid, kernel, stride)
    (q, k, v), g = _inputs(geom, dh, dv, jnp.float32)
    w = 0.3 * jax.random.normal(jax.random.PRNGKey(1), (dv, dh))

    def fused(q, k, v):  # token-major, as the layer calls it
        q, k, v = map(_heads_last, (q, k, v))
        keys = lay_out_keys(k, v, geom, 3, normalise, interpret=True, blocks=group_form)
        update = lambda q, k, v, use: laid_out_update(q, keys, use, geom, normalise, interpret=True, blocks=group_form)
        return _heads_last(_iterations(update, q, k, v, w, 3))

    portable = lambda q, k, v: _iterations(lambda q, k, v, use: _portable(geom, normalise)(q, k, v), q, k, v, w, 3)
    got, want = _value_and_vjp(fused, q, k, v, g), _value_and_vjp(portable, q, k, v, g)
    for name, a, b in zip(("u", "dq", "dk", "dv"), got, want):
        err = np.max(np.abs(a - b)) / np.max(np.abs(b))
        assert err < 1e-5, f"{name}: max error {err:.2e} of the largest entry"


@pytest.mark.parametrize("geom,heads,dh,rotated,normalise", [
    (Geometry((11, 13), (5, 5), (2, 2)), 3, 8, 2, True),  # RoSE on the first two of three heads
    (Geometry((13, 11), (7, 7), (3, 3)), 2, 16, 2, True),  # ISIC's kernel and stride, every head turned
    (Geometry((9, 20), (5, 3), (2, 1)), 2, 8, 0, False),  # no rotation, columns not normalised
])
def test_a_projection_laid_out_whole_matches_split_turned_and_laid_out(geom, heads, dh, rotated, normalise,
                                                                     group_form):
    """lay_out_projection (split, RoSE, layout in one step; the keys' pass writing the projection's
    gradient, keys' turned back, in place) against the plain route: split, RoSE's own rotation,
    lay_out_keys. Two uses, the second's queries moved by the first's update, and the laid-out keys and
    values read outside the updates as well (their own cotangents). Float32, interpret mode:
    the value and the gradients of the projection, the angles and the queries to 1e-5 of the largest
    entry (measured: 1.1e-6; the keys' gradients are summed in another order)."""
    from jaxrat import ops
    from jaxrat.ops.gpu.sparse_sga import lay_out_projection
    from jaxrat.ops.rotate import rotate_heads

    b, n_in, n_out = 2, int(np.prod(geom.grid)), int(np.prod(geom.out))
    ks = jax.random.split(jax.random.PRNGKey(3), 4)
    kv = jax.random.normal(ks[0], (b, n_in, 2 * heads * dh))
    phase = 2.0 * jax.random.normal(ks[1], (n_in, max(rotated, 1), dh // 2))
    q0 = 0.5 * jax.random.normal(ks[2], (b, n_out, heads, dh))
    g = jax.random.normal(ks[3], (b, n_out, heads, dh))

    def two_uses(keys, q):
        total = jnp.sum(jnp.sin(keys.k)) + jnp.sum(keys.v ** 2)  # the laid-out keys used outside the updates too
        for use in range(2):
            u = laid_out_update(q, keys, use, geom, normalise, interpret=True, blocks=group_form)
            total, q = total + jnp.sum(u * g), q + 0.5 * u
        return total

    def whole(kv, phase, q):
        angles = phase[:, :rotated] if rotated else None
        return two_uses(lay_out_projection(kv, angles, geom, heads, 2, normalise, interpret=True, blocks=group_form), q)

    def plain(kv, phase, q):
        k, v = jnp.split(kv, 2, axis=-1)
        k = k.reshape(b, n_in, heads, dh)
        if rotated:
            k = rotate_heads(k, phase[:, :rotated], rotated, ops.PORTABLE)
        keys = lay_out_keys(k, v.reshape(b, n_in, heads, dh), geom, 2, normalise, interpret=True, blocks=group_form)
        return two_uses(keys, q)

    got = jax.jit(jax.value_and_grad(whole, argnums=(0, 1, 2)))(kv, phase, q0)
    want = jax.jit(jax.value_and_grad(plain, argnums=(0, 1, 2)))(kv, phase, q0)
    for name, a, w in zip(("value", "dkv", "dphase", "dq"), jax.tree.leaves(got), jax.tree.leaves(want)):
        a, w = np.asarray(a), np.asarray(w)
        np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(w)) or 1.0), err_msg=name)


@pytest.mark.parametrize("geom,heads,dh,rotated,channels", [
    (Geometry((8, 16), (7, 7), (3, 3)), 2, 16, 2, 32),  # the kernel: 128 inputs, two tiles
    (Geometry((16, 12), (5, 5), (2, 2)), 3, 16, 1, 16),  # the kernel, RoSE on one head of three
    (Geometry((11, 13), (5, 5), (2, 2)), 2, 16, 2, 32),  # 143 inputs: XLA's product and layout
])
def test_the_projection_kernel_matches_the_product_laid_out(geom, heads, dh, rotated, channels, group_form):
    """lay_out_inputs (the product, the bias, RoSE and the head-major layout in one kernel; the angles'
    gradient from the turned keys) against lay_out_projection of XLA's product. Two uses and the laid-out
    keys read outside the updates too. Float32, interpret mode: the value and the gradients of the
    inputs, weights, bias, angles and queries to 1e-5 of their largest entry."""
    from jaxrat.ops.gpu.sparse_sga import lay_out_projection
    from jaxrat.ops.gpu.sparse_sga.projection import kernel_supports, lay_out_inputs

    b, n_in, n_out = 2, int(np.prod(geom.grid)), int(np.prod(geom.out))
    assert kernel_supports(n_in, channels, dh, jnp.float32) == (n_in % 64 == 0)
    ks = jax.random.split(jax.random.PRNGKey(5), 6)
    x = jax.random.normal(ks[0], (b, n_in, channels))
    w = jax.random.normal(ks[1], (channels, 2 * heads * dh)) / np.sqrt(channels)
    bias = jax.random.normal(ks[2], (2 * heads * dh,))
    phase = 2.0 * jax.random.normal(ks[3], (n_in, rotated, dh // 2))
    q0 = 0.5 * jax.random.normal(ks[4], (b, n_out, heads, dh))
    g = jax.random.normal(ks[5], (b, n_out, heads, dh))

    def two_uses(keys, q):
        total = jnp.sum(jnp.sin(keys.k)) + jnp.sum(keys.v ** 2)
        for use in range(2):
            u = laid_out_update(q, keys, use, geom, interpret=True, blocks=group_form)
            total, q = total + jnp.sum(u * g), q + 0.5 * u
        return total

    def fused(x, w, bias, phase, q):
        return two_uses(lay_out_inputs(x, w, bias, phase, geom, heads, 2, interpret=True, blocks=group_form), q)

    def plain(x, w, bias, phase, q):
        return two_uses(lay_out_projection(x @ w + bias, phase, geom, heads, 2, interpret=True, blocks=group_form), q)

    args = (x, w, bias, phase, q0)
    got = jax.jit(jax.value_and_grad(fused, argnums=tuple(range(5))))(*args)
    want = jax.jit(jax.value_and_grad(plain, argnums=tuple(range(5))))(*args)
    for name, a, e in zip(("value", "dx", "dw", "db", "dphase", "dq"), jax.tree.leaves(got), jax.tree.leaves(want)):
        a, e = np.asarray(a), np.asarray(e)
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(e)) or 1.0), err_msg=name)


@pytest.mark.parametrize("geom,heads,channels", [
    (Geometry((8, 16), (7, 7), (3, 3)), 2, 128),  # the projection kernel; tiles of 32 inputs (4096 / 128)
    (Geometry((10, 20), (5, 5), (2, 2)), 3, 64),  # XLA's product; rows of 20 in tiles of 32, masked
    (Geometry((8, 16), (7, 7), (3, 3)), 2, 256),  # the widest inputs the pass takes: tiles of 16
])
def test_the_input_gradient_from_the_keys_pass_matches_xla_s_product(geom, heads, channels, group_form):
    """The layer input's gradient summed over the heads in the keys' pass (keys_pass_with_inputs)
    against XLA's product of the projection's gradient (input_grad_features 0). Float32, interpret
    mode: every gradient to 1e-5 of its largest entry."""
    from jaxrat.ops.gpu.sparse_sga import projection as gp

    b, n_in, n_out, dh = 2, int(np.prod(geom.grid)), int(np.prod(geom.out)), 16
    ks = jax.random.split(jax.random.PRNGKey(7), 6)
    args = (jax.random.normal(ks[0], (b, n_in, channels)),
            jax.random.normal(ks[1], (channels, 2 * heads * dh)) / np.sqrt(channels),
            jax.random.normal(ks[2], (2 * heads * dh,)), 2.0 * jax.random.normal(ks[3], (n_in, 1, dh // 2)),
            0.5 * jax.random.normal(ks[4], (b, n_out, heads, dh)))
    g = jax.random.normal(ks[5], (b, n_out, heads, dh))

    def loss(x, w, bias, phase, q, blocks):
        keys = gp.lay_out_inputs(x, w, bias, phase, geom, heads, 2, interpret=True, blocks=blocks)
        u = laid_out_update(q, keys, 0, geom, interpret=True, blocks=blocks)
        return jnp.sum(laid_out_update(q + u, keys, 1, geom, interpret=True, blocks=blocks) * g)

    grads = lambda blocks: jax.jit(jax.grad(functools.partial(loss, blocks=blocks), argnums=tuple(range(5))))(*args)
    got = grads(group_form)
    want = grads(dataclasses.replace(group_form, input_grad_features=0))
    for name, a, e in zip(("dx", "dw", "db", "dphase", "dq"), got, want):
        a, e = np.asarray(a), np.asarray(e)
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(e))), err_msg=name)


def test_the_projection_s_gradient_is_written_by_the_keys_pass_with_no_concatenate():
    """Lowered for CUDA: the backward of a laid-out projection is the keys' pass writing (B, N, 2 H d)
    itself: no concatenate or transpose of the gradients outside the Triton calls."""
    from jaxrat.ops.gpu.sparse_sga import lay_out_projection

    geom, heads, dh = Geometry((24, 24), (7, 7), (3, 3)), 2, 16
    n_in, n_out = 576, int(np.prod(geom.out))

    def loss(kv, phase, q):
        keys = lay_out_projection(kv, phase, geom, heads, 1)
        return jnp.sum(laid_out_update(q, keys, 0, geom).astype(jnp.float32))

    args = (jnp.zeros((2, n_in, 2 * heads * dh), jnp.bfloat16), jnp.zeros((n_in, heads, dh // 2)),
            jnp.zeros((2, n_out, heads, dh), jnp.bfloat16))
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert len(TRITON.findall(text)) == 4  # log-sum-exps, two sweeps, the keys' pass
    # the forward's layout transposes keys and values; the backward moves nothing of input size
    moved = re.findall(r"stablehlo\.(?:transpose|concatenate) .*?-> (tensor<[^>]*>)", text)
    assert not [m for m in moved if "576x64" in m or "2x36864" in m], moved


def test_a_use_that_gets_no_gradient_adds_nothing(group_form):
    """Keys laid out for two uses of which only the first reaches the loss: the second's tape
    comes back as zeros (d = 0 among them), and the gradients are the one use's, finite."""
    geom = Geometry(*ISIC[:3])
    (q, k, v), g = _inputs(geom, *ISIC[3:5], jnp.float32)
    q, k, v = map(_heads_last, (q, k, v))

    def two(q, k, v):
        keys = lay_out_keys(k, v, geom, 2, interpret=True, blocks=group_form)
        u = laid_out_update(q, keys, 0, geom, interpret=True, blocks=group_form)
        unused = laid_out_update(q, keys, 1, geom, interpret=True, blocks=group_form)
        return u + 0.0 * jax.lax.stop_gradient(unused)

    one = lambda q, k, v: sparse_update(q, k, v, geom, interpret=True, blocks=group_form)
    got, want = _value_and_vjp(two, q, k, v, _heads_last(g)), _value_and_vjp(one, q, k, v, _heads_last(g))
    for name, a, b in zip(("u", "dq", "dk", "dv"), got, want):
        assert np.all(np.isfinite(a)), name
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=name)


def test_laid_out_keys_refuse_a_use_they_were_not_laid_out_for():
    geom = Geometry(*ISIC[:3])
    (q, k, v), _ = _inputs(geom, *ISIC[3:5], jnp.float32)
    q, k, v = map(_heads_last, (q, k, v))
    keys = lay_out_keys(k, v, geom, 2, interpret=True)
    with pytest.raises(ValueError, match="use 2 of keys laid out for 2"):
        laid_out_update(q, keys, 2, geom, interpret=True)
    with pytest.raises(ValueError, match="normalise_columns"):
        laid_out_update(q, keys, 0, geom, False, interpret=True)


def test_bfloat16_is_as_close_to_float32_as_the_portable_kernel_in_bfloat16(group_form):
    """Tolerance: the fused kernel rounds only its operands (q, k, v, the cotangent) and its results
    to bfloat16 (8 bits of mantissa: 2^-9 = 0.2% relative) and computes in float32; the portable
    kernel rounds the same and also the attention weights before its matmuls. So the fused results
    must be at least as close to float32 as the portable kernel's (25% slack for where single
    roundings happen to fall), and within 1% of the largest entry (five times the results' own
    rounding, as the inputs' rounding propagates through the logits and the softmax). Measured here:
    u 0.32%, dq 0.52%, dk 0.64%, dv 0.50% (portable 0.32, 0.63, 0.68, 0.84%). The product form's
    logits multiply the bfloat16 operands on the tensor cores with float32 sums (the same products);
    its weights meet the values and keys rounded to bfloat16, as the portable kernel's do."""
    geom = Geometry(*ISIC[:3])
    (q, k, v), g = _inputs(geom, *ISIC[3:5], jnp.float32)
    exact, ref = _reference(ISIC), _reference(ISIC, jnp.bfloat16)
    got = _value_and_vjp(_fused(geom, True, group_form), *(x.astype(jnp.bfloat16) for x in (q, k, v)), g)
    for name, a, b, e in zip(("u", "dq", "dk", "dv"), got, ref, exact):
        scale = np.max(np.abs(e))
        err, err_ref = np.max(np.abs(a - e)) / scale, np.max(np.abs(b - e)) / scale
        assert err < 1.25 * err_ref and err < 1e-2, f"{name}: {err:.2e} (portable bf16: {err_ref:.2e})"


def test_supports_says_why_not_in_one_sentence():
    geom = Geometry((16, 16), (7, 7), (3, 3))
    n_out = int(np.prod(geom.out))
    assert supports(geom, (2, n_out, 8, 16), jnp.bfloat16) is None
    assert "2 spatial dims" in supports(Geometry((8, 8, 8), (3, 3, 3), (2, 2, 2)), (1, 64, 1, 16), jnp.float32)
    assert "float16" in supports(geom, (2, n_out, 8, 16), jnp.float16)
    assert "head dim 4" in supports(geom, (2, n_out, 8, 4), jnp.float32)
    assert "output grid" in supports(geom, (2, n_out + 1, 8, 16), jnp.float32)
    tall = Geometry((70000, 4), (3, 3), (1, 1))
    assert "CUDA grid axis" in supports(tall, (1, int(np.prod(tall.out)), 1, 16), jnp.float32)
    with pytest.raises(ValueError, match="head dim 256"):
        sparse_update(*(jnp.zeros((1, n, 1, 256)) for n in (n_out, 256, 256)), geom)


def test_memory_traffic_is_a_few_reads_of_the_inputs_and_no_maps():
    """The ISIC first layer: every pass moves whole q, k, v, outputs and per-token statistics, never
    a per-tap map (49 taps x 7,396 groups x 4 bytes would be 1.4 MB a slice, 5.6x the keys)."""
    geom = Geometry((256, 256), (7, 7), (3, 3))
    q_shape = (16, int(np.prod(geom.out)), 8, 16)
    keys = 16 * 8 * 256 * 256 * 16 * 2
    fused = hbm_bytes(geom, q_shape, 16, jnp.bfloat16)
    assert len(fused) == 4 and sum(fused.values()) < 11 * keys
    # forward: keys twice, values once, q twice and u; r written and read once each, d written
    fwd = sum(b for name, b in fused.items() if name.startswith("fwd"))
    q, r, d = keys * 7396 // 65536, 16 * 8 * 7396 * 4, 16 * 8 * 65536 * 4
    assert fwd == 2 * keys + keys + 3 * q + 2 * r + d
    assert sum(hbm_bytes(geom, q_shape, 16, jnp.bfloat16, False).values()) < 10 * keys


def _isic_like(dtype=jnp.bfloat16, blocks=SparseSGABlocks()):
    geom = Geometry((64, 64), (7, 7), (3, 3))
    n_out, n_in = int(np.prod(geom.out)), int(np.prod(geom.grid))
    spec = lambda n: jax.ShapeDtypeStruct((2, n, 8, 16), dtype)
    loss = lambda q, k, v: jnp.sum(sparse_update(q, k, v, geom, blocks=blocks).astype(jnp.float32))
    return geom, (spec(n_out), spec(n_in), spec(n_in)), loss


@pytest.mark.parametrize("sweeps", [True, False], ids=["sweeps", "apart"])
def test_the_gpu_form_lowers_to_triton_calls_only(sweeps):
    """Lowered for CUDA (no GPU needed): forward, the log-sum-exps and one sweep (column sums, then the
    update; three passes apart); backward one sweep for the call (d's gradient, then the queries'; two
    apart) and one pass for the keys' and values' gradients; no XLA loop or matmul outside them."""
    _, args, loss = _isic_like(blocks=SparseSGABlocks(sweep_rows=8 if sweeps else 0))
    lower = lambda f: jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    fwd = lower(loss)
    both = lower(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    assert (len(TRITON.findall(fwd)), len(TRITON.findall(both))) == ((2, 4) if sweeps else (3, 6))
    assert "stablehlo.while" not in both and "stablehlo.dot_general" not in both


# Compiled by Triton for an H100 (no GPU needed): tests/extended/test_gpu_cost.py, in a process of its own.


@pytest.mark.parametrize("features,grid,projection_kernel", [
    (16, (20, 17), False),  # heads of 8: XLA's product, then the layout
    (32, (16, 12), True),  # heads of 16 on 192 inputs: the projection kernel
])
def test_a_layer_s_iterations_on_the_gpu_policy_match_the_portable_layer(monkeypatch, group_form, features, grid,
                                                                         projection_kernel):
    """The SGA layer's three rounds on the gpu policy, each with its own tape of the keys laid out once
    (projected, turned by RoSE), the layout's backward summing the rounds' key and value gradients into
    the projection's, turned back. In interpret mode, float32: the portable layer's output and every
    gradient (parameters, RoSE's angles and input), to 1e-5 of the largest entry."""
    from flax import nnx

    from jaxrat import ops
    from jaxrat.models.rat import RATConfig
    from jaxrat.models.rat.sga import SpatialGroupingAttention
    from jaxrat.ops.gpu import sparse_sga as gs
    from jaxrat.ops.gpu.sparse_sga import projection as gp

    for module, name in ((gs, "lay_out_keys"), (gs, "lay_out_projection"), (gs, "laid_out_update"),
                         (gp, "lay_out_inputs")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, **k: real(*a, **{**k, "interpret": True}))
    config = RATConfig(feature_dims=features, num_heads=2, iters=3, sga_kernel_size=7, stride=3, mlp_dropout=0.0)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, grid[0] * grid[1], features))
    assert gp.kernel_supports(grid[0] * grid[1], features, features // 2, jnp.float32) == projection_kernel

    def value_and_grads(policy):
        layer = SpatialGroupingAttention(config, "sparse", kernels=policy, rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

        def loss(params, x):
            out = nnx.merge(graphdef, params, rest)(x, grid, (1.0, 1.0)).x
            return jnp.sum(out * jnp.cos(out))

        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)
        return [np.asarray(value)] + [np.asarray(g) for g in jax.tree.leaves(grads)]

    got, want = value_and_grads(ops.KernelPolicy("gpu", sparse_sga=group_form)), value_and_grads(ops.PORTABLE)
    assert len(got) == len(want) > 10
    for a, b in zip(got, want):
        # a one-element leaf (the loss; temp's gradient: a sum over every logit, with cancellation) is
        # held to 5e-4 of itself, the rest to 1e-5 of their largest entry. Measured: temp's gradient
        # 5.9e-5 from the portable layer's with the tap form, 2.6e-4 with the product form (the same
        # float32 terms summed in another order); every other leaf within 7.9e-6 in both
        tol = 5e-4 if b.size == 1 else 1e-5
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * float(np.max(np.abs(b))))
