"""The GPU kernels lowered for CUDA on this CPU machine: every attention a cuDNN fused call, no
while loop from chunking, matmuls in bfloat16.

``jax.nn.dot_product_attention(implementation="cudnn")`` asks the local cuDNN for its version at
trace time and raises "cuDNN is not detected." without one; the tests give it a version (9.10) so
the program a GPU would run can be traced and lowered here.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmark_scripts import load
from jaxrat.ops.gpu import dense_sga, fused_attention, masked_attention, multires_attention

fused_attention_calls = load("hlo_calls").fused_attention_calls

FWD = re.compile(r"custom_call @__cudnn\$fmhaSoftmax\(")
BWD = re.compile(r"custom_call @__cudnn\$fmhaSoftmaxBackward\(")
DOT = re.compile(r"stablehlo\.dot_general .*: \((tensor<[^>]*>), (tensor<[^>]*>)\)")


@pytest.fixture(autouse=True)
def cudnn_version(monkeypatch):
    from jax._src.cudnn import fused_attention_stablehlo

    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)


def lower_for_cuda(f, *args) -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def counts(text: str) -> tuple[int, int]:
    return len(FWD.findall(text)), len(BWD.findall(text))


def value_and_grads(f, argnums=(0, 1, 2)):
    return jax.value_and_grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=argnums)


def zeros(*shape, dtype=jnp.bfloat16):
    return jnp.zeros(shape, dtype)


def test_without_cudnn_the_trace_refuses(monkeypatch):
    from jax._src.cudnn import fused_attention_stablehlo

    monkeypatch.undo()
    if fused_attention_stablehlo.cuda_versions is not None:
        pytest.skip("this jaxlib carries the CUDA plugin")
    with pytest.raises(RuntimeError, match="cuDNN is not detected"):
        lower_for_cuda(lambda q: fused_attention(q, q, q, implementation="cudnn"), zeros(2, 64, 64))


def test_fused_attention_is_one_cudnn_call_each_way():
    q = zeros(2, 8, 1024, 64)
    text = lower_for_cuda(value_and_grads(fused_attention), q, q, q)
    assert counts(text) == (1, 1)
    assert "stablehlo.while" not in text and not DOT.search(text)


def test_odd_lengths_and_padded_keys_still_lower_to_cudnn():
    q, k, v = zeros(3, 7, 60), zeros(3, 33, 60), zeros(3, 33, 20)
    f = lambda q, k, v: fused_attention(q, k, v, kv_lengths=jnp.array([33, 10, 1]))
    assert counts(lower_for_cuda(value_and_grads(f), q, k, v)) == (1, 1)
    # the log-sum-exp through cuDNN's own statistics, with padded keys
    lse = lambda q, k, v: fused_attention(q, k, v, kv_lengths=jnp.array([33, 10, 1]), return_lse=True)[1]
    assert counts(lower_for_cuda(lse, q, k, v)) == (1, 0)


def test_more_slices_than_a_cuda_grid_axis_are_split_into_calls():
    q = zeros(70_000, 16, 8)  # e.g. 1024 px windows: 484 tiles x 8 heads x 18 images
    assert counts(lower_for_cuda(value_and_grads(fused_attention), q, q, q)) == (2, 2)


def test_dense_sga_is_five_fused_forwards_and_one_fused_backward():
    q, k = zeros(2, 4, 64, 64), zeros(2, 4, 1024, 64)
    text = lower_for_cuda(value_and_grads(dense_sga), q, k, k)
    # forward: row lse, column lse, U; backward: dW, then the attention whose VJP gives dQ, dK
    assert counts(text) == (5, 1)
    assert "stablehlo.while" not in text and not DOT.search(text)
    fwd_only = lower_for_cuda(dense_sga, q, k, k)
    assert counts(fwd_only) == (3, 0)
    # the log-sum-exps come back in float32 (cuDNN's softmax statistics)
    stats = re.findall(r"custom_call @__cudnn\$fmhaSoftmax\(.*-> \(tensor<[^>]*>, (tensor<[^>]*>)", fwd_only)
    # (the U call returns no statistics: its second result is cuDNN's workspace)
    assert stats[:2] == ["tensor<8x1x64xf32>", "tensor<8x1x1024xf32>"], stats


@pytest.mark.parametrize("window", [None, 8])
def test_multires_attention_windows_lower_to_one_call_per_scale(window):
    segments = [(5, None), (21 * 21, (21, 21)), (16, (4, 4))]  # 21 = 2 whole windows of 8 and a padded one
    x = zeros(2, sum(n for n, _ in segments), 4, 32)
    f = lambda x: multires_attention(x, x, x, segments, window)
    text = lower_for_cuda(value_and_grads(f, argnums=0), x)
    # global form: one call; windowed: the global tokens' call and one for the 21x21 scale
    want = 1 if window is None else 2
    assert counts(text) == (want, want)
    assert "stablehlo.while" not in text and not DOT.search(text)


def test_masked_cross_attention_is_one_cudnn_call_each_way():
    q, k = zeros(2, 8, 100, 32), zeros(2, 8, 1200, 32)
    key_ok = jnp.ones((2, 1, 1200), bool)
    f = lambda q, k, v: masked_attention(q, k, v, key_ok, scale=32**-0.5)
    text = lower_for_cuda(value_and_grads(f), q, k, k)
    assert counts(text) == (1, 1)
    assert "stablehlo.while" not in text and not DOT.search(text)


def test_keys_packed_once_are_gathered_once_for_every_layer():
    """DETR's decoder on the gpu policy: its memory and positions are packed once (attn.pack_keys),
    so the lowered step gathers as often for three layers as for one (each layer gathered its own
    keys and values before: 31.6 GB of the COCO step at 800 px, compiled for an H100), and each layer
    is one cuDNN call each way."""
    from jaxrat import ops
    from jaxrat.ops import attention as attn

    gpu = ops.resolve("gpu", gpu_forms="all")
    memory, pos = zeros(2, 1200, 64), zeros(2, 1200, 64)
    q, w = zeros(2, 100, 64), zeros(64, 64)
    key_ok = jnp.ones((2, 1200), bool).at[1, 1000:].set(False)

    def gathers(layers: int) -> int:
        def decoder(q, memory, pos, w):
            padding, (memory, pos) = attn.pack_keys(key_ok, (memory, pos), gpu)
            split = lambda x: x.reshape(*x.shape[:2], 2, 32)
            for _ in range(layers):
                out = attn.masked_attention(split(q @ w), split((memory + pos) @ w), split(memory @ w), padding, gpu)
                q = q + out.reshape(q.shape)
            return q

        text = lower_for_cuda(value_and_grads(decoder, argnums=(0, 1, 2, 3)), q, memory, pos, w)
        assert counts(text) == (layers, layers)
        # cuDNN reads keys and values token-major as the projections make them: none of the memory's size
        # is transposed on its way in (jax's rule hands the key and value gradients back head-major, a
        # transpose XLA's layout assignment folds into the call: no kernel in the COCO step compiled for an H100)
        moved = re.findall(r"stablehlo\.transpose .*?: \((tensor<[^>]*>)\)", text)
        assert not [m for m in moved if m.startswith("tensor<2x1200x")], moved
        return len(re.findall(r"stablehlo\.(?:gather|scatter)", text))

    assert gathers(3) == gathers(1) > 0


def test_on_a_mesh_the_wrapped_calls_are_found_too():
    """Over several devices jax wraps each cuDNN call in its custom partitioning; the same calls,
    with their global shapes, are found from the wrappers' signatures."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    on = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    q, k = (jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=on) for s in ((8, 4, 64, 16), (8, 4, 1024, 16)))
    text = lower_for_cuda(value_and_grads(dense_sga), q, k, k)
    assert counts(text) == (0, 0) and "CustomSPMDPartitioning" in text
    calls = fused_attention_calls(text)
    assert [c.backward for c in calls].count(False) == 5 and [c.backward for c in calls].count(True) == 1
    single = fused_attention_calls(lower_for_cuda(value_and_grads(dense_sga), *(jnp.zeros(s.shape, s.dtype)
                                                                               for s in (q, k, k))))
    assert sorted(calls) == sorted(single)
    assert sum(c.flops for c in calls) > 0


def test_float32_takes_the_pallas_triton_kernel():
    q = zeros(2, 256, 64, dtype=jnp.float32)
    text = lower_for_cuda(value_and_grads(fused_attention), q, q, q)
    assert counts(text) == (0, 0)
    assert "custom_call @__gpu$xla.gpu.triton" in text


def test_the_portable_form_has_bf16_dots_and_no_custom_calls():
    q = zeros(2, 64, 32)
    text = lower_for_cuda(value_and_grads(lambda *a: dense_sga(*a, implementation="xla")), q, q, q)
    dots = DOT.findall(text)
    assert dots and all(a.endswith("xbf16>") and b.endswith("xbf16>") for a, b in dots), dots
    assert "custom_call" not in text


def test_a_sparse_sga_layer_on_the_gpu_policy_lays_keys_and_values_out_once():
    """The fused kernels read keys and values as head-major slices (token-major in place was slower on
    an H100): the layer's key-value projection is computed, turned and laid out head-major by one Triton
    kernel once for all its iterations (on 576 inputs, 9 tiles of 64), or by XLA's product and one
    transpose (on 575), and their gradients, summed over the iterations by one Triton pass, are written
    by it straight into the projection's gradient (and, where the kernel projects, the input's too);
    queries, updates and their gradients the kernels read and write token-major in place (no transpose).
    Five Triton passes per grouping iteration (three forward, two backward) and those."""
    from flax import nnx

    from jaxrat import ops
    from jaxrat.models.rat import RATConfig
    from jaxrat.models.rat.sga import SpatialGroupingAttention

    iters = 3
    config = RATConfig(feature_dims=32, num_heads=2, iters=iters, sga_kernel_size=7, stride=3, mlp_dropout=0.0)
    layer = SpatialGroupingAttention(config, "sparse", kernels=ops.resolve("gpu", gpu_forms="all"), dtype=jnp.bfloat16,
                                     rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    for grid, projected in (((24, 24), True), ((23, 25), False)):
        n = grid[0] * grid[1]

        def loss(params, x):
            return jnp.sum(nnx.merge(graphdef, params, rest)(x, grid, (1.0, 1.0)).x.astype(jnp.float32))

        text = lower_for_cuda(jax.value_and_grad(loss, argnums=(0, 1)), params, jnp.zeros((2, n, 32), jnp.bfloat16))
        calls = re.findall(r'custom_call @__gpu\$xla\.gpu\.triton\(.*?name = "(\w+)"', text)
        sga = [c for c in calls if c.startswith("sparse_sga_")]
        keys_pass = "sparse_sga_inputs_keys_dx" if projected else "sparse_sga_inputs_keys"  # the former writes dx
        assert len(sga) == iters * 3 + 1 + projected and sga.count(keys_pass) == 1, calls
        assert sga.count("sparse_sga_projection") == projected, calls
        assert all(c.startswith(("fused_mlp_", "layer_norm_")) for c in calls if c not in sga), calls  # fused too
        moved = [t for t in re.findall(r"stablehlo\.transpose .*?: \((tensor<[^>]*>)\)", text) if f"{n}x" in t]
        # forward: keys and values laid out head-major, by the kernel or by XLA; backward: nothing of
        # the gradients (the keys' pass writes the projection's token-major in place, the keys' turned
        # back). With the kernel, the angles' gradient reads the turned keys' pairs (of the one head RoSE
        # turns) against it: an operand order XLA folds into that sum when it compiles
        want = [f"tensor<2x1x{n}x8x2xbf16>"] if projected else [f"tensor<2x{n}x2x16xbf16>"] * 2
        assert sorted(moved) == want, moved


def test_on_a_mesh_the_sparse_kernels_run_per_device_on_laid_out_keys():
    """Over 8 devices the fused sparse SGA passes run under shard_map on each device's images: every
    Triton call takes one image's 8 head slices, keys laid out head-major by sparse_keys."""
    from jaxrat import ops
    from jaxrat.ops import attention as attn

    gpu = ops.resolve("gpu", gpu_forms="all")
    window = attn.Window((64, 64), (7, 7), (3, 3))
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    on = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    q, k, v = (jax.ShapeDtypeStruct((8, n, 8, 16), jnp.bfloat16, sharding=on) for n in (22 * 22, 4096, 4096))

    def update(q, k, v):
        return attn.sparse_grouping_attention(q, attn.sparse_keys(k, v, window, gpu), gpu)

    with jax.set_mesh(mesh):
        text = lower_for_cuda(value_and_grads(update), q, k, v)
    calls = [line for line in text.splitlines() if "custom_call @__gpu$xla.gpu.triton(" in line]
    assert len(calls) == 4 and "sdy.manual_computation" in text
    # one image a device: its 8 head slices of 64 x 64 keys x 16 features, never the 8 images' 64 slices
    operands = [t for line in calls for t in re.findall(r"tensor<\d+x\d+x[a-z0-9]+>", line.split(" : ")[-1])]
    assert {t for t in operands if "x65536x" in t} == {"tensor<8x65536xbf16>"}, operands


def test_on_a_mesh_the_projection_kernel_runs_per_device_with_the_weights_whole():
    """sga_keys over 8 devices: the projection kernel and the passes run under shard_map on
    each device's image, the weights and bias given whole to every device (their gradients summed over
    the devices by the shard_map's transpose)."""
    from jaxrat import ops
    from jaxrat.ops import attention as attn

    gpu = ops.resolve("gpu", gpu_forms="all")
    window = attn.Window((64, 64), (7, 7), (3, 3))
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    on = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    x = jax.ShapeDtypeStruct((8, 4096, 128), jnp.bfloat16, sharding=on)
    q = jax.ShapeDtypeStruct((8, 22 * 22, 8, 16), jnp.bfloat16, sharding=on)
    w, b = jax.ShapeDtypeStruct((128, 256), jnp.float32, sharding=whole), jax.ShapeDtypeStruct((256,), jnp.float32,
                                                                                                sharding=whole)

    def update(x, w, b, q):
        keys = attn.sga_keys(x, w, b, window, gpu, heads=8, dtype=jnp.bfloat16)
        return attn.sparse_grouping_attention(q, keys, gpu)

    with jax.set_mesh(mesh):
        text = lower_for_cuda(value_and_grads(update, argnums=(0, 1, 2, 3)), x, w, b, q)
    calls = [line for line in text.splitlines() if "custom_call @__gpu$xla.gpu.triton(" in line]
    assert len(calls) == 5 and "sdy.manual_computation" in text
    projection = [line for line in calls if 'name = "sparse_sga_projection"' in line]
    assert len(projection) == 1 and sum('name = "sparse_sga_inputs_keys_dx"' in line for line in calls) == 1
    # the keys' pass writes the inputs' gradient: XLA multiplies once, for the weights'
    assert len(re.findall(r"stablehlo\.dot_general", text)) == 1
    # one image's 4096 inputs of 128 channels a device, the (rounded) weights whole
    operands = re.findall(r"tensor<[\dx]+[a-z0-9]+>", projection[0].split(" : ")[-1])
    assert operands[:2] == ["tensor<1x4096x128xbf16>", "tensor<128x256xbf16>"], operands


def test_the_gpu_benchmarks_sparse_sga_forms_lower_for_cuda():
    """benchmarks/sparse_sga_gpu.py runs only on a lent GPU: its kernels-alone and three-iteration
    forms must at least trace and lower here, so that a GPU session does not find them broken."""
    bench = load("sparse_sga_gpu")
    from jaxrat.ops.gpu.sparse_sga.tiling import Tiling
    from jaxrat.ops.portable.sparse_sga import Geometry

    geom = Geometry((64, 64), (7, 7), (3, 3))
    (q, k, v), _ = bench.inputs(geom, 2, 8, 16, jnp.bfloat16)
    sliced = [bench.heads_first(x).reshape(16, -1) for x in (q, k, v)]
    calls = lambda text: text.count("custom_call @__gpu$xla.gpu.triton(")
    assert calls(lower_for_cuda(value_and_grads(bench.on_slices(Tiling.of(geom, 16, 16))), *sliced)) == 4
    assert calls(lower_for_cuda(value_and_grads(bench.three_iterations(geom)), q, k, v)) == 3 * 3 + 1
    # its passes-alone stage: each pass with the operands the model's backward gives it
    n_out, n_in = int(np.prod(geom.out)), int(np.prod(geom.grid))
    stat = lambda n: jnp.zeros((16, n), jnp.float32)
    flat = jnp.zeros((16, n_out * 16), jnp.bfloat16)
    args = (*sliced, flat, stat(n_out), stat(n_in), stat(n_in), stat(n_out), flat)
    for products in (False, True):  # the passes tap by tap and as matrix products
        for name, call in bench.pass_calls(Tiling.of(geom, 16, 16, products=products), 16, n_out, n_in).items():
            assert calls(lower_for_cuda(call, *args)) == 1, (name, products)


def test_the_gpu_mlp_benchmark_s_forms_lower_for_cuda():
    """benchmarks/mlp_gpu.py runs only on a lent GPU: its fused and XLA forms must trace and lower here."""
    bench = load("mlp_gpu")
    args, keep, _ = bench.inputs(256, dtype=jnp.bfloat16)
    grads = lambda f: jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2, 3, 4))
    assert lower_for_cuda(grads(bench.fused(keep)), *args).count("custom_call @__gpu$xla.gpu.triton(") == 3
    assert "custom_call @__gpu$xla.gpu.triton(" not in lower_for_cuda(grads(bench.xla(keep)), *args)


def test_cudnn_s_batch_limit_applies_to_each_device_s_slices(monkeypatch):
    """cuDNN's grid limit is per call, and under a mesh each device calls cuDNN on its own images:
    a batch of slices over the limit in all but within it per device is one call per direction.
    Split over the whole batch, the cut fell inside a device's share and XLA moved activations
    between devices (compiled for 16 H100s: 39 permutes, 3 all-to-alls, 3 all-gathers)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxrat.ops import KernelPolicy
    from jaxrat.ops import attention as attn
    from jaxrat.ops.gpu import fused
    from jaxrat.parallel.mesh import make_mesh

    mesh = make_mesh((("data", 4),), devices=jax.devices()[:4])
    segments = [(64, (8, 8))]
    x = jax.device_put(zeros(8, 64, 2, 32), NamedSharding(mesh, P("data")))  # 2 images a device, 2 heads
    policy = KernelPolicy("gpu", gpu_forms=frozenset({"attention"}))

    def calls(limit: int) -> tuple[int, int]:
        monkeypatch.setattr(fused, "CUDNN_MAX_BATCH", limit)
        f = value_and_grads(lambda q, k, v: attn.multires_attention(q, k, v, segments, None, policy))  # traced anew
        with jax.set_mesh(mesh):
            return counts(lower_for_cuda(f, x, x, x))

    assert calls(6) == (1, 1)  # under the 8 images in all, over a device's 2
    assert calls(1) == (4, 4)  # under a device's 2 images: split there, one slice a call
