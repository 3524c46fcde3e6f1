"""Attention kernels and SGA variants against naive, fully materialised formulas."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import USER_COMPILE
from jaxrat import ops
from jaxrat.models.rat.config import RATConfig
from jaxrat.models.rat.sga import SpatialGroupingAttention as _SGA
from jaxrat.ops import attention as A
from jaxrat.ops.cpu import cache as cpu_cache
from jaxrat.ops.policy import DEFAULT_BLOCK_ELEMENTS
from jaxrat.ops.portable import chunked_attention as C
from jaxrat.ops.portable.sparse_sga import (
    Geometry,
    scatter_window_map,
    sparse_blocks,
    sparse_grouping,
    sparse_update,
    strided_grid,
    window_indices,
)


def SpatialGroupingAttention(feature_dims=128, spatial_dims=2, kernel_size=7, num_heads=16, *, attention="dense",
                             rngs, **fields):
    """One SGA layer of a RAT with these fields, on the CPU kernels."""
    cfg = RATConfig(feature_dims=feature_dims, spatial_dims=spatial_dims, sga_kernel_size=kernel_size,
                    num_heads=num_heads, **fields)
    return _SGA(cfg, attention, kernels=ops.resolve("cpu"), rngs=rngs)


def _qkv(shape_q, shape_k, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], shape_q)
    k = jax.random.normal(ks[1], shape_k)
    v = jax.random.normal(ks[2], shape_k)
    g = jax.random.normal(ks[3], shape_q)
    return q, k, v, g


def _value_and_vjp(f):
    """Jitted (f(q, k, v), vjp(g)): one compilation instead of op-by-op dispatch."""

    @jax.jit
    def run(q, k, v, g):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(g)

    return run


def _naive_softmax(q, k, v):
    return jax.nn.softmax(jnp.einsum("...qd,...kd->...qk", q, k), -1) @ v


@pytest.mark.parametrize("normalise", [True, False])
@pytest.mark.parametrize("keys,block,slice_batch", [
    (700, 1 << 24, 1),  # one block per slice
    (700, 40 * 64, 1),  # 14 chunks of 50 keys, a divisor: no tail
    (701, 40 * 64, 1),  # a prime: 10 chunks of 64 and a tail of 61 after the scan
    (701, 40 * 64, 3),
])
def test_kernel_matches_naive_values_and_gradients(normalise, keys, block, slice_batch):
    q, k, v, g = _qkv((2, 3, 40, 8), (2, 3, keys, 8))
    if normalise:
        fast = lambda q, k, v: C.grouping_attention(q, k, v, max_block_elements=block, slice_batch=slice_batch)
        naive = A.grouping_attention_reference
    else:
        fast = lambda q, k, v: C.softmax_attention(q, k, v, max_block_elements=block, slice_batch=slice_batch)
        naive = _naive_softmax
    out, grads = _value_and_vjp(fast)(q, k, v, g)
    ref, ref_grads = _value_and_vjp(naive)(q, k, v, g)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_key_chunks_divide_the_keys_where_they_can_and_leave_a_near_full_tail_otherwise():
    assert C._chunking(40, 700, 1 << 24) == C._Chunking(1, 700, 0)  # fits one block
    assert C._chunking(40, 700, 40 * 64) == C._Chunking(14, 50, 0)  # largest divisor in [32, 64]
    assert C._chunking(1024, 9216, 1 << 19) == C._Chunking(18, 512, 0)  # dense SGA at 96 px
    assert C._chunking(1849, 16384, 1 << 19) == C._Chunking(64, 256, 0)  # at 128 px (target 283)
    ch = C._chunking(40, 701, 40 * 64)  # a prime: no divisor
    assert ch == C._Chunking(10, 64, 61)
    for nq, nk, block in [(40, 701, 2560), (7, 1009, 700), (1849, 16411, 1 << 19), (3, 100003, 4096)]:
        ch = C._chunking(nq, nk, block)
        assert ch.num_chunks * ch.chunk + ch.tail == nk and ch.tail < ch.chunk
        assert ch.chunk <= max(64, block // nq)  # a block stays within its budget
        assert ch.tail == 0 or ch.tail > ch.chunk - ch.num_chunks - 1  # balanced: never a sliver


@pytest.mark.parametrize("keys", [700, 701])
def test_streamed_kernel_masks_nothing(keys):
    """Padded keys would need a select on every block: one more pass over it in memory on CPU."""
    q, k, v, g = _qkv((2, 40, 8), (2, keys, 8))
    for kernel in (C.grouping_attention, C.softmax_attention):
        f = lambda q, k, v: jax.vjp(lambda *a: kernel(*a, max_block_elements=40 * 64), q, k, v)[1](g)
        text = str(jax.make_jaxpr(f)(q, k, v))
        assert "scan" in text and "select_n" not in text and "pad" not in text


def test_the_cpu_block_is_a_sixteenth_of_the_last_level_cache(tmp_path):
    def cache(index, level, size, kind="Unified"):
        d = tmp_path / f"index{index}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "size").write_text(f"{size}\n")
        (d / "type").write_text(f"{kind}\n")

    assert cpu_cache.last_level_cache_bytes(str(tmp_path)) is None  # nothing to read: the fixed default
    cache(0, 1, "48K", "Data")
    cache(1, 1, "64K", "Instruction")
    cache(2, 2, "2048K")
    cache(3, 3, "491520K")
    assert cpu_cache.last_level_cache_bytes(str(tmp_path)) == 480 << 20
    assert cpu_cache.cpu_block_elements(None) == DEFAULT_BLOCK_ELEMENTS
    assert cpu_cache.cpu_block_elements(32 << 20) == 1 << 19  # 2 MiB blocks for a 32 MiB L3
    assert cpu_cache.cpu_block_elements(48 << 20) == 1 << 19  # rounded down to a power of two
    assert cpu_cache.cpu_block_elements(64 << 20) == 1 << 20
    assert cpu_cache.cpu_block_elements(4 << 20) == cpu_cache.CPU_BLOCK_BOUNDS[0]
    assert cpu_cache.cpu_block_elements(480 << 20) == cpu_cache.CPU_BLOCK_BOUNDS[1]
    # One process on CPU (this test run): the cpu policy takes the machine's own size.
    assert ops.resolve("cpu").block_elements == cpu_cache.cpu_block_elements(cpu_cache.last_level_cache_bytes())
    q, k, v, g = _qkv((4, 64, 8), (4, 2048, 8))
    np.testing.assert_allclose(A.grouping_attention(q, k, v, ops.resolve("cpu")),
                               C.grouping_attention(q, k, v, max_block_elements=ops.resolve("cpu").block_elements))


def test_policies_choose_their_block(monkeypatch):
    monkeypatch.setattr(cpu_cache, "cpu_block_elements_here", lambda: 1 << 22)
    assert ops.resolve("cpu", process_count=1).block_elements == 1 << 22
    # Several processes all take the fixed block: they must compile the same program.
    assert ops.resolve("cpu", process_count=2).block_elements == DEFAULT_BLOCK_ELEMENTS
    assert ops.resolve("portable").block_elements == DEFAULT_BLOCK_ELEMENTS
    assert ops.resolve("gpu").block_elements == DEFAULT_BLOCK_ELEMENTS
    assert ops.resolve("auto", "cpu", process_count=1).form == "cpu"
    assert ops.resolve("auto", "cuda").form == "gpu" and ops.resolve("auto", "tpu").form == "portable"
    with pytest.raises(ValueError, match="model.kernels must be one of"):
        ops.resolve("cuda")


def test_kernel_never_holds_full_attention_tensor():
    q, k, v, _ = _qkv((2, 4, 256, 16), (2, 4, 4096, 16))
    full = 2 * 4 * 256 * 4096 * 4  # one (B, H, groups, pixels) float32 tensor
    f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(C.grouping_attention(q, k, v, max_block_elements=256 * 512) ** 2),
                         argnums=(0, 1, 2)))
    temp = f.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
    assert temp < full / 4, (temp, full)


def test_grouping_maps_properties():
    q, k, _, _ = _qkv((1, 2, 5, 4), (1, 2, 30, 4))
    a_q, a_k = A.grouping_maps(q, k)
    np.testing.assert_allclose(a_k.sum(-1), 1.0, rtol=1e-6)
    col = a_k.sum(-2)
    np.testing.assert_allclose(a_q.sum(-2), col / (col + A.EPS), rtol=1e-5)  # each pixel's mass split over groups


@pytest.mark.parametrize(
    "grid,kernel,stride",
    [((11, 9), (7, 7), (3, 3)), ((10,), (5,), (2,)), ((5, 6, 7), (3, 3, 3), (2, 1, 2)), ((8, 8), (3, 3), (1, 1)),
     ((9, 9), (4, 4), (1, 1))],
)
def test_sparse_matches_windowed_dense(grid, kernel, stride):
    out = strided_grid(grid, kernel, stride)
    n_out, n_in = int(np.prod(out)), int(np.prod(grid))
    q, k, v, g = _qkv((2, 3, n_out, 4), (2, 3, n_in, 4))
    idx, ok = window_indices(grid, kernel, stride)
    allowed = np.zeros((n_out, n_in), bool)
    for o in range(n_out):
        allowed[o, idx[o][ok[o]]] = True
    assert (allowed.sum(1) <= np.prod(kernel)).all() and allowed.any(1).all()

    def dense(q, k, v):
        a_k = jax.nn.softmax(jnp.where(allowed, jnp.einsum("bhqd,bhkd->bhqk", q, k), -jnp.inf), -1)
        return (a_k / (a_k.sum(-2, keepdims=True) + A.EPS)) @ v

    sparse = lambda q, k, v: sparse_grouping(q, k, v, grid, kernel, stride)[0]
    out_s, grads_s = _value_and_vjp(sparse)(q, k, v, g)
    out_d, grads_d = _value_and_vjp(dense)(q, k, v, g)
    np.testing.assert_allclose(out_s, out_d, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads_s, grads_d):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    _, a_q, a_k = jax.jit(lambda q, k, v: sparse_grouping(q, k, v, grid, kernel, stride))(q, k, v)
    col = scatter_window_map(a_k, idx, ok, n_in).sum(-2)
    # each pixel's mass is split over the groups that see it: column sums are c / (c + eps)
    np.testing.assert_allclose(scatter_window_map(a_q, idx, ok, n_in).sum(-2), col / (col + A.EPS), rtol=1e-5)


@pytest.mark.parametrize("normalise", [True, False])
@pytest.mark.parametrize(
    "grid,kernel,stride",
    [((11, 9), (7, 7), (3, 3)), ((10,), (5,), (2,)), ((5, 6, 7), (3, 3, 3), (2, 1, 2)), ((9, 9), (4, 4), (1, 1))],
)
def test_sparse_update_custom_vjp_matches_autodiff(grid, kernel, stride, normalise):
    # The layer's kernel (custom VJP, maps recomputed in the backward) against autodiff of the
    # plain form: same values, same gradients of q, k and v.
    geom = Geometry(grid, kernel, stride)
    n_out, n_in = int(np.prod(strided_grid(grid, kernel, stride))), int(np.prod(grid))
    q, k, v, g = _qkv((2, 3, n_out, 4), (2, 3, n_in, 4), seed=3)
    custom = lambda q, k, v: sparse_update(q, sparse_blocks(k, geom), sparse_blocks(v, geom), geom, normalise)
    plain = lambda q, k, v: sparse_grouping(q, k, v, grid, kernel, stride, normalise)[0]
    out_c, grads_c = _value_and_vjp(custom)(q, k, v, g)
    out_p, grads_p = _value_and_vjp(plain)(q, k, v, g)
    np.testing.assert_array_equal(out_c, out_p)
    for a, b in zip(grads_c, grads_p):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_sparse_values_may_be_wider_than_the_keys():
    """The update has the values' width, whatever the queries' and keys' head dim."""
    grid, kernel, stride = (11, 9), (7, 7), (3, 3)
    geom = Geometry(grid, kernel, stride)
    n_out, n_in = int(np.prod(strided_grid(grid, kernel, stride))), int(np.prod(grid))
    q, k, _, _ = _qkv((2, 3, n_out, 4), (2, 3, n_in, 4), seed=5)
    v = jax.random.normal(jax.random.PRNGKey(6), (2, 3, n_in, 6))
    plain = sparse_grouping(q, k, v, grid, kernel, stride)[0]
    custom = sparse_update(q, sparse_blocks(k, geom), sparse_blocks(v, geom), geom)
    assert plain.shape == custom.shape == (2, 3, n_out, 6)
    np.testing.assert_allclose(custom, plain, rtol=1e-5, atol=1e-6)
    # each value channel is its own weighted sum: the first four match values of width four
    np.testing.assert_allclose(plain[..., :4], sparse_grouping(q, k, v[..., :4], grid, kernel, stride)[0],
                               rtol=1e-5, atol=1e-6)


def test_sparse_iterations_do_not_keep_their_maps_for_the_backward():
    # Each grouping iteration's backward recomputes its logit-sized maps; if XLA merged that
    # with the forward (CSE) or hoisted it, every iteration's maps would stay alive at once:
    # ~8 logit-sized buffers more per iteration instead of ~4 (the MLP's own residuals).
    def temp(iters, size=36):
        layer = SpatialGroupingAttention(16, 2, 7, 4, iters=iters, attention="sparse", rngs=nnx.Rngs(0))
        graph, params, rest = nnx.split(layer, nnx.Param, ...)
        loss = lambda p, x: jnp.sum(nnx.merge(graph, p, rest)(x, (size, size), (1.0, 1.0)).x ** 2)
        x = jax.ShapeDtypeStruct((2, size * size, 16), jnp.float32)
        return jax.jit(jax.grad(loss)).lower(params, x).compile().memory_analysis().temp_size_in_bytes

    logits_bytes = 2 * 4 * 12 * 12 * 81 * 4  # (B, H, groups, taps) f32
    assert (temp(3) - temp(1)) / 2 < 6 * logits_bytes


def test_window_covers_the_conv_receptive_field():
    # The group at output (1, 1) with kernel 7 / stride 3 / pad 3 sees input rows and cols 0..6.
    idx, ok = window_indices((12, 12), (7, 7), (3, 3))
    out = strided_grid((12, 12), (7, 7), (3, 3))
    cells = sorted(set(int(i) for i in idx[1 * out[1] + 1][ok[1 * out[1] + 1]]))
    assert cells == sorted(r * 12 + c for r in range(7) for c in range(7))


@pytest.mark.parametrize("attention", ["dense", "sparse", "standard"])
def test_sga_layer_shapes_and_maps(attention):
    layer = SpatialGroupingAttention(16, 2, 7, 4, iters=2, attention=attention, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 13 * 10, 16))
    out = nnx.jit(lambda m, x: m(x, (13, 10), (1.0, 2.0), return_maps=True))(layer, x)
    assert out.grid_shape == (5, 4) and out.spacing == (3.0, 6.0)
    assert out.x.shape == (2, 20, 16)
    assert out.attn_q.shape == out.attn_k.shape == (2, 4, 20, 130)
    np.testing.assert_allclose(out.attn_k.sum(-1), 1.0, rtol=1e-5)
    assert np.isfinite(np.asarray(out.x)).all()


def test_reference_compat_changes_only_value_heads():
    kw = dict(feature_dims=16, spatial_dims=2, kernel_size=7, num_heads=4, iters=1)
    fixed = SpatialGroupingAttention(**kw, rngs=nnx.Rngs(0))
    compat = SpatialGroupingAttention(**kw, reference_compat=True, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 81, 16))
    run = nnx.jit(lambda m, x: m(x, (9, 9), (1.0, 1.0)).x)
    assert not np.allclose(run(fixed, x), run(compat, x))  # same weights, different head handling
    one_head = dict(kw, num_heads=1)
    a = run(SpatialGroupingAttention(**one_head, rngs=nnx.Rngs(0)), x)
    b = run(SpatialGroupingAttention(**one_head, reference_compat=True, rngs=nnx.Rngs(0)), x)
    np.testing.assert_allclose(a, b, rtol=1e-6)  # with one head the reshapes coincide


def test_sparse_layer_equals_dense_when_every_window_covers_the_grid():
    # A 9x9 window at stride 1 on a 4x4 grid sees every pixel, so the sparse layer (which
    # scales the queries by temp, not the keys) must give the dense layer's output.
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 16))
    kw = dict(feature_dims=16, spatial_dims=2, kernel_size=9, num_heads=4, stride=1, iters=2)
    sparse = SpatialGroupingAttention(**kw, attention="sparse", rngs=nnx.Rngs(0))
    dense = SpatialGroupingAttention(**kw, attention="dense", rngs=nnx.Rngs(0))
    for layer in (sparse, dense):
        layer.temp.value = jnp.full((1,), 0.7)  # away from its init, so its placement matters
    np.testing.assert_allclose(sparse(x, (4, 4), (1.0, 1.0)).x, dense(x, (4, 4), (1.0, 1.0)).x, rtol=1e-5, atol=1e-5)


def test_small_slices_are_batched_but_cpu_runs_tile_sized_ones_alone():
    """On CPU, 256 x 256-token tiles ran 1.4-1.6x faster one per lax.map step than 8 vmapped."""

    def step(queries, keys, block=DEFAULT_BLOCK_ELEMENTS, slice_batch=1, unbatched=cpu_cache.UNBATCHED_SLICE_ELEMENTS):
        return C._slices_per_step(jnp.zeros((64, queries, 1)), jnp.zeros((64, keys, 1)), block, slice_batch,
                                  unbatched)

    assert step(256, 256) == 1  # 64 Ki elements: the windowed MR tiles
    assert step(256, 256, slice_batch=4) == 4  # the caller's batch still holds
    assert step(128, 128) == DEFAULT_BLOCK_ELEMENTS // (128 * 128)  # 16 Ki: batched up to a block
    assert step(2000, 2000) == 1  # larger than a block: chunked, one at a time
    # Every other form batches small slices up to a block, tiles included.
    assert step(256, 256, unbatched=None) == DEFAULT_BLOCK_ELEMENTS // (256 * 256)


def test_sparse_rounds_are_traced_once():
    """The grouping rounds of a sparse layer are one loop (issue 58): unrolled, each round added its own
    copy of the sparse kernel's ~1,300 operations (forward, recomputation, backward) to the train step,
    and XLA's CPU compiler builds one machine-code kernel per fusion, so the ISIC RAT's step (4 layers
    x 3 rounds) compiled for minutes. A third round must add (almost) nothing to the lowered program."""
    import re

    def operations(iters):
        layer = SpatialGroupingAttention(16, 2, 7, 4, iters=iters, attention="sparse", mlp_dropout=0.1,
                                         rngs=nnx.Rngs(0))
        graph, params, rest = nnx.split(layer, nnx.Param, ...)

        def loss(p, r, x):  # the layer's random stream made in the trace, as the trainer's is
            return jnp.sum(nnx.merge(graph, p, jax.tree.map(lambda a: a, r))(x, (36, 36), (1.0, 1.0)).x ** 2)

        x = jax.ShapeDtypeStruct((2, 36 * 36, 16), jnp.float32)
        return len(re.findall(r"= (stablehlo|chlo)\.", jax.jit(jax.grad(loss)).lower(params, rest, x).as_text()))

    two, three = operations(2), operations(3)
    assert three < two + 50, (two, three)  # unrolled: 3514 -> 4847


def test_looped_rounds_match_the_unrolled_rounds_with_dropout(monkeypatch):
    """The loop runs the rounds' operations in the same order and advances dropout's stream as the
    unrolled rounds did: the same outputs, random state and (to float rounding) gradients."""
    layer = SpatialGroupingAttention(16, 2, 7, 4, iters=3, attention="sparse", mlp_dropout=0.1, rngs=nnx.Rngs(0))
    graph, params, rest = nnx.split(layer, nnx.Param, ...)
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 20 * 20, 16))

    def run():
        def loss(p, r, x):
            m = nnx.merge(graph, p, jax.tree.map(lambda a: a, r))
            out = m(x, (20, 20), (1.0, 1.0)).x
            return jnp.sum(out ** 2), (out, nnx.state(m, nnx.Not(nnx.Param)))

        # Compiled with the kernel emitters users get: XLA's elemental ones (the suite's, tests/conftest.py)
        # round the two programs' outputs 1-2 ulps apart.
        step = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(params, rest, x)
        return step.compile(compiler_options=USER_COMPILE)(params, rest, x)

    (_, (looped, state_l)), grads_l = run()

    def unrolled(self, xo, keys, window, out_spacing):
        for i in range(self.iters):
            xo, _ = self._iteration(xo, None, None, keys, i, window, out_spacing)
        return xo

    monkeypatch.setattr(_SGA, "_looped_iterations", unrolled)
    (_, (reference, state_u)), grads_u = run()
    np.testing.assert_array_equal(looped, reference)
    for a, b in zip(jax.tree.leaves(state_l), jax.tree.leaves(state_u)):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(grads_l), jax.tree.leaves(grads_u)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6 * float(jnp.max(jnp.abs(b))))
